"""MkDocs hooks for the distgrad site (listed under `hooks:` in mkdocs.yml).

A lesson page is an executed notebook rendered by mkdocs-jupyter. Its markdown cells go
through nbconvert's mistune renderer (`nbconvert.filters.markdown_mistune`), not
Python-Markdown: none of the site's `markdown_extensions` apply to them, and MkDocs
neither checks nor rewrites their links. These hooks close that gap and generate what
the pages show from the repository:

* **Links in lessons.** A lesson links other pages as files relative to `docs/lessons/`
  (`../questions.md#q1`, `../call-path.md`, `02_x.ipynb`); those links are rewritten to
  the built pages' URLs. A link to a page the site does not have is a warning, so
  `mkdocs build --strict` fails on it.
* **Lesson header.** Every lesson page gets a box after its title: the questions it
  answers (a lesson answers the questions whose section in `docs/questions.md` links to
  it), downloads of its jupytext source `notebooks/NN_x.py` (copied into the site) and of
  the executed `.ipynb` (copied by mkdocs-jupyter's `include_source`), and how to run it.
* **Notebook diagrams shown.** A ```` ```mermaid ```` fence in a lesson becomes a figure
  that Material draws with the vendored mermaid (nbconvert's wrapper would stay hidden
  without its CDN script).
* **Diagrams drawn once.** `<div class="diagram" data-diagram="NAME">fallback</div>`, in
  a notebook's markdown cell or a markdown page, becomes the mermaid diagram in
  `docs/diagrams/NAME.mmd`; the fallback (usually a link) stays as its caption.
* **Math offline.** mkdocs-jupyter loads MathJax from `custom_mathjax_url` (mkdocs.yml):
  the build copies MathJax 2.7 from the `jupyter-server-mathjax` package (the docs extra)
  to `assets/vendor/mathjax/` in the site, so no page needs a CDN.
* **Versions.** `<div class="executed-versions"></div>` in `docs/versions.md` becomes a
  table of the environment report that each executed lesson printed.
* **Deep dives and answers collapse.** A lesson's markdown cell that begins with a
  heading reading "Deep dive ..." or "Answer ..." starts a collapsed `<details>` block
  (the heading becomes its summary). The block holds that cell and every cell after it
  up to the next cell that begins with a heading of the same or a higher level. In
  JupyterLab they stay ordinary sections; on the page a reader sees the core first.

What a lesson or a module must add by hand (a nav line, a learning-path row, an entry in
`docs/api.md`) is not checked here but by `tests_site/test_site_completeness.py`: the
hooks only generate page content.
"""

from __future__ import annotations

import ast
import html
import importlib.util
import json
import logging
import posixpath
import re
import shutil
from pathlib import Path

import tomllib
from mkdocs.structure.toc import get_toc
from mkdocs.utils import get_relative_url

log = logging.getLogger("mkdocs.plugins.distgrad_site")

LESSONS_DIR = "lessons"
_LESSON_URI = re.compile(r"^lessons/([^/]+)\.ipynb$")
_QUESTION_HEADING = re.compile(r"^##\s+(?P<title>.+?)\s*\{#(?P<qid>q\d+)\}\s*$", re.MULTILINE)
_LESSON_LINK_IN_MD = re.compile(r"\(lessons/([\w.-]+\.ipynb)(?:#[^)]*)?\)")
_HREF = re.compile(r'href="([^"]*)"')
_HEADING = re.compile(r'<h([1-6])[^>]*\bid="([^"]+)"[^>]*>(.*?)</h\1>', re.DOTALL)
_ANCHOR_LINK = re.compile(r'<a class="anchor-link"[^>]*>.*?</a>', re.DOTALL)
_DIAGRAM = re.compile(
    r'<div class="diagram" data-diagram="(?P<name>[\w-]+)"\s*>(?P<inner>.*?)</div>', re.DOTALL
)
_EXECUTED_VERSIONS = '<div class="executed-versions"></div>'
# A ```mermaid fence in a notebook's markdown cell, as nbconvert writes it: its wrapper stays
# hidden (display: none) until nbconvert's own script renders it with mermaid from a CDN.
_NOTEBOOK_MERMAID = re.compile(
    r'<div class="jp-Mermaid">\s*<pre class="mermaid">(?P<source>.*?)</pre>\s*</div>', re.DOTALL
)

