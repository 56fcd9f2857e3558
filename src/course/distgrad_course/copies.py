"""The non-finite policy, defined once in `distgrad/non_finite.py`, copied into each
reference file that uses it, so that each file copies alone.

A reference file marks its copy with two comment lines; the first names what it uses:

    # ---- generated from non_finite.py: apply_unless_non_finite, check_policy
    #   (and, where the names run past a line, more lines like this one)
    ...
    # ---- end of the code generated from non_finite.py

Between them go those definitions and every one they use, in `non_finite.py`'s order, with
the comments above each. `python -m distgrad_course.copies` rewrites every stale copy (`make
copies`); `tests/test_copy_alone.py` fails while one is stale (`stale_copies`).
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[2] / "distgrad"
SOURCE = LIBRARY / "non_finite.py"
BEGIN = re.compile(r"^# ---- generated from non_finite\.py: (?P<names>[\w, ]+(?:\n#   [\w, ]+)*)\n",
                   re.MULTILINE)
BEGIN_TEXT = "# ---- generated from non_finite.py: "
END = "# ---- end of the code generated from non_finite.py\n"
NOTE = ("# Copied here so that this file copies alone: edit non_finite.py, then run "
        "`make copies`.\n")


def definitions(source: str) -> dict[str, tuple[str, set[str], bool]]:
    """Each top-level name of `source`: its text (comment lines above it included), the
    top-level names it uses, and whether it is a constant."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    nodes = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            nodes[node.name] = node
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                node.targets[0], ast.Name):
            nodes[node.targets[0].id] = node
    found = {}
    for name, node in nodes.items():
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))]) - 1
        while first > 0 and lines[first - 1].startswith("#"):
            first -= 1
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & set(nodes) - {name}
        found[name] = ("".join(lines[first:node.end_lineno]), used,
                       isinstance(node, ast.Assign))
    return found


def generated(names: list[str], source: str) -> str:
    """The block for a file that uses `names`: their definitions and what they use."""
    defined = definitions(source)
    unknown = sorted(set(names) - set(defined))
    if unknown:
        raise ValueError(f"non_finite.py defines no {', '.join(unknown)}: fix the names in "
                         "the file's '# ---- generated from non_finite.py:' line.")
    wanted, queue = set(), list(names)
    while queue:
        name = queue.pop()
        if name not in wanted:
            wanted.add(name)
            queue.extend(defined[name][1])
    block, previous = "", None
    for name, (text, _, constant) in defined.items():
        if name in wanted:  # constants one under another, two blank lines around the rest
            block += "" if previous is None else "" if constant and previous else "\n\n"
            block += text
            previous = constant
    begin = textwrap.fill(", ".join(names), width=99, initial_indent=BEGIN_TEXT,
                          subsequent_indent="#   ", break_on_hyphens=False)
    return f"{begin}\n{NOTE}\n{block}\n\n{END}"


def regenerate(text: str, source: str) -> str:
    """`text` (a reference file) with its block rewritten; unchanged if it has none."""
    begin = BEGIN.search(text)
    if begin is None:
        return text
    end = text.index(END, begin.start()) + len(END)
    names = [n.strip() for n in re.sub(r"\n#   ", " ", begin.group("names")).split(",")]
    return text[:begin.start()] + generated(names, source) + text[end:]


def stale_copies(library: Path = LIBRARY) -> list[str]:
    """The files under `library` whose block differs from what `non_finite.py` generates."""
    source = (library / "non_finite.py").read_text()
    return [str(path.relative_to(library)) for path in sorted(library.rglob("*.py"))
            if (text := path.read_text()) != regenerate(text, source)]


def files_with_copies(library: Path = LIBRARY) -> list[str]:
    return [str(path.relative_to(library)) for path in sorted(library.rglob("*.py"))
            if BEGIN.search(path.read_text())]


def main() -> int:
    source = SOURCE.read_text()
    for name in stale_copies():
        path = LIBRARY / name
        path.write_text(regenerate(path.read_text(), source))
        print(f"rewrote the non_finite.py copy in src/distgrad/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
