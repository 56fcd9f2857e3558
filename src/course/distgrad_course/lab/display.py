"""Render small tables and source code in a notebook (markdown built by hand, no pandas).

`markdown_table(headers, rows)` returns the markdown text (pure, tested);
`show_table(...)` displays it; `show_environment(report)` displays the versions and
devices of `distgrad_course.environment_report` as a two-column table; `show_code(obj)`
returns the source of a function or class as an `IPython.display.Code` block;
`statements(function)` says what two copies of code must agree on.
"""

from __future__ import annotations

import ast
import html
import inspect
import textwrap


def _cell(value) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, float):
        text = repr(value)
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(headers, rows) -> str:
    """A markdown table: one header row, then one line per row of `rows`.

    Cells are `str(value)` (floats `repr`), with `|` escaped and newlines flattened.

    Raises ValueError if a row does not have one cell per header.
    """
    headers = list(headers)
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |",
             "|" + "---|" * len(headers)]
    for row in rows:
        row = list(row)
        if len(row) != len(headers):
            raise ValueError(f"row {row!r} has {len(row)} cells, expected {len(headers)}.")
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines)


def show_table(headers, rows) -> None:
    """Display `markdown_table(headers, rows)` in the notebook."""
    from IPython.display import Markdown, display

    display(Markdown(markdown_table(headers, rows)))


ENVIRONMENT_METADATA = "distgrad_environment"


def show_environment(report: dict) -> None:
    """Display an environment report (`distgrad_course.environment_report`) as a table, collapsed
    under a one-line summary (TensorFlow, Keras, strategy and replicas) so that a lesson
    opens with its question, not with a screen-high table.

    The report itself rides along in the output's metadata (`ENVIRONMENT_METADATA`), where
    the site's versions page reads it.
    """
    from IPython.display import HTML, display

    def text(value):
        if isinstance(value, (list, tuple)):
            return ", ".join(map(str, value)) or "none"
        return str(value)

    summary = (
        f"Ran on TensorFlow {report.get('tensorflow', '?')}, Keras {report.get('keras', '?')}, "
        f"{report.get('strategy', '?')} × {report.get('replicas', '?')} replicas"
    )
    rows = "".join(
        f"<tr><td>{html.escape(str(key))}</td><td>{html.escape(text(value))}</td></tr>"
        for key, value in report.items()
    )
    display(
        HTML(
            f'<details class="environment"><summary>{html.escape(summary)}</summary>'
            f"<table><thead><tr><th></th><th>value</th></tr></thead><tbody>{rows}</tbody>"
            "</table></details>"
        ),
        metadata={ENVIRONMENT_METADATA: dict(report)},
    )


def show_code(obj):
    """The source of `obj` (function, class or module) as an `IPython.display.Code`."""
    from IPython.display import Code

    return Code(inspect.getsource(obj), language="python")


def statements(function) -> list[str]:
    """The statements of `function`'s body, each as `ast.dump`: what the code does, without
    its layout, comments and docstring. Two copies of a function written with other line
    breaks or comments have equal `statements`."""
    [definition] = ast.parse(textwrap.dedent(inspect.getsource(function))).body
    body = definition.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return [ast.dump(statement) for statement in body]
