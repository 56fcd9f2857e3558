"""Fixtures for the checks of the built site (`make site` first; `make site-test` runs them).

These tests need `site/` and headless Chromium, so they live outside `tests/`: the unit
suite (`make unit`) runs without a built site or a browser.
"""

from __future__ import annotations

import functools
import http.server
import os
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest
from site_helpers import CHROMIUM_ARGS, SCREENSHOTS, SITE, chromium_path


@pytest.fixture(scope="session")
def site() -> Path:
    if not (SITE / "index.html").is_file():
        pytest.fail("site/ is not built: run `make lessons site` (or `make test`) first.")
    return SITE


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output readable
        pass


@pytest.fixture(scope="session")
def site_url(site):
    """The built site served by a local http.server on 127.0.0.1 (a free port)."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="session")
def browser():
    executable = chromium_path()
    if os.environ.get("CHROMIUM") and not Path(executable).exists():
        pytest.fail(f"CHROMIUM={executable} does not exist: point it at a Chromium binary.")
    if executable is None:
        pytest.fail(
            "Headless Chromium not found. Install it (Debian/Ubuntu: "
            "`sudo apt-get install chromium`; `make site-test` does it when run as root) "
            "or set CHROMIUM=/path/to/chromium."
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable, headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield browser
        finally:
            browser.close()


class PageProblems:
    """What went wrong while a page was open: JS errors, failed or external requests."""

    def __init__(self):
        self.errors: list[str] = []
        self.external: list[str] = []
        self.failed: list[str] = []

    def check(self):
        assert not self.errors, f"JavaScript errors: {self.errors}"
        assert not self.external, (
            f"requests outside the site (it must work offline): {self.external}"
        )
        assert not self.failed, f"failed requests: {self.failed}"


@pytest.fixture
def page(browser, site_url):
    """A fresh browser context and page; requests that leave 127.0.0.1 are blocked and
    reported, and so are JavaScript errors and 4xx/5xx responses."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, color_scheme="light")
    problems = PageProblems()

    def route(route):
        if urlparse(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            problems.external.append(route.request.url)
            route.abort()

    context.route("**/*", route)
    page = context.new_page()
    page.on("pageerror", lambda error: problems.errors.append(str(error)))
    page.on(
        "response",
        lambda r: problems.failed.append(f"{r.status} {r.url}") if r.status >= 400 else None,
    )
    page.problems = problems
    page.site_url = site_url
    try:
        yield page
    finally:
        context.close()
    problems.check()


@pytest.fixture(scope="session")
def screenshots() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS
