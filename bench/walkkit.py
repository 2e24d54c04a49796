"""What the JupyterLab walks share: a fresh clone's ``make lab`` (``bench_make_lab.fresh_lab``),
headless Chromium on it, the kernel shut down after the walk, and the walk's row written as
JSON. A walk is ``walk(page, url, token, clone) -> dict``."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_make_lab import fresh_lab

from tests.browser._lab import ARGS, CHROMIUM

__all__ = ["shut_down_kernel", "walk_in_lab"]


def shut_down_kernel(page: Any) -> None:
    """Kernel > Shut Down Kernel (its cluster stops with it), as a person would."""
    page.locator(".lm-MenuBar-itemLabel:text-is('Kernel')").click()
    page.locator(".lm-Menu-itemLabel:text-is('Shut Down Kernel')").click()
    time.sleep(3)


def walk_in_lab(walk: Callable[..., dict[str, Any]], rev: str, out: Path) -> dict[str, Any]:
    """Run ``walk`` on a fresh clone of ``rev`` in JupyterLab; print its row and write it to
    ``out`` (with ``make_lab_s``, the seconds ``make lab`` took to serve)."""
    from playwright.sync_api import sync_playwright

    with (
        tempfile.TemporaryDirectory(prefix="hvdnb-walk-") as tmp,
        fresh_lab(tmp, rev) as (clone, url, token, start_s),
        sync_playwright() as pw,
    ):
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1500, "height": 950})
        row = walk(page, url, token, clone)
        shut_down_kernel(page)
        browser.close()
    row["make_lab_s"] = round(start_s, 1)
    print(json.dumps(row, indent=1))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=1) + "\n")
    return row
