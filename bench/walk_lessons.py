"""The README's quick start, walked as a student walks it: ``make lab`` on a fresh clone, then
every lesson opened in JupyterLab (headless Chromium) and run with Run > Run All Cells.

The walk clones the repository (``--rev``, default ``HEAD``) into a temporary folder, runs
``make lab`` there (the install step and the JupyterLab it opens on ``notebooks/``), reads the
server's address from its output, and for each lesson:

1. opens it, waits for the kernel's "| Idle" in the status bar;
2. clicks Run > Run All Cells and waits until no cell is queued or running (``[*]``) and the
   kernel is idle again;
3. saves it (Ctrl+S) and reads the saved notebook from the clone: the error outputs in it are
   exactly the error boxes the page shows;
4. takes screenshots: the first error box if there is one, and the end of the notebook.

It prints a table (lesson, seconds, cells run, error outputs) and writes
``bench/results/walk_lessons.json``; screenshots go to ``test-artifacts/walk/``. Needs
Debian's chromium and playwright (``make test`` installs it). It exits 1 when a lesson shows
an error. Usage: ``python bench/walk_lessons.py [--rev REV] [LESSON_PREFIX ...]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from bench_make_lab import fresh_lab
from walkkit import shut_down_kernel

from tests.browser._lab import ARGS, CHROMIUM

SHOTS = ROOT / "test-artifacts" / "walk"
OUT = ROOT / "bench" / "results" / "walk_lessons.json"
#: the notebook on screen (Lumino hides the other tabs' panels with lm-mod-hidden)
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"


def _errors(nb: dict) -> list[str]:
    found = []
    for i, cell in enumerate(nb["cells"], 1):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                found.append(f"cell {i}: {out.get('ename')}: {out.get('evalue')}"[:300])
    return found


def walk(page, url: str, token: str, clone: Path, name: str, timeout: float) -> dict:
    stem = Path(name).stem
    t0 = time.perf_counter()
    # a workspace of its own: the lesson opens alone, not beside the tabs of the last one
    page.goto(f"{url}/lab/workspaces/walk-{stem[:2]}/tree/{name}?reset&token={token}")
    page.wait_for_selector("text=/\\| Idle/", timeout=120_000)
    try:
        page.locator(".jp-toast-button:has-text('No')").click(timeout=2000)
    except Exception:
        pass
    page.locator(f"{PANEL} .jp-Cell").first.click()
    page.locator(".lm-MenuBar-itemLabel:text-is('Run')").click()
    page.locator(".lm-Menu-itemLabel:text-is('Run All Cells')").click()
    # started: some cell queued or running; done: none, and the kernel idle again
    page.wait_for_function(
        f"() => [...document.querySelectorAll('{PANEL} .jp-InputPrompt')]"
        ".some(p => p.textContent.includes('*'))",
        timeout=60_000,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = page.evaluate(
            f"() => [...document.querySelectorAll('{PANEL} .jp-InputPrompt')]"
            ".filter(p => p.textContent.includes('*')).length"
        )
        if busy == 0 and page.locator("text=/\\| Idle/").count():
            break
        time.sleep(1)
    seconds = time.perf_counter() - t0
    page.keyboard.press("Control+s")
    time.sleep(2)
    nb = json.loads((clone / "notebooks" / name).read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    ran = sum(1 for c in code if c.get("execution_count"))
    errors = _errors(nb)
    shots = []
    err_box = page.locator(
        f"{PANEL} .jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
    )
    if errors and err_box.count():
        err_box.first.scroll_into_view_if_needed()
        shot = SHOTS / f"{stem}-error.png"
        page.screenshot(path=str(shot))
        shots.append(str(shot))
    page.locator(f"{PANEL} .jp-Cell").last.scroll_into_view_if_needed()
    shot = SHOTS / f"{stem}-end.png"
    page.screenshot(path=str(shot))
    shots.append(str(shot))
    return {
        "lesson": stem,
        "seconds": round(seconds, 1),
        "cells": len(code),
        "cells_run": ran,
        "errors": errors,
        "screenshots": shots,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("lessons", nargs="*", help="lesson name prefixes (default: all ten)")
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--timeout", type=float, default=420, help="seconds a lesson may run")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="hvdnb-walk-") as tmp,
        fresh_lab(tmp, args.rev) as (
            clone,
            url,
            token,
            start_s,
        ),
    ):
        names = sorted(p.name for p in (clone / "notebooks").glob("[0-9][0-9]-*.ipynb"))
        if args.lessons:
            names = [n for n in names if any(n.startswith(x) for x in args.lessons)]
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
            for name in names:
                page = browser.new_page(viewport={"width": 1500, "height": 950})
                try:
                    row = walk(page, url, token, clone, name, args.timeout)
                except Exception as exc:  # the table says which lesson and why
                    shot = SHOTS / f"{Path(name).stem}-failed.png"
                    page.screenshot(path=str(shot))
                    row = {
                        "lesson": Path(name).stem,
                        "errors": [f"walk: {exc}"[:300]],
                        "screenshots": [str(shot)],
                    }
                # shut the lesson's kernel down (its cluster with it) before the next one
                shut_down_kernel(page)
                page.close()
                rows.append(row)
                print(
                    f"| {row['lesson']} | {row.get('seconds', '-')} s | "
                    f"{row.get('cells_run', '-')}/{row.get('cells', '-')} cells | "
                    f"{len(row['errors'])} errors | {'; '.join(row['errors'])[:200]}",
                    flush=True,
                )
            browser.close()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"make_lab_s": round(start_s, 1), "rows": rows}, indent=1) + "\n")
    print(f"wrote {OUT}; screenshots in {SHOTS}")
    if any(r["errors"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