_state: dict = {}


def _is_lesson(file) -> bool:
    return bool(_LESSON_URI.match(file.src_uri))


def _stem(file) -> str:
    return _LESSON_URI.match(file.src_uri).group(1)


# --------------------------------------------------------------------------- config


def on_config(config):
    root = Path(config.config_file_path).resolve().parent
    _state.clear()
    _state.update(
        root=root,
        docs=Path(config.docs_dir),
        notebooks=root / "notebooks",
        lesson_pages=[],  # src_uri of lessons in nav order
        sources_to_copy={},  # abs dest path -> abs source path
    )
    return config


def on_nav(nav, config, files):
    # The versions table lists the lessons in nav order.
    _state["lesson_pages"] = [p.file.src_uri for p in nav.pages if _is_lesson(p.file)]
    return nav


# ------------------------------------------------------------------------ rendered HTML


def on_page_content(html_text, page, config, files):
    html_text = _DIAGRAM.sub(lambda m: _diagram(m, page), html_text)
    if _is_lesson(page.file):
        html_text = _NOTEBOOK_MERMAID.sub(_notebook_mermaid, html_text)
        page.toc = get_toc(_toc_from_headings(html_text))
        # Material styles `headerlink` permalinks and leaves them out of search titles
        # (nbconvert's "anchor-link" would show up there as a trailing "¶").
        html_text = html_text.replace('<a class="anchor-link"', '<a class="headerlink"')
        html_text = _rewrite_lesson_links(html_text, page, files)
        html_text = _insert_lesson_header(html_text, page, files)
        html_text = _collapse_deep_dives(html_text, page)
        stem = _stem(page.file)
        dest_dir = Path(page.file.abs_dest_path).parent
        _state["sources_to_copy"][dest_dir / f"{stem}.py"] = _state["notebooks"] / f"{stem}.py"
    if _EXECUTED_VERSIONS in html_text:
        html_text = html_text.replace(_EXECUTED_VERSIONS, _executed_versions_table(page, files))
    return html_text


def _diagram(match, page) -> str:
    name, inner = match.group("name"), match.group("inner").strip()
    source_path = _state["docs"] / "diagrams" / f"{name}.mmd"
    if not source_path.is_file():
        log.warning(
            "%s uses diagram %r but docs/diagrams/%s.mmd does not exist.",
            page.file.src_uri,
            name,
            name,
        )
        return match.group(0)
    source = source_path.read_text(encoding="utf-8").strip()
    caption = f"<figcaption>{inner}</figcaption>" if inner else ""
    return (
        f'<figure class="diagram" data-diagram="{name}">'
        f'<pre class="mermaid"><code>{html.escape(source)}</code></pre>{caption}</figure>'
    )


def _notebook_mermaid(match) -> str:
    """A notebook's mermaid fence drawn like the site's diagrams: by Material, from the
    vendored mermaid, in a figure that is shown (nbconvert's wrapper is hidden offline)."""
    return (
        '<figure class="diagram"><pre class="mermaid"><code>'
        f"{match.group('source').strip()}</code></pre></figure>"
    )


def _toc_from_headings(html_text) -> list[dict]:
    """Table-of-contents tokens (MkDocs' format) from the rendered headings.

    mkdocs-jupyter builds a lesson's TOC from a markdown export in which headings lose
    their `code` spans, so its names *and ids* differ from the page's headings
    ("#2-look-inside-the-call-path-of" for "...-of-apply_gradients"): broken TOC links,
    truncated titles in the TOC and in search. The rendered headings are the truth."""
    tokens: list[dict] = []
    open_tokens: list[dict] = []
    for level, heading_id, inner in _HEADING.findall(html_text):
        token = {
            "level": int(level),
            "id": heading_id,
            "name": _ANCHOR_LINK.sub("", inner).strip(),
            "children": [],
        }
        while open_tokens and open_tokens[-1]["level"] >= token["level"]:
            open_tokens.pop()
        (open_tokens[-1]["children"] if open_tokens else tokens).append(token)
        open_tokens.append(token)
    return tokens


