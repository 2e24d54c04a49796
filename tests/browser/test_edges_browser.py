"""Where users stand, walked in a real JupyterLab (headless Chromium): one rank, the default
on a one-GPU node, then ``%dist restart -n 2`` with options.

The notebook starts 1 rank, trains below the fold (the live line under the cell and the
panel's header name 1 rank and its step), restarts with ``-n 2``: the panel now belongs to
the new cluster (2 ranks, no steps yet) and the runs chart keeps the 1-rank run, marked as
an earlier cluster's; a training cell on the new ranks then counts its own steps. Last, the
panel's pin control lists the run store and pins the 1-rank run to the runs chart.
Screenshots go to ``test-artifacts/edges-*.png``.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.browser._lab import ARTIFACTS, lab_page, write_notebook

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

TRAIN = """%%distributed
import torch, hvdnb
import hvdnb.torch as hvd
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters())
for step in range(STEPS):
    x = torch.randn(16, 32)
    loss = torch.nn.functional.cross_entropy(model(x), x[:, :4].argmax(1))
    opt.zero_grad(); loss.backward(); opt.step()
    hvdnb.log(step, loss)
print(f"rank {hvd.rank()} of {hvd.size()}: {STEPS} steps")
"""


@pytest.fixture(scope="module")
def edges(lab_server):
    filler = "\n\n".join(
        f"Paragraph {i}: the lesson's text between the start and the training cell."
        for i in range(14)
    )
    write_notebook(
        lab_server["work"] / "edges.ipynb",
        [
            ("code", "%load_ext hvdnb\n%dist start -n 1"),
            ("markdown", filler),
            ("code", TRAIN.replace("STEPS", "1500")),
            ("code", "%dist restart -n 2"),
            ("code", TRAIN.replace("STEPS", "700")),
        ],
    )
    return lab_server


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"edges-{name}.png"))


def _header(page) -> str:
    """The panel's first line (``hvdnb N ranks · backend · device · step ...``)."""
    text = page.locator(".hvdnb-panel .hvdnb-view").first.inner_text()
    return text.strip().splitlines()[0] if text.strip() else ""


def _run(page, index: int, timeout_ms: int = 120_000) -> str:
    """Run cell ``index`` (scrolled into view) and wait until it is done; its output text."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    cell.scroll_into_view_if_needed()
    cell.click()
    page.keyboard.press("Shift+Enter")
    prompt = cell.locator(".jp-InputPrompt")
    deadline = time.monotonic() + timeout_ms / 1000
    while time.monotonic() < deadline:
        text = prompt.inner_text() or ""
        if re.search(r"\[\d+\]", text):
            return cell.locator(".jp-OutputArea").inner_text()
        time.sleep(0.2)
    raise AssertionError(f"cell {index} did not finish in {timeout_ms / 1000:.0f} s")


def _wait_text(locator, pattern: str, timeout: float = 30) -> str:
    """Wait until ``locator``'s text matches ``pattern``; the text (or an error with it)."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = locator.inner_text()
        if re.search(pattern, text):
            return text
        time.sleep(0.3)
    raise AssertionError(f"never matched {pattern!r}: {text!r}")


def _pin_the_one_rank_run(page) -> None:
    """The panel's pin control, as a person uses it: "list runs" fills the list from the
    run store (newest first), the 1-rank run (the older) is selected and pinned; the
    status says so and the runs chart's legend names it with its date."""
    panel = page.locator(".hvdnb-panel").first
    status = panel.locator(".hvdnb-pins-status").first
    panel.locator("button.hvdnb-pins-list").click()
    _wait_text(status, r"\d+ runs? in the run store")
    options = panel.locator(".hvdnb-pins-runs select option")
    assert options.count() >= 2, options.all_inner_texts()
    older = options.nth(1).inner_text().strip()  # newest first: the 2-rank run, then ours
    rid = older.split()[0]
    panel.locator(".hvdnb-pins-runs select").select_option(label=older)
    panel.locator("button.hvdnb-pins-pin").click()
    assert rid in _wait_text(status, r"pinned to the runs chart"), rid
    _wait_text(panel.locator(".hvdnb-view").first, re.escape(rid))


def _wait_header(page, pattern: str, timeout: float = 60) -> str:
    """Wait until the panel's header matches ``pattern``; the header (or an error with it)."""
    deadline = time.monotonic() + timeout
    head = ""
    while time.monotonic() < deadline:
        head = _header(page)
        if re.search(pattern, head):
            return head
        time.sleep(0.3)
    raise AssertionError(f"panel header never matched {pattern!r}: {head!r}")


def test_one_rank_then_restart_with_options(edges):
    with lab_page(edges, "edges.ipynb", last=lambda pg: _shot(pg, "last")) as page:
        out = _run(page, 0)
        assert "hvdnb: 1 rank ready" in out, out
        page.wait_for_selector(".hvdnb-panel .hvdnb-view", timeout=60_000)
        assert _header(page).startswith("hvdnb 1 rank"), _header(page)
        _shot(page, "1-one-rank-started")
        out = _run(page, 2)  # the training cell, below the fold
        assert "[0] rank 0 of 1: 1500 steps" in out, out
        _wait_header(page, r"step 1,?500(?!\d)")
        head = _header(page)
        assert head.startswith("hvdnb 1 rank") and re.search(r"step 1,?500(?!\d)", head), head
        live = page.locator(".jp-Notebook .jp-Cell").nth(2).locator(".hvdnb-liveline")
        assert "loss r0" in live.first.inner_text()
        _shot(page, "2-one-rank-trained")
        out = _run(page, 3)  # %dist restart -n 2: the option is honoured
        assert re.search(r"hvdnb: 2 fresh ranks ready in [\d.]+ s", out), out
        assert "was 1 rank" in out, out
        _wait_header(page, r"hvdnb 2 ranks")
        head = _header(page)
        assert "no steps yet" in head and not re.search(r"step \d", head), head
        view = page.locator(".hvdnb-panel .hvdnb-view").first.inner_text()
        assert "earlier cluster: 1 rank" in view, view
        _shot(page, "3-restarted-two-ranks")
        out = _run(page, 4)
        assert "[0] rank 0 of 2: 700 steps" in out and "[1] rank 1 of 2: 700 steps" in out, out
        _wait_header(page, r"step 700(?!\d)")
        head = _header(page)
        assert head.startswith("hvdnb 2 ranks") and re.search(r"step 700(?!\d)", head), head
        _shot(page, "4-two-ranks-trained")
        _pin_the_one_rank_run(page)
        _shot(page, "5-pinned-from-the-run-store")
