"""The authoring patterns of docs/guides/writing-lessons.md work, and the site hooks
(docs/hooks/distgrad_site.py) compute what the pages show. No built site needed."""

from __future__ import annotations

import re

import nbformat
import pytest
from site_helpers import DOCS, ROOT, hooks

ADMONITION_CELL = """\
<div class="admonition failure">
<p class="admonition-title">Symptom</p>

`RuntimeError` with **bold** and a [link](../call-path.md).

* one
* two

</div>
"""

DIAGRAM_CELL = """\
<div class="diagram" data-diagram="call-path">

[The call path](../call-path.md#call-path)

</div>
"""


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """A notebook with the patterns, rendered the way mkdocs-jupyter renders lessons."""
    from mkdocs_jupyter import convert

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_markdown_cell("# Title"),
        nbformat.v4.new_markdown_cell(ADMONITION_CELL),
        nbformat.v4.new_markdown_cell(DIAGRAM_CELL),
        nbformat.v4.new_markdown_cell("```mermaid\nflowchart LR\n  a --> b\n```"),
    ]
    path = tmp_path_factory.mktemp("nb") / "patterns.ipynb"
    nbformat.write(notebook, path)
    return convert.nb2html(str(path))


def test_notebook_markdown_is_not_python_markdown(tmp_path):
    # Why the patterns exist: `!!!` admonitions stay text in a notebook markdown cell.
    from mkdocs_jupyter import convert

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_markdown_cell('!!! warning "Fix"\n    body')]
    nbformat.write(notebook, tmp_path / "n.ipynb")
    body = convert.nb2html(str(tmp_path / "n.ipynb"))
    assert "!!! warning" in body and 'class="admonition' not in body


def test_html_admonition_in_a_notebook_renders_its_markdown(rendered):
    start = rendered.index('<div class="admonition failure">')
    box = rendered[start : rendered.index("</div>", start)]
    assert '<p class="admonition-title">Symptom</p>' in box
    assert "<code>RuntimeError</code>" in box and "<strong>bold</strong>" in box
    assert "<li>two</li>" in box  # the list is closed inside the box


def test_mermaid_fence_in_a_notebook_becomes_a_mermaid_block(rendered):
    assert '<pre class="mermaid">' in rendered


class _Page:
    class file:
        src_uri = "lessons/patterns.ipynb"


def test_diagram_placeholder_becomes_the_shared_diagram_with_its_caption(rendered):
    hooks._state.update(docs=DOCS)
    match = hooks._DIAGRAM.search(rendered)
    assert match and match.group("name") == "call-path"
    figure = hooks._diagram(match, _Page)
    source = (DOCS / "diagrams" / "call-path.mmd").read_text(encoding="utf-8").strip()
    assert figure.startswith('<figure class="diagram" data-diagram="call-path">')
    assert '<pre class="mermaid"><code>sequenceDiagram' in figure
    assert source.splitlines()[-1].strip().replace(">", "&gt;") in figure
    assert '<figcaption><p><a href="../call-path.md#call-path">' in figure


def test_questions_md_says_which_lesson_answers_which_question():
    answered = hooks.questions_by_lesson((DOCS / "questions.md").read_text(encoding="utf-8"))
    assert answered["lessons/01_where_gradients_sync.ipynb"][0][0] == "q1"
    sample = ("## Q7 · One {#q7}\nsee (lessons/02_x.ipynb) and (lessons/03_y.ipynb#s)\n"
              "## Q8 · Two {#q8}\n(lessons/03_y.ipynb)\n")
    assert hooks.questions_by_lesson(sample) == {
        "lessons/02_x.ipynb": [("q7", "Q7 · One")],
        "lessons/03_y.ipynb": [("q7", "Q7 · One"), ("q8", "Q8 · Two")],
    }


def test_toc_is_built_from_the_rendered_headings_with_their_code():
    page = (
        '<h1 id="t">T<a class="anchor-link" href="#t">¶</a></h1>'
        '<h2 id="a-x">A <code>x</code><a class="anchor-link" href="#a-x">¶</a></h2>'
        '<h3 id="b">B</h3><h2 id="c">C</h2>'
    )
    [title] = hooks._toc_from_headings(page)
    assert title["id"] == "t" and title["name"] == "T"
    assert [(c["id"], c["name"]) for c in title["children"]] == [
        ("a-x", "A <code>x</code>"),
        ("c", "C"),
    ]
    assert title["children"][0]["children"][0]["id"] == "b"