def _rewrite_lesson_links(html_text, page, files):
    base = posixpath.dirname(page.file.src_uri)

    def rewrite(match):
        href = match.group(1)
        if not href or href.startswith(("#", "/")) or re.match(r"^[a-zA-Z][\w+.-]*:", href):
            return match.group(0)
        path, _, fragment = href.partition("#")
        target_uri = posixpath.normpath(posixpath.join(base, path))
        target = files.get_file_from_path(target_uri)
        if target is None:
            log.warning(
                "%s links to %r, which is not a file of the site (docs/%s).",
                page.file.src_uri,
                href,
                target_uri,
            )
            return match.group(0)
        url = get_relative_url(target.url, page.url)
        return f'href="{url}{"#" + fragment if fragment else ""}"'

    return _HREF.sub(rewrite, html_text)


def questions_by_lesson(questions_md: str) -> dict[str, list[tuple[str, str]]]:
    """`{"lessons/NN_x.ipynb": [(qid, title), ...]}` from docs/questions.md: a lesson
    answers each question whose section (a `## title {#qN}` heading and what follows it)
    links to the lesson."""
    answered: dict[str, list[tuple[str, str]]] = {}
    headings = list(_QUESTION_HEADING.finditer(questions_md))
    for i, heading in enumerate(headings):
        end = headings[i + 1].start() if i + 1 < len(headings) else len(questions_md)
        section = questions_md[heading.end() : end]
        for lesson in dict.fromkeys(_LESSON_LINK_IN_MD.findall(section)):
            answered.setdefault(f"{LESSONS_DIR}/{lesson}", []).append(
                (heading.group("qid"), heading.group("title"))
            )
    return answered


def _insert_lesson_header(html_text, page, files):
    stem = _stem(page.file)
    questions_file = files.get_file_from_path("questions.md")
    items = []
    if questions_file is not None:
        answered = questions_by_lesson(Path(questions_file.abs_src_path).read_text("utf-8"))
        links = [
            f'<a href="{get_relative_url(questions_file.url, page.url)}#{qid}">'
            f"{html.escape(title)}</a>"
            for qid, title in answered.get(page.file.src_uri, [])
        ]
        if links:
            items.append(f"<li><strong>Answers</strong> {' · '.join(links)}</li>")
    items.append(
        f'<li><strong>Source</strong> <a class="lesson-source-py" href="{stem}.py" download>'
        f"<code>notebooks/{stem}.py</code></a> (jupytext script, the source of truth) and "
        f'<a class="lesson-source-ipynb" href="{stem}.ipynb" download><code>{stem}.ipynb'
        "</code></a> (this page: the executed notebook, with its outputs)</li>"
    )
    guide = files.get_file_from_path("guides/jupyterlab.md")
    how = (
        f' — <a href="{get_relative_url(guide.url, page.url)}">JupyterLab guide</a>'
        if guide is not None
        else ""
    )
    items.append(
        f"<li><strong>Run it</strong> <code>make install &amp;&amp; .venv/bin/jupyter lab "
        f"notebooks/{stem}.ipynb</code>{how}</li>"
    )
    header = (
        '<div class="admonition abstract lesson-header">'
        '<p class="admonition-title">This lesson</p>'
        f"<ul>{''.join(items)}</ul></div>"
    )
    title_end = html_text.find("</h1>")
    if title_end < 0:
        log.warning(
            "%s has no '# title' heading: its first markdown cell should start with one.",
            page.file.src_uri,
        )
        return header + html_text
    title_end += len("</h1>")
    return html_text[:title_end] + header + html_text[title_end:]


# --------------------------------------------------------------------- collapsed blocks

_CELL_START = '<div class="jp-Cell '
_DIV_TAG = re.compile(r"<div\b|</div>")
_FIRST_HEADING = re.compile(
    r'^\s*<div class="jp-Cell jp-MarkdownCell[^"]*"[^>]*>.*?'
    r'data-mime-type="text/markdown">\s*(?P<heading><h(?P<level>[1-6])\b[^>]*>(?P<inner>.*?)</h(?P=level)>)',
    re.DOTALL,
)
_TAG = re.compile(r"<[^>]+>")
# The words a heading starts with that make it a collapsed block, and the block's class.
COLLAPSED_KINDS = {"Deep dive": "deep-dive example", "Answer": "answer success"}


