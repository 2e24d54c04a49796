"""A rank's death, walked as a person meets it: ``make lab`` on a fresh clone, a notebook in
JupyterLab (headless Chromium) that starts an elastic cluster of 3 ranks and trains below
the fold, and one rank killed from a terminal (``kill -9 PID``) while it trains; then
``ranks=3`` typed in the panel's set box brings a third rank back into the running loop.

Screenshots (``test-artifacts/walk/elastic-*.png``): the page while the cell trains after
the kill, after the scale was asked for, the training cell's end (its last line names the dead rank and the new size), the
panel beside the notebook (its loss chart marks the step). It prints what the page shows
and writes ``bench/results/walk_elastic.json``; exits 1 when the line is not on the page or
the cell shows an error. Usage: ``python bench/walk_elastic.py [--rev REV]``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from walkkit import walk_in_lab

from tests.browser._lab import write_notebook

SHOTS = ROOT / "test-artifacts" / "walk"
OUT = ROOT / "bench" / "results" / "walk_elastic.json"
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"
LINE = "rank 1 of generation 0 died; training goes on with 2 ranks"
SCALED = "the cluster now has 3 ranks (generation 2)"

TRAIN = """%%distributed
import time, torch, hvdnb, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.02)
state = hvdnb.State(model=model, optimizer=opt, step=0)

@hvdnb.elastic.run
def train(state):
    ddp = DDP(model)  # holds the group: made again in each generation
    while state.step < 600:
        x = torch.randn(16, 8)
        loss = (ddp(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        state.step += 1
        hvdnb.log(state.step, loss=loss.item())
        if state.step % 20 == 0:
            state.commit()
        time.sleep(0.03)

train(state)
print("finished: size", dist.get_world_size(), "step", state.step)
"""


def _engine_pid(slot: int) -> int | None:
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if "kernels_ext.engine" in cmd and p.environ().get("HVDNB_SLOT") == str(slot):
                return p.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def _panel_step(page) -> int:
    """The step the panel's header shows (0 before it shows one)."""
    head = page.locator(".hvdnb-header")
    m = re.search(r"step (\d+)", head.first.inner_text()) if head.count() else None
    return int(m.group(1)) if m else 0


def _wait_for_step(page, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _panel_step(page) < step and time.monotonic() < deadline:
        time.sleep(0.5)


def walk(page, url: str, token: str, clone: Path) -> dict:
    cells = [("markdown", f"## Notes {i}\n\n" + "Some text to read. " * 40) for i in range(4)]
    cells[1:1] = [("code", "%load_ext hvdnb\n%dist start -n 3 --min-np 1 --oversubscribe")]
    cells.append(("code", TRAIN))
    write_notebook(clone / "notebooks" / "elastic-walk.ipynb", cells)
    page.goto(f"{url}/lab/workspaces/walk-elastic/tree/elastic-walk.ipynb?reset&token={token}")
    page.wait_for_selector("text=/\\| Idle/", timeout=120_000)
    page.locator(f"{PANEL} .jp-Cell").first.click()
    page.locator(".lm-MenuBar-itemLabel:text-is('Run')").click()
    page.locator(".lm-Menu-itemLabel:text-is('Run All Cells')").click()
    # the training cell has started when the ranks' pids exist and the panel shows a loss
    deadline = time.monotonic() + 180
    pid = None
    while time.monotonic() < deadline and pid is None:
        pid = _engine_pid(1)
        time.sleep(0.5)
    assert pid is not None, "no engine of rank 1 appeared"
    page.wait_for_function(
        f"() => [...document.querySelectorAll('{PANEL} .jp-InputPrompt')]"
        ".some(p => p.textContent.includes('*'))",
        timeout=60_000,
    )
    _wait_for_step(page, 60)  # training for a while: the panel has a loss line
    subprocess.run(["kill", "-9", str(pid)], check=True)  # as from a terminal
    t_kill = time.monotonic()
    time.sleep(4)
    SHOTS.mkdir(parents=True, exist_ok=True)
    shots = [str(SHOTS / "elastic-after-kill.png")]
    page.screenshot(path=shots[-1])
    # back to 3 ranks while the loop trains: the panel's set box, as a person types it
    _wait_for_step(page, _panel_step(page) + 40)  # the survivors train on at 2 first
    box = page.get_by_placeholder("e.g. lr=0.05, warmup_steps=50")
    box.fill("ranks=3")
    box.press("Enter")
    t_ask = time.monotonic()
    time.sleep(3)
    shots.append(str(SHOTS / "elastic-after-scale.png"))
    page.screenshot(path=shots[-1])
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        busy = page.evaluate(
            f"() => [...document.querySelectorAll('{PANEL} .jp-InputPrompt')]"
            ".filter(p => p.textContent.includes('*')).length"
        )
        if busy == 0:  # the cell's prompt has its number: it ended (the status bar's
            break  # "| Idle" follows the focused tab, here the panel's box: not a sign)
        time.sleep(1)
    cell = page.locator(f"{PANEL} .jp-Cell").last
    cell.locator(".jp-OutputArea").last.scroll_into_view_if_needed()
    shots.append(str(SHOTS / "elastic-cell-end.png"))
    page.screenshot(path=shots[-1])
    text = cell.inner_text()
    errors = page.locator(f"{PANEL} .jp-OutputArea-output[data-mime-type*='error']").count()
    return {
        "line_on_page": LINE in text,
        "finished_line": "finished: size 3 step 600" in text,
        "scaled_line": SCALED in text,
        "seconds_after_scale": round(time.monotonic() - t_ask, 1),
        "error_outputs": errors,
        "seconds_after_kill": round(time.monotonic() - t_kill, 1),
        "cell_tail": text[-600:],
        "screenshots": shots,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rev", default="HEAD")
    args = ap.parse_args()
    row = walk_in_lab(walk, args.rev, OUT)
    ok = row["line_on_page"] and row["scaled_line"] and row["finished_line"]
    sys.exit(0 if ok and not row["error_outputs"] else 1)


if __name__ == "__main__":
    main()
