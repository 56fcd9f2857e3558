"""What the site must hold that nothing generates: read from the repository, no build needed.

Adding a lesson or a module takes hand-written entries (docs/guides/writing-lessons.md):
a nav line in mkdocs.yml, a learning-path row in docs/index.md, a `::: module` directive
in docs/api.md. Each check below takes a repository root and returns its problems, one
line each that says the fix (empty: complete), so a test runs it on the real tree and on
a broken copy of it.
"""

from __future__ import annotations

import ast
import json
import re
import textwrap
from pathlib import Path

import yaml

PACKAGE = "distgrad"
# Each package and the page that documents it: the library's API page, and the course's
# instruments (the lab, the pitfalls, the device setup) on a page of their own.
API_PAGES = {"distgrad": ("src/distgrad", "docs/api.md"),
             "distgrad_course": ("src/course/distgrad_course", "docs/course-api.md")}
_DIRECTIVE = re.compile(r"^:::\s+(\S+)\s*$")
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_DOC_HEADING = re.compile(
    r'<h([1-6]) id="(?P<id>[\w.]+)" class="doc doc-heading">(?P<inner>.*?)</h\1>', re.DOTALL
)


class _ConfigLoader(yaml.SafeLoader):
    """mkdocs.yml as data: `!!python/name:` and `!ENV`-style tags load as None."""


_ConfigLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)
_ConfigLoader.add_multi_constructor("!", lambda *_: None)


# ------------------------------------------------------------------------------ lessons


def lesson_sources(root: Path) -> list[str]:
    """Names (`NN_slug`) of the lessons' jupytext sources `notebooks/NN_slug.py`."""
    return sorted(p.stem for p in (root / "notebooks").glob("[0-9][0-9]_*.py"))


def nav_lessons(root: Path) -> list[str]:
    """Names of the `lessons/NN_slug.ipynb` pages in mkdocs.yml's nav, in nav order."""
    config = yaml.load((root / "mkdocs.yml").read_text(encoding="utf-8"), _ConfigLoader)
    found: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            for child in node:
                walk(child)
        elif isinstance(node, str) and (m := re.fullmatch(r"lessons/([\w.-]+)\.ipynb", node)):
            found.append(m.group(1))

    walk(config.get("nav", []))
    return found


def nav_problems(root: Path) -> list[str]:
    """Every lesson source is in the nav; every lesson in the nav has its .py/.ipynb pair."""
    nav = nav_lessons(root)
    problems = [
        f"notebooks/{name}.py is not in the nav: add `- {name[:2]} · Title: "
        f"lessons/{name}.ipynb` under `Lessons:` in mkdocs.yml"
        for name in lesson_sources(root)
        if name not in nav
    ]
    for name in nav:
        for suffix in (".py", ".ipynb"):
            if not (root / "notebooks" / f"{name}{suffix}").is_file():
                problems.append(
                    f"mkdocs.yml's nav lists lessons/{name}.ipynb, "
                    f"but notebooks/{name}{suffix} does not exist"
                )
    return problems


def learning_path_problems(root: Path) -> list[str]:
    """The `## Learning path` section of docs/index.md links every lesson in the nav."""
    index = (root / "docs" / "index.md").read_text(encoding="utf-8")
    section = re.search(r"^## Learning path\s*$(.*?)(?=^## |\Z)", index, re.MULTILINE | re.DOTALL)
    if section is None:
        return ["docs/index.md has no `## Learning path` section"]
    return [
        f"the learning path in docs/index.md does not link lessons/{name}.ipynb: add a row "
        f"`| [{name[:2]} · Title](lessons/{name}.ipynb) | [Qn](questions.md#qn) | "
        "what the reader learns |`"
        for name in nav_lessons(root)
        if f"](lessons/{name}.ipynb" not in section.group(1)
    ]


def executed_lesson_problems(root: Path) -> list[str]:
    """The executed copies in docs/lessons/ (what the site renders): one per lesson in the
    nav, each with its notebooks/ pair and with outputs."""
    executed = root / "docs" / "lessons"
    problems = [
        f"docs/lessons/{name}.ipynb is missing: run `make lessons`"
        for name in nav_lessons(root)
        if not (executed / f"{name}.ipynb").is_file()
    ]
    for copy in sorted(executed.glob("*.ipynb")):
        for suffix in (".py", ".ipynb"):
            if not (root / "notebooks" / f"{copy.stem}{suffix}").is_file():
                problems.append(
                    f"docs/lessons/{copy.name} has no notebooks/{copy.stem}{suffix}: an "
                    "executed copy of a lesson that is gone (`make lessons` removes it)"
                )
        cells = json.loads(copy.read_text(encoding="utf-8")).get("cells", [])
        if not any(c.get("outputs") for c in cells if c.get("cell_type") == "code"):
            problems.append(f"docs/lessons/{copy.name} has no outputs: run `make lessons`")
    return problems


# -------------------------------------------------------------------------- API page