def _cell_spans(html_text) -> list[tuple[int, int]]:
    """(start, end) of every notebook cell: each `<div class="jp-Cell ...">` to its own
    closing `</div>` (found by counting the divs opened and closed after it)."""
    spans = []
    start = html_text.find(_CELL_START)
    while start >= 0:
        depth, end = 0, None
        for tag in _DIV_TAG.finditer(html_text, start):
            depth += 1 if tag.group(0) != "</div>" else -1
            if depth == 0:
                end = tag.end()
                break
        if end is None:
            break
        spans.append((start, end))
        start = html_text.find(_CELL_START, end)
    return spans


def _leading_heading(cell_html):
    """(level, text, heading html) of the heading a markdown cell begins with, or None."""
    match = _FIRST_HEADING.match(cell_html)
    if match is None:
        return None
    text = html.unescape(_TAG.sub("", _ANCHOR_LINK.sub("", match.group("inner")))).strip()
    text = text.rstrip("¶").strip()
    return int(match.group("level")), text, match.group("heading")


def _collapsed_kind(text):
    for words, css_class in COLLAPSED_KINDS.items():
        if text.startswith(words):
            return css_class
    return None


def _collapse_deep_dives(html_text, page):
    """Wrap each deep dive / answer (see the module docstring) in a closed `<details>`.
    Blocks nest: an answer inside a deep dive is a block of its own inside it."""
    spans = _cell_spans(html_text)
    headings = [_leading_heading(html_text[start:end]) for start, end in spans]
    opened: dict[int, tuple[str, str]] = {}  # first cell -> (css class, heading html)
    closed_after: dict[int, int] = {}  # last cell -> how many blocks end there
    for first, heading in enumerate(headings):
        kind = heading and _collapsed_kind(heading[1])
        if not kind:
            continue
        level, title, heading_html = heading
        last = first
        while last + 1 < len(spans):
            following = headings[last + 1]
            if following is not None and following[0] <= level:
                break
            last += 1
        inside = _HEADING.findall(html_text[spans[first][0] : spans[last][1]])[1:]
        higher = [inner for lvl, _, inner in inside if int(lvl) <= level]
        if higher:
            log.warning(
                "%s: the collapsed block %r holds a heading of its level or higher in the "
                "middle of a cell (%s): start that heading's own markdown cell.",
                page.file.src_uri,
                title,
                _TAG.sub("", _ANCHOR_LINK.sub("", higher[0])).strip().rstrip("¶"),
            )
        opened[first] = (kind, heading_html)
        closed_after[last] = closed_after.get(last, 0) + 1
    if not opened:
        return html_text
    pieces, previous_end = [], 0
    for index, (start, end) in enumerate(spans):
        pieces.append(html_text[previous_end:start])
        cell = html_text[start:end]
        if index in opened:
            kind, heading_html = opened[index]
            pieces.append(
                f'<details class="{kind}"><summary class="collapsed-heading">'
                f"{heading_html}</summary>"
            )
            cell = cell.replace(heading_html, "", 1)
        pieces.append(cell)
        pieces.append("</details>" * closed_after.get(index, 0))
        previous_end = end
    pieces.append(html_text[previous_end:])
    return "".join(pieces)


# ------------------------------------------------------------------------------ versions


def environment_report_of(notebook: Path) -> dict | None:
    """The first `distgrad_course.environment_report()` of the notebook: shown with
    `distgrad_course.lab.display.show_environment` (in the output's metadata) or printed
    as a dict."""
    cells = json.loads(notebook.read_text(encoding="utf-8")).get("cells", [])
    for cell in cells:
        for output in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            shown = output.get("metadata", {}).get("distgrad_environment")
            if isinstance(shown, dict) and {"tensorflow", "keras"} <= shown.keys():
                return shown
            text = output.get("data", {}).get("text/plain") or output.get("text")
            if not text:
                continue
            try:
                value = ast.literal_eval("".join(text))
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                continue
            if isinstance(value, dict) and {"tensorflow", "keras"} <= value.keys():
                return value
    return None


