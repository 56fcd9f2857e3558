"""Paths and helpers shared by the site checks (imported by name: no clash with the
`conftest` module of tests/ when both directories are collected in one run)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "site"
DOCS = ROOT / "docs"
SCREENSHOTS = ROOT / "build" / "screenshots"

# Flags this machine (and CI: root, no GPU, no network) needs; Playwright adds
# --headless and a fresh temporary --user-data-dir itself.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str | None:
    return (
        os.environ.get("CHROMIUM")
        or shutil.which("chromium")
        or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    )


def _load_hooks():
    spec = importlib.util.spec_from_file_location(
        "distgrad_site", DOCS / "hooks" / "distgrad_site.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _load_hooks()  # docs/hooks/distgrad_site.py, the MkDocs hooks of the site


def lesson_names() -> list[str]:
    """The lessons in the built site: `site/lessons/NN_slug/index.html`."""
    return sorted(p.parent.name for p in (SITE / "lessons").glob("*/index.html"))


def executed_notebook(name: str) -> dict:
    return json.loads((DOCS / "lessons" / f"{name}.ipynb").read_text(encoding="utf-8"))
