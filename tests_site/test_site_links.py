"""Every internal link of the built site resolves: the target file exists and, for a
`#fragment`, the target page has an element with that id.

`mkdocs build --strict` checks links in markdown pages; lesson pages (rendered notebooks)
and generated parts (the table of contents, the lesson header, mkdocstrings' cross
references) are only checked here.
"""

from __future__ import annotations

import html.parser
import posixpath
from functools import cache
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from site_helpers import SITE


class _Collector(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[str, str]] = []  # (attribute, value)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("id", "name"):
            if attrs.get(key) and (key == "id" or tag == "a"):
                self.ids.add(attrs[key])
        if tag in {"a", "link"} and attrs.get("href") is not None:
            self.links.append(("href", attrs["href"]))
        if tag in {"img", "script", "iframe", "source"} and attrs.get("src"):
            self.links.append(("src", attrs["src"]))


@cache
def parse(path: Path) -> _Collector:
    collector = _Collector()
    collector.feed(path.read_text(encoding="utf-8"))
    return collector


def html_pages() -> list[Path]:
    # 404.html is served from any depth, so its relative links are not meant to resolve.
    return sorted(p for p in SITE.rglob("*.html") if p.name != "404.html")


def resolve(page: Path, link: str) -> tuple[Path, str] | None:
    """(target file, fragment) for an internal link, None for an external one."""
    parsed = urlparse(link)
    if parsed.scheme or parsed.netloc or link.startswith(("mailto:", "javascript:", "data:")):
        return None
    fragment = unquote(parsed.fragment)
    if not parsed.path:
        return page, fragment
    if parsed.path.startswith("/"):
        target = SITE / parsed.path.lstrip("/")
    else:
        relative = posixpath.normpath(
            posixpath.join(page.parent.relative_to(SITE).as_posix(), unquote(parsed.path))
        )
        if relative.startswith(".."):
            return SITE / "__outside_the_site__" / relative, fragment
        target = SITE / relative
    if parsed.path.endswith("/") or target.is_dir():
        target = target / "index.html"
    return target, fragment


def test_the_site_is_built(site):
    assert html_pages(), "no pages in site/"


@pytest.mark.parametrize("page", html_pages(), ids=lambda p: p.relative_to(SITE).as_posix())
def test_every_internal_link_and_anchor_resolves(site, page):
    broken = []
    for attribute, link in parse(page).links:
        resolved = resolve(page, link)
        if resolved is None:
            continue
        target, fragment = resolved
        if not target.is_file():
            broken.append(f"{attribute}={link!r}: no file {target.relative_to(SITE.parent)}")
        elif fragment and target.suffix == ".html" and fragment not in parse(target).ids:
            broken.append(
                f"{attribute}={link!r}: no id {fragment!r} in {target.relative_to(SITE).as_posix()}"
            )
    assert not broken, "\n".join(broken)


def test_the_link_checker_catches_a_missing_page_and_a_missing_anchor(site, tmp_path):
    home = SITE / "index.html"
    assert resolve(home, "questions/#q1") == (SITE / "questions" / "index.html", "q1")
    target, fragment = resolve(home, "questions/#no-such-anchor")
    assert fragment not in parse(target).ids
    target, _ = resolve(home, "no-such-page/")
    assert not target.is_file()
    assert resolve(home, "https://example.org/") is None
