"""A reload mid-training, walked as a person meets it: ``make lab`` on a fresh clone, a
notebook in JupyterLab (headless Chromium) that starts 2 ranks and trains below the fold,
printing a line every 200 steps; the page is reloaded three times while the cell trains.

For each reload it measures, from the reloaded page's ``domcontentloaded``: the notebook
drawn (``drawn_s``: JupyterLab's own load), the panel back beside it (``panel_s``), the
cell's live line showing a step past the one shown before the reload (``live_s``), and a
printed line newer than the newest before the reload (``line_s``; the ranks print every
~2 s); and each of the last three after the notebook was drawn (``*_after_drawn_s``: what
a person waits for once the page is on the screen). Then the cell is released and it checks that the
page and the saved file hold every rank's every line, in order.

Screenshots: ``test-artifacts/walk/reload-*.png``. Writes ``bench/results/walk_reload.json``;
exits 1 when a line is missing in the page or the file, or a reload's live line took more
than 2 s. Usage: ``python bench/walk_reload.py [--rev REV]``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from walkkit import walk_in_lab

from tests.browser._lab import HELD, printed_steps, write_notebook

SHOTS = ROOT / "test-artifacts" / "walk"
OUT = ROOT / "bench" / "results" / "walk_reload.json"
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"
SIDE = (
    "document.querySelectorAll('.hvdnb-panel').length > "
    "document.querySelectorAll('.jp-Notebook .hvdnb-panel').length"
)
RELOADS = 3


def _live(cell) -> int:
    line = cell.locator(".hvdnb-liveline")
    if not line.count():
        return -1
    m = re.search(r"step (\d+)", line.first.inner_text())
    return int(m.group(1)) if m else -1


#: what the page shows now, read in one go with no waiting: the notebook drawn, the panel
#: beside it, the training cell's live line and text
LOOK = """() => {
  const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
  const cells = nb ? nb.querySelectorAll('.jp-Cell') : [];
  const cell = cells.length > 2 ? cells[2] : null;
  const line = cell ? cell.querySelector('.hvdnb-liveline') : null;
  const side = document.querySelectorAll('.hvdnb-panel').length >
      document.querySelectorAll('.jp-Notebook .hvdnb-panel').length;
  return {drawn: cells.length > 2, side: side, live: line ? line.innerText : '',
          text: cell ? cell.innerText : ''};
}"""


def _one_reload(page, n: int) -> dict:
    """Reload; from the reloaded page's ``domcontentloaded``, the seconds until the notebook
    is drawn, the panel is beside it, the live line passed the step shown before and a
    newer printed line is in the cell (all read every 50 ms, side by side)."""
    cell = page.locator(f"{PANEL} .jp-Cell").nth(2)
    before_live = _live(cell)
    before_line = max(max(v) for v in printed_steps(cell.inner_text()).values())
    page.reload()
    page.wait_for_load_state("domcontentloaded")
    t0 = time.monotonic()
    seen: dict[str, float] = {}
    while len(seen) < 4 and time.monotonic() - t0 < 60:
        look = page.evaluate(LOOK)
        now = round(time.monotonic() - t0, 2)
        m = re.search(r"step (\d+)", look["live"])
        # past what the old page may have written in its last moment (~0.25 s of steps)
        checks = {
            "drawn_s": look["drawn"],
            "panel_s": look["side"],
            "live_s": bool(m) and int(m.group(1)) > before_live + 25,
            "line_s": max([0, *[max(v) for v in printed_steps(look["text"]).values()]])
            > before_line,
        }
        for name, ok in checks.items():
            if ok and name not in seen:
                seen[name] = now
        time.sleep(0.05)
    page.screenshot(path=str(SHOTS / f"reload-{n}.png"))
    row: dict = {k: seen.get(k) for k in ("drawn_s", "panel_s", "live_s", "line_s")}
    # what a person waits for once the notebook is on the screen
    for k in ("panel_s", "live_s", "line_s"):
        row[k.replace("_s", "_after_drawn_s")] = (
            None if row[k] is None or row["drawn_s"] is None else round(row[k] - row["drawn_s"], 2)
        )
    return row


def _until(check, timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check():
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def walk(page, url: str, token: str, clone: Path) -> dict:
    release = clone / "notebooks" / "release-walk"
    path = clone / "notebooks" / "reload-walk.ipynb"
    filler = [("markdown", f"## Notes {i}\n\n" + "Some text to read. " * 60) for i in range(1)]
    write_notebook(
        path,
        [
            ("code", "%load_ext hvdnb\n%dist start -n 2"),
            *filler,
            ("code", HELD.format(release=str(release))),
        ],
    )
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.goto(f"{url}/lab/workspaces/walk-reload/tree/reload-walk.ipynb?reset&token={token}")
    page.wait_for_selector("text=/\\| Idle/", timeout=120_000)
    cells = page.locator(f"{PANEL} .jp-Cell")
    cells.first.click()
    page.keyboard.press("Shift+Enter")
    page.wait_for_function(SIDE, timeout=120_000)
    page.keyboard.press("Shift+Enter")  # the notes
    cells.nth(2).scroll_into_view_if_needed()
    cells.nth(2).click()
    page.keyboard.press("Shift+Enter")
    page.wait_for_selector(f"{PANEL} .hvdnb-liveline", timeout=90_000)
    _until(lambda: "] step 200" in cells.nth(2).inner_text(), 60)
    reloads = [_one_reload(page, n) for n in range(1, RELOADS + 1)]
    release.touch()
    cell = page.locator(f"{PANEL} .jp-Cell").nth(2)
    _until(lambda: len(re.findall(r"released at step", cell.inner_text())) >= 1, 120)
    time.sleep(3)  # the second rank's last line, and the server's save a second later
    on_page = printed_steps(cell.inner_text())
    saved = json.loads(path.read_text())["cells"][2]["outputs"]
    text = "".join(
        "".join(o["text"]) if "text" in o else "".join(o.get("data", {}).get("text/plain", ""))
        for o in saved
    )
    in_file = printed_steps(text)
    whole = all(v == list(range(0, v[-1] + 1, 200)) for v in on_page.values()) and sorted(
        on_page
    ) == [0, 1]
    page.screenshot(path=str(SHOTS / "reload-end.png"))
    lives = [r["live_after_drawn_s"] for r in reloads if r["live_after_drawn_s"] is not None]
    return {
        "reloads": reloads,
        "live_after_drawn_s_median": round(statistics.median(lives), 2) if lives else None,
        "page_has_every_line": whole,
        "file_matches_page": in_file == on_page,
        "lines_per_rank": {r: len(v) for r, v in on_page.items()},
        "ranks": 2,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rev", default="HEAD")
    args = ap.parse_args()
    row = walk_in_lab(walk, args.rev, OUT)
    fast = all(
        r["live_after_drawn_s"] is not None and r["live_after_drawn_s"] <= 2.0
        for r in row["reloads"]
    )
    ok = row["page_has_every_line"] and row["file_matches_page"] and fast
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