def _devices_summary(report: dict) -> str:
    devices = report.get("devices") or []
    kinds: dict[str, int] = {}
    for name in devices:
        kind = name.rsplit("device:", 1)[-1].split(":")[0] if "device:" in name else name
        kinds[kind] = kinds.get(kind, 0) + 1
    logical = " ".join(f"{n} × {k}" for k, n in kinds.items()) or "—"
    gpus = report.get("physical_gpus") or []
    return f"{logical} ({len(gpus)} physical GPU{'s' if len(gpus) != 1 else ''})"


def _executed_versions_table(page, files) -> str:
    rows = []
    for src_uri in _state["lesson_pages"]:
        lesson = files.get_file_from_path(src_uri)
        report = environment_report_of(Path(lesson.abs_src_path))
        link = f'<a href="{get_relative_url(lesson.url, page.url)}">{_stem(lesson)}</a>'
        if report is None:
            log.warning(
                "%s printed no distgrad_course.environment_report(): its first code cell "
                "must end with it.",
                src_uri,
            )
            rows.append(f"<tr><td>{link}</td><td colspan='6'>no environment report</td></tr>")
            continue
        cells = [
            report.get("python", "?"),
            report.get("tensorflow", "?"),
            report.get("keras", "?"),
            f"{report.get('strategy', '?')} × {report.get('replicas', '?')}",
            _devices_summary(report),
            report.get("cross_device_ops", "?"),
        ]
        rows.append(
            f"<tr><td>{link}</td>"
            + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells)
            + "</tr>"
        )
    head = (
        "<tr><th>lesson</th><th>Python</th><th>TensorFlow</th><th>Keras</th>"
        "<th>strategy × replicas</th><th>devices</th><th>cross-device ops</th></tr>"
    )
    declared = _declared_requirements()
    note = (
        f"<p>Declared in <code>pyproject.toml</code> (allowed, not all verified): {declared}.</p>"
        if declared
        else ""
    )
    return (
        f'<table class="executed-versions"><thead>{head}</thead>'
        f"<tbody>{''.join(rows)}</tbody></table>{note}"
    )


def _declared_requirements() -> str:
    pyproject = _state["root"] / "pyproject.toml"
    if not pyproject.is_file():
        return ""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    wanted = ("tensorflow", "keras", "tf-keras")
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    picked = [r for r in requirements if re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0] in wanted]
    if project.get("requires-python"):
        picked.insert(0, f"python{project['requires-python']}")
    return ", ".join(f"<code>{html.escape(r)}</code>" for r in picked)


# ---------------------------------------------------------------------------- post build


def on_post_build(config):
    for dest, source in _state["sources_to_copy"].items():
        if source.is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, dest)
    _copy_mathjax(Path(config.site_dir) / "assets" / "vendor" / "mathjax")


def _copy_mathjax(dest: Path) -> None:
    """MathJax 2.7 (what mkdocs-jupyter's pages configure) from jupyter-server-mathjax,
    without its translations and accessibility explorer (not loaded by the config)."""
    spec = importlib.util.find_spec("jupyter_server_mathjax")
    static = Path(spec.origin).parent / "static" if spec and spec.origin else None
    if static is None or not (static / "MathJax.js").is_file():
        log.warning(
            "MathJax is missing: the lesson pages would show raw TeX. Install the docs "
            "extra (pip install -e '.[docs]', which brings jupyter-server-mathjax)."
        )
        return
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(static, dest, ignore=shutil.ignore_patterns("localization", "a11y"))
    local = dest / "config" / "local"
    local.mkdir(parents=True, exist_ok=True)
    (local / "distgrad.js").write_text(MATHJAX_LOCAL_CONFIG, encoding="utf-8")


# Loaded after the page's own MathJax configuration (`,local/distgrad` in mkdocs.yml's
# custom_mathjax_url): the package ships only the STIX-Web fonts, not MathJax's default TeX.
MATHJAX_LOCAL_CONFIG = """MathJax.Hub.Config({
  "HTML-CSS": {availableFonts: [], preferredFont: null, webFont: "STIX-Web", imageFont: null},
  SVG: {font: "STIX-Web"}
});
MathJax.Ajax.loadComplete("[MathJax]/config/local/distgrad.js");
"""
