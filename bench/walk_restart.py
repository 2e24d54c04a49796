"""A warm ``%dist restart``, walked as a person meets it: ``make lab`` on a fresh clone, a
notebook in JupyterLab (headless Chromium) that starts 2 ranks, trains a little below the
fold, shows ``%dist status`` (the standby listed under the ranks) and restarts.

Screenshots (``test-artifacts/walk/restart-*.png``): the status table with the standby, and
the restart's line with the cell after it. It prints what the page shows and writes
``bench/results/walk_restart.json``; exits 1 when the restart was not warm, the status does
not list the standby, or a cell shows an error. Usage:
``python bench/walk_restart.py [--rev REV]``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from walkkit import walk_in_lab

from tests.browser._lab import write_notebook

SHOTS = ROOT / "test-artifacts" / "walk"
OUT = ROOT / "bench" / "results" / "walk_restart.json"
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"

TRAIN = """%%distributed
import torch, hvdnb
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.02)
for step in range(200):
    x = torch.randn(16, 8)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    hvdnb.log(step, loss=loss.item())
print("trained", step)
"""
# a person reads the output for a few seconds; the standby fills meanwhile
WAIT = """import time, hvdnb
t = time.monotonic()
while hvdnb.current().standby.ready() < 2 and time.monotonic() - t < 120:
    time.sleep(0.2)
"""
AFTER = """%%distributed
import os, torch.distributed as dist
print("world", dist.get_world_size(), os.environ["HVDNB_STARTED"])
"""


def _text(page, i: int) -> str:
    return str(page.locator(f"{PANEL} .jp-Cell").nth(i).inner_text())


def walk(page, url: str, token: str, clone: Path) -> dict:
    filler = [("markdown", f"## Notes {i}\n\n" + "Some text to read. " * 40) for i in range(3)]
    cells = [
        ("code", "%load_ext hvdnb\n%dist start -n 2"),
        *filler,
        ("code", TRAIN),
        ("code", WAIT),
        ("code", "%dist status"),
        ("code", "%dist restart"),
        ("code", AFTER),
    ]
    write_notebook(clone / "notebooks" / "restart-walk.ipynb", cells)
    page.goto(f"{url}/lab/workspaces/walk-restart/tree/restart-walk.ipynb?reset&token={token}")
    page.wait_for_selector("text=/\\| Idle/", timeout=120_000)
    page.locator(f"{PANEL} .jp-Cell").first.click()
    page.locator(".lm-MenuBar-itemLabel:text-is('Run')").click()
    page.locator(".lm-Menu-itemLabel:text-is('Run All Cells')").click()
    deadline = time.monotonic() + 400
    n = len(cells)
    while time.monotonic() < deadline:
        if "world 2" in _text(page, n - 1):
            break
        time.sleep(1)
    SHOTS.mkdir(parents=True, exist_ok=True)
    shots = []
    for i, name in ((n - 3, "restart-status.png"), (n - 1, "restart-after.png")):
        page.locator(f"{PANEL} .jp-Cell").nth(i).scroll_into_view_if_needed()
        shots.append(str(SHOTS / name))
        page.screenshot(path=shots[-1])
    status, restart, after = _text(page, n - 3), _text(page, n - 2), _text(page, n - 1)
    said = re.search(r"ready in ([0-9.]+) s", restart)
    errors = page.locator(f"{PANEL} .jp-OutputArea-output[data-mime-type*='error']").count()
    return {
        "status_lists_standby": status.count("\nstandby ") == 2 and "2 of 2 ready" in status,
        "restart_line": restart.strip().splitlines()[-1] if restart.strip() else "",
        "restart_said_s": float(said.group(1)) if said else None,
        "warm": "warm (every rank from the standby)" in restart,
        "after": after.strip().splitlines()[-2:],
        "error_outputs": errors,
        "screenshots": shots,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rev", default="HEAD")
    args = ap.parse_args()
    row = walk_in_lab(walk, args.rev, OUT)
    ok = row["warm"] and row["status_lists_standby"] and not row["error_outputs"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