def test_environment_report_is_read_from_the_executed_lesson(tmp_path):
    notebook = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("distgrad_course.environment_report(strategy)")
    cell.outputs = [
        nbformat.v4.new_output("stream", text="INFO: something\n"),
        nbformat.v4.new_output(
            "execute_result",
            data={
                "text/plain": "{'python': '3.11.7',\n 'tensorflow': '2.21.0',\n 'keras': '3.15.1'}"
            },
        ),
    ]
    notebook.cells = [cell]
    nbformat.write(notebook, tmp_path / "l.ipynb")
    assert hooks.environment_report_of(tmp_path / "l.ipynb") == {
        "python": "3.11.7",
        "tensorflow": "2.21.0",
        "keras": "3.15.1",
    }
    notebook.cells = [nbformat.v4.new_code_cell("1")]
    nbformat.write(notebook, tmp_path / "none.ipynb")
    assert hooks.environment_report_of(tmp_path / "none.ipynb") is None


def test_every_diagram_is_used_somewhere():
    used = "".join(p.read_text(encoding="utf-8") for p in DOCS.rglob("*.md"))
    used += "".join(p.read_text(encoding="utf-8") for p in (ROOT / "notebooks").glob("*.py"))
    for diagram in (DOCS / "diagrams").glob("*.mmd"):
        assert f'data-diagram="{diagram.stem}"' in used, diagram.name


def test_vendored_mermaid_is_the_one_recorded():
    import hashlib

    script = DOCS / "assets" / "vendor" / "mermaid" / "mermaid.min.js"
    recorded = (script.parent / "VERSION").read_text(encoding="utf-8").split()[-1]
    assert hashlib.sha256(script.read_bytes()).hexdigest() == recorded
    # It defines the global `mermaid` that Material looks for before using a CDN.
    assert 'globalThis["mermaid"]' in script.read_text(encoding="utf-8")[-300:]


def _markdown_cell(heading: str) -> str:
    return (
        '<div class="jp-Cell jp-MarkdownCell jp-Notebook-cell" id="cell-id=m">\n'
        '<div class="jp-Cell-inputWrapper"><div class="jp-RenderedHTMLCommon jp-RenderedMarkdown '
        'jp-MarkdownOutput" data-mime-type="text/markdown">\n'
        f'{heading}<p>text</p></div></div></div>'
    )


_CODE_CELL = (
    '<div class="jp-Cell jp-CodeCell jp-Notebook-cell">\n<div class="jp-Cell jp-CodeCell '
    'jp-Notebook-cell" id="cell-id=c"><pre>code</pre></div></div>'
)


def test_deep_dives_and_answers_collapse_up_to_the_next_heading_of_their_level():
    def h(level, text, anchor):
        link = f'<a class="headerlink" href="#{anchor}">¶</a>'
        return f'<h{level} id="{anchor}">{text}{link}</h{level}>'

    cells = [
        _markdown_cell(h(2, "1 · The fix", "fix")), _CODE_CELL,
        _markdown_cell(h(2, "Deep dive · The errors", "dd")), _CODE_CELL,
        _markdown_cell(h(3, "Inside", "in")), _CODE_CELL,
        _markdown_cell(h(2, "Exercises", "ex")),
        _markdown_cell(h(3, "Exercise 1 · k", "e1")), _markdown_cell(h(4, "Answer", "a1")),
        _CODE_CELL,
        _markdown_cell(h(3, "Exercise 2 · R", "e2")),
    ]
    page = '<div class="jp-Notebook">' + "".join(cells) + "</div>"
    collapsed = hooks._collapse_deep_dives(page, _Page)
    skeleton = re.findall(r'<details class="[\w -]+">|</details>|<h\d id="\w+"|<pre>', collapsed)
    assert skeleton == [
        '<h2 id="fix"', "<pre>",
        '<details class="deep-dive example">', '<h2 id="dd"', "<pre>", '<h3 id="in"', "<pre>",
        "</details>",
        '<h2 id="ex"', '<h3 id="e1"',
        '<details class="answer success">', '<h4 id="a1"', "<pre>", "</details>",
        '<h3 id="e2"',
    ]
    # The heading is the summary line, not repeated inside.
    assert collapsed.count('id="dd"') == 1
    assert '<summary class="collapsed-heading"><h2 id="dd">' in collapsed
    assert hooks._collapse_deep_dives(cells[0], _Page) == cells[0]
