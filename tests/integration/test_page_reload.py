"""A page that loads while a cell trains (a reload, a second tab), in the real kernel over
jupyter_client, at 1, 2 and 3 ranks.

A page that loads asks the kernel for its kernel info, then opens ipywidgets' control comm
(``jupyter.widget.control``) and sends ``request_states``: the state of every widget, from
which it draws the panel again. Those requests reach the kernel on its shell channel, where
a training cell holds the main thread; hvdnb answers them on its subshell
(``hvdnb.notebook.panel.kernel.serve_page_loads``). Each test holds the cell until it
releases it, so "while the cell runs" is a fact here, not a timing.

Also: with no page to report that the side area drew the panel, the ``%dist start`` cell's
stand-in says so and shows the panel itself (``hvdnb.notebook.panel.beacon``).
"""

from __future__ import annotations

import queue
import time

import pytest

from hvdnb.notebook.headless.runner import Kernel

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(400)]

#: a cell that trains (logs a step every 20 ms) until the test releases it
HELD = """%%distributed
import os, time, hvdnb
step = 0
while not os.path.exists({release!r}):
    hvdnb.log(step, 1.0 / (step + 1))
    if step == 5:
        open({started!r}, "a").close()
    step += 1
    time.sleep(0.02)
print("trained", step > 5)
"""


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}rank")
def kernel(request):
    n = request.param
    with Kernel({"HVDNB_PANEL": "side"}) as k:  # the default: beside the notebook
        extra = " --oversubscribe" if n > 2 else ""
        r = k.run(f"%dist start -n {n} --timeout 120{extra}", timeout=240)
        assert r.error is None, r
        k.start_run = r
        yield k


def test_with_no_page_to_draw_the_side_area_the_start_cell_shows_the_panel(kernel):
    """Nothing renders the side area here (no page), so nothing reports it: the stand-in
    holds the panel from its first message (a page with no side area shows it at once),
    with a line that waits for the page, then says this page has no side area. It never
    claims the panel is beside the notebook."""
    r = kernel.start_run
    opened = [c for c in r.comm_opens if "hvdnb-stub-box" in str(c)]
    assert len(opened) == 1, r.comm_opens
    children = opened[0]["data"]["state"]["children"]
    assert len(children) == 2, children  # its line, then the panel, at once
    first = [c for c in r.comm_opens if "hvdnb-stub-waiting" in str(c)]
    assert first, "the stand-in's first line is not the waiting one"
    assert "beside the notebook..." in str(first[0]) and "is open beside" not in str(first[0])
    assert not [c for c in r.comm_opens if "hvdnb-stub-shown" in str(c)]
    # the idle timer follows the (missing) report: read what it sent after the cell
    deadline = time.monotonic() + 60
    missing = None
    while time.monotonic() < deadline and not missing:
        try:
            msg = kernel.kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        text = str(msg["content"].get("data", {}))
        if "hvdnb-stub-missing" in text and "no side area" in text:
            missing = msg
        if "'children'" in text and opened[0]["comm_id"] == msg["content"].get("comm_id"):
            kids = msg["content"]["data"]["state"]["children"]
            assert len(kids) == 2, kids  # the panel stays in the cell
    assert missing is not None, "the stand-in never said the page has no side area"
    # read after the report (a cell's run drops the messages of others)
    box = kernel.run(
        "from hvdnb.notebook.panel.panel import get_panel\nprint(get_panel(False).box.model_id)"
    ).text.strip()
    assert children[1] == f"IPY_MODEL_{box}", (children, box)


def test_a_page_loaded_mid_cell_gets_the_kernel_info_and_every_widget_at_once(kernel, tmp_path):
    release, started = tmp_path / "release", tmp_path / "started"
    msg_id = kernel.kc.execute(HELD.format(release=str(release), started=str(started)))
    deadline = time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), "the cell did not start training"
    page = kernel.page()  # a reloaded page: a second connection to the same kernel
    try:
        info = page.kernel_info(reply=True, timeout=60)  # on main: after the cell
        assert info["content"]["status"] == "ok"
        assert not release.exists()
        states = Kernel.widget_states(page, timeout=60)
        assert states is not None, "no update_states for the page's request"
        # answered while the cell still trains: it is held until the test releases it
        assert not release.exists()
        assert kernel.kc.is_alive()
        classes = [s["state"].get("_dom_classes") for s in states.values()]
        assert ["hvdnb-panel"] in classes, classes  # the panel, to draw again
        views = [s["state"].get("value", "") for s in states.values()]
        assert any("hvdnb-header" in str(v) for v in views), "no panel view among the states"
    finally:
        release.touch()
        page.stop_channels()
    while True:  # the held cell ends normally, after the page's requests
        msg = kernel.kc.get_iopub_msg(timeout=120)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "error":
            pytest.fail(f"{msg['content']['ename']}: {msg['content']['evalue']}")
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