def public_modules(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """`{"package.x.y": path}` for every module and subpackage of `package` (its folder in
    API_PAGES), at any depth, whose name does not start with `_` (a package's path is its
    __init__.py)."""
    modules: dict[str, Path] = {}

    def walk(directory: Path, prefix: str):
        for path in sorted(directory.iterdir()):
            if path.name.startswith("_"):
                continue
            if path.suffix == ".py":
                modules[f"{prefix}.{path.stem}"] = path
            elif (path / "__init__.py").is_file():
                modules[f"{prefix}.{path.name}"] = path / "__init__.py"
                walk(path, f"{prefix}.{path.name}")

    walk(root / API_PAGES[package][0], package)
    return modules


def public_members(path: Path) -> list[str]:
    """The classes and functions a module documents: its literal `__all__` if it has one,
    else its top-level `def`/`class` names without a leading `_`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:
                break  # computed __all__: fall back to the definitions
    return [
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and not node.name.startswith("_")
    ]


def api_directives(api_md: str) -> dict[str, dict]:
    """`{identifier: options}` for each mkdocstrings `::: identifier` of a page (the
    indented YAML block under it holds its `options:`); HTML comments are skipped."""
    lines = _COMMENT.sub("", api_md).splitlines()
    directives: dict[str, dict] = {}
    for i, line in enumerate(lines):
        if not (match := _DIRECTIVE.match(line)):
            continue
        block = []
        for following in lines[i + 1 :]:
            if not following.strip() or not following[0].isspace():
                break
            block.append(following)
        config = yaml.safe_load(textwrap.dedent("\n".join(block))) if block else None
        directives[match.group(1)] = (config or {}).get("options") or {}
    return directives


def _documented_by_directive(module: str, directives: dict[str, dict]) -> bool:
    """`::: module`, or `::: package` with `show_submodules: true` for a package above it."""
    if module in directives:
        return True
    parts = module.split(".")
    return any(
        directives.get(".".join(parts[:n]), {}).get("show_submodules") is True
        for n in range(1, len(parts))
    )


def api_problems(root: Path) -> list[str]:
    """Each package's page (API_PAGES) documents every public module of it: by its own
    directive, by a package's with `show_submodules: true`, or member by member
    (`::: module.Name` for each)."""
    problems = []
    for package, (_, page) in API_PAGES.items():
        directives = api_directives((root / page).read_text(encoding="utf-8"))
        for module, path in public_modules(root, package).items():
            members = public_members(path)
            if _documented_by_directive(module, directives) or (
                members and all(f"{module}.{name}" in directives for name in members)
            ):
                continue
            problems.append(f"{module} is not in {page}: add `::: {module}` where it belongs")
    return problems


def defining_module(root: Path, name: str) -> str | None:
    """The public module of src/distgrad whose top level defines `class name`."""
    for module, path in public_modules(root).items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(n, ast.ClassDef) and n.name == name for n in tree.body):
            return module
    return None


def api_class_problems(root: Path, names) -> list[str]:
    """docs/api.md lists each class: `::: module.Name`, or its module's directive (one
    with a `members:` list must name it)."""
    directives = api_directives((root / "docs" / "api.md").read_text(encoding="utf-8"))
    problems = []
    for name in names:
        module = defining_module(root, name)
        if module is None:
            problems.append(f"no module of src/{PACKAGE} defines class {name}")
            continue
        if {f"{module}.{name}", f"{PACKAGE}.{name}"} & directives.keys():
            continue
        members = directives.get(module, {}).get("members")
        if _documented_by_directive(module, directives) and (
            not isinstance(members, list) or name in members
        ):
            continue
        problems.append(f"docs/api.md does not list {name}: add `::: {module}.{name}`")
    return problems


# ------------------------------------------------------------------ the built API page


def doc_headings(api_html: str) -> dict[str, str]:
    """`{id: inner html}` of the headings mkdocstrings rendered (`class="doc doc-heading"`)."""
    return {m.group("id"): m.group("inner") for m in _DOC_HEADING.finditer(api_html)}


def built_api_problems(root: Path, api_html: str, package: str = PACKAGE) -> list[str]:
    """The built page of `package` has a heading for every public module of it, or for each
    of its members."""
    headings = doc_headings(api_html)
    problems = []
    for module, path in public_modules(root, package).items():
        members = public_members(path)
        if module in headings or (members and all(f"{module}.{n}" in headings for n in members)):
            continue
        problems.append(f"the built API page has no heading for {module} (nor for its members)")
    return problems


def built_api_class_problems(api_html: str, names) -> list[str]:
    """The built API page has a class heading (mkdocstrings' `doc-symbol-class` badge, as
    `show_symbol_type_heading` renders it) for each class."""
    headings = doc_headings(api_html)
    return [
        f"the built API page has no class heading for {name}"
        for name in names
        if not any(
            heading_id.startswith(f"{PACKAGE}.")
            and heading_id.endswith(f".{name}")
            and "doc-symbol-class" in inner
            for heading_id, inner in headings.items()
        )
    ]
