"""JupyterLab's visual debugger on the ranks, in a real JupyterLab 4 driven by headless
Chromium (Debian's, via Playwright), as a person uses it.

The notebook: text tall enough to push the training cell below the fold, ``%dist start -n
2``, a ``%%distributed`` training loop, and a next cell. The test starts 2 ranks, turns the
debugger on with the notebook toolbar's bug button (the debugger's sidebar opens; its tab
on the right is clicked if it does not), scrolls to the training cell and clicks the gutter
of the loop's ``x = ...`` line (the breakpoint's red dot shows on that line, and the
Breakpoints panel lists it), and runs the cell:

- the Callstack lists ``rank 0 · <module>`` and ``rank 1 · <module>``, both at that line;
- Variables (its tree view) shows the followed rank's ``rank``, ``step`` and ``t`` (the
  tree shows an object's type: ``Tensor``); the debug console (the Callstack's Evaluate
  button) answers ``t`` with ``Tensor(3, 4) float32 cpu``, not the tensor's whole repr;
- clicking the other rank's frame shows that rank's Variables;
- the Callstack's Continue lets that rank go on (it waits in all_reduce) and the page
  follows the other one, still stopped; Continue again and both stop at the next step;
- there, rank 1's frame is picked and the console evaluates on it; Continue then lets
  rank 1 go on (JupyterLab asks for the Callstack again after an evaluate: the pick
  survives it, because a stopped rank's frames keep their ids);
- the Callstack's Terminate releases every rank (the Callstack empties; JupyterLab restarts
  its debugger with the breakpoints kept, so a rank may stop again at a later step); the
  bug button turns the debugger off: the cell ends with each rank's ``done`` line (``x`` is
  1 + 2 summed over the ranks), and the next ``%%distributed`` cell runs.

Measured, never asserted: the time from a rank reaching the line (the line above it writes
``time.time()`` into a file per rank and step) to the page's Callstack listing that rank's
frame (``Date.now()`` in the page, polled every 10 ms), at the first two stops. Printed
(``-s``) and written to ``test-artifacts/debugger-latency.json``.

What the page and the kernel said to each other about the debugger (``debug_request``,
``debug_reply``, ``debug_event`` on the page's kernel websocket, read as the page received
them: the test never talks to the kernel itself) is written to
``test-artifacts/debugger-traffic.json``, passed or failed; the page's own log of the
Callstack's frames and of its "Paused in Debugger" bar, by time, to
``test-artifacts/debugger-page-log.json``. Screenshots: ``test-artifacts/debugger-*.png``.
"""

from __future__ import annotations

import json
import re
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from tests.browser._lab import ARTIFACTS, lab_page, write_notebook

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.mpi, pytest.mark.timeout(400)]

FILLER = "\n\n".join(
    f"Paragraph {i}: what a lesson says between the start and the training cell, enough "
    "to push that cell below the fold."
    for i in range(14)
)

START = "%dist start -n 2"

#: the training cell; ``{reach}``: the folder the line above the breakpoint writes into
TRAIN = """%%distributed
import os, time, torch, torch.distributed as dist
rank = int(os.environ['RANK'])
t = torch.ones(3, 4) * rank
for step in range(3):
    open(f'{reach}/reach{{rank}}-{{step}}', 'w').write(repr(time.time()))
    x = torch.ones(1) * (rank + 1)
    dist.all_reduce(x)
print('done', rank, float(x))
"""
#: the breakpoint's line, as the page numbers the cell (line 1 is ``%%distributed``)
LINE = 7

NEXT = "%%distributed\nprint('next', rank)"

FRAMES = ".jp-DebuggerCallstack .jp-DebuggerCallstackFrame"
BOTH = ["rank 0 · <module>", "rank 1 · <module>"]

#: what the page's Callstack lists now: each frame's name, location, and whether selected
FRAMES_JS = """() => [...document.querySelectorAll(
    '.jp-DebuggerCallstack .jp-DebuggerCallstackFrame')].map(f => [
        (f.querySelector('.jp-DebuggerCallstackFrame-name') || f).textContent.trim(),
        (f.querySelector('.jp-DebuggerCallstackFrame-location') || {textContent: ''})
            .textContent.trim(),
        f.classList.contains('selected')])"""

#: records, every 10 ms, when the Callstack's list of frame names changes, and when the
#: notebook's "Paused in Debugger" bar comes and goes
WATCH_JS = """() => {
    window.__hvdnbCallstack = [];
    window.__hvdnbPaused = [];
    let last = null, lastPaused = null;
    setInterval(() => {
        const names = [...document.querySelectorAll(
            '.jp-DebuggerCallstack .jp-DebuggerCallstackFrame-name')]
            .map(e => e.textContent.trim()).join('|');
        if (names !== last) {
            last = names;
            window.__hvdnbCallstack.push([Date.now(), names]);
        }
        const paused = document.querySelector('.jp-DebuggerPausedOverlay') !== null;
        if (paused !== lastPaused) {
            lastPaused = paused;
            window.__hvdnbPaused.push([Date.now(), paused]);
        }
    }, 10);
}"""


@pytest.fixture(scope="module")
def lab(lab_server):
    return lab_server


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"debugger-{name}.png"))


def _parse_frame(raw: bytes) -> tuple[str, str, dict[str, Any]] | None:
    """A kernel websocket frame in JupyterLab's binary protocol (v1.kernel.websocket.
    jupyter.org: a count of offsets, the offsets, then channel, header, parent header,
    metadata, content, buffers): (channel, msg_type, content), or None if it is not one."""
    try:
        n = struct.unpack_from("<Q", raw, 0)[0]
        offs = [struct.unpack_from("<Q", raw, 8 * (i + 1))[0] for i in range(n)]
        parts = [raw[offs[i] : offs[i + 1]] for i in range(n - 1)] + [raw[offs[-1] :]]
        header = json.loads(parts[1])
        return parts[0].decode(), str(header.get("msg_type")), json.loads(parts[4])
    except Exception:
        return None


def _record_debug_traffic(page, traffic: list[dict[str, Any]]) -> None:
    """Keep each debug_request/_reply/_event the page sends or receives (its kernel
    websocket, in the binary protocol or the JSON one)."""

    def on_socket(ws) -> None:
        def keep(direction: str):
            def on_frame(payload) -> None:
                raw = payload if isinstance(payload, bytes) else payload.encode()
                if b"debug_" not in raw:
                    return
                got = _parse_frame(raw)
                if got is None:
                    try:
                        msg = json.loads(raw)
                        got = (msg.get("channel"), msg["header"]["msg_type"], msg["content"])
                    except Exception:
                        return
                _channel, kind, content = got
                if kind.startswith("debug_"):
                    traffic.append(
                        {"t": time.time(), "dir": direction, "type": kind, "content": content}
                    )

            return on_frame

        ws.on("framesent", keep("sent"))
        ws.on("framereceived", keep("received"))

    page.on("websocket", on_socket)


def _frames(page) -> list[tuple[str, str, bool]]:
    return [tuple(f) for f in page.evaluate(FRAMES_JS)]


def _wait_frames(page, names: list[str], what: str, timeout: float = 90) -> list[Any]:
    """The Callstack's frames once it lists exactly ``names`` (in any order)."""
    js = (
        "(want) => { const got = [...document.querySelectorAll("
        "'.jp-DebuggerCallstack .jp-DebuggerCallstackFrame-name')]"
        ".map(e => e.textContent.trim()).sort();"
        " return JSON.stringify(got) === JSON.stringify(want); }"
    )
    try:
        page.wait_for_function(js, arg=sorted(names), timeout=timeout * 1000, polling=50)
    except Exception as exc:
        raise AssertionError(f"{what}: the Callstack lists {_frames(page)}") from exc
    return _frames(page)


def _wait_one_frame(page, what: str, timeout: float = 60) -> str:
    """The name of the one frame the Callstack lists, once it lists one."""
    js = (
        "() => document.querySelectorAll("
        "'.jp-DebuggerCallstack .jp-DebuggerCallstackFrame').length === 1"
    )
    try:
        page.wait_for_function(js, timeout=timeout * 1000, polling=50)
    except Exception as exc:
        raise AssertionError(f"{what}: the Callstack lists {_frames(page)}") from exc
    return str(_frames(page)[0][0])


def _variables(page) -> dict[str, str]:
    """The Variables panel's top-level names and what its tree view shows for each."""
    return dict(
        page.evaluate(
            """() => [...document.querySelectorAll(
                    '.jp-DebuggerVariables-body jp-tree-view > jp-tree-item')]
                .map(item => [
                    (item.querySelector(':scope > .jp-DebuggerVariables-name')
                        || {textContent: ''}).textContent.trim(),
                    (item.querySelector(':scope > .jp-DebuggerVariables-detail')
                        || {textContent: ''}).textContent.trim()])
                .filter(([n]) => n)"""
        )
    )


def _wait_variables(page, want: dict[str, str], what: str, timeout: float = 60) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    got: dict[str, str] = {}
    while time.monotonic() < deadline:
        got = _variables(page)
        if all(got.get(k) == v for k, v in want.items()):
            return got
        page.wait_for_timeout(100)
    raise AssertionError(f"{what}: Variables shows {got}")


def _wait_text(cell, patterns: list[str], timeout: float) -> str:
    """The cell's text once each of ``patterns`` is in it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = cell.inner_text()
        if all(re.search(p, text) for p in patterns):
            return text
        if not text.strip():  # a cell off-screen may read as empty: bring it in
            cell.scroll_into_view_if_needed()
        time.sleep(0.3)
    raise AssertionError(f"{patterns!r} not all in the cell: {cell.inner_text()[-800:]}")


def _run_cell(page, cell) -> None:
    cell.scroll_into_view_if_needed()
    cell.locator(".jp-InputArea-prompt").click()  # selects the cell, in command mode
    page.keyboard.press("Shift+Enter")


def _wait_done(cell, timeout: float) -> None:
    """The cell's prompt shows its execution count (``[N]:``, not ``[*]:``)."""
    prompt = cell.locator(".jp-InputArea-prompt")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.fullmatch(r"\[\d+\]:", prompt.inner_text().strip()):
            return
        time.sleep(0.3)
    raise AssertionError(f"the cell did not end: {cell.inner_text()[-800:]}")


def _click(page, command: str) -> None:
    """A Callstack toolbar button (debugger:continue, debugger:terminate, ...) once it is
    enabled."""
    button = page.locator(
        f".jp-DebuggerCallstack-header jp-button[data-command='debugger:{command}'], "
        f"jp-toolbar jp-button[data-command='debugger:{command}']"
    ).first
    page.wait_for_function(
        "(b) => b.getAttribute('aria-disabled') !== 'true'",
        arg=button.element_handle(),
        timeout=30_000,
    )
    button.click()


def _toggle_debugger(page, on: bool) -> None:
    """Click the notebook toolbar's bug button (in the toolbar's "more" popup when the
    toolbar is too narrow to show it), once enabled; it then shows pressed, or not."""
    shown = page.locator(".jp-NotebookPanel-toolbar jp-button.jp-DebuggerBugButton")
    opener = page.locator(".jp-NotebookPanel-toolbar .jp-Toolbar-responsive-opener").first
    folded = not shown.first.is_visible()
    if folded:
        opener.click()
    bug = page.locator("jp-button.jp-DebuggerBugButton >> visible=true").first
    bug.wait_for(timeout=30_000)
    page.wait_for_function(
        "(b) => b.getAttribute('aria-disabled') === 'false'",
        arg=bug.element_handle(),
        timeout=60_000,
    )
    bug.click()
    pressed = "true" if on else "false"
    page.wait_for_function(
        "(p) => [...document.querySelectorAll('jp-button.jp-DebuggerBugButton')]"
        ".some(b => b.getAttribute('aria-pressed') === p)",
        arg=pressed,
        timeout=60_000,
    )
    if folded and page.locator(".jp-Toolbar-responsive-popup").first.is_visible():
        opener.click()  # the popup closed again


def _pick(page, rank: int, step: int) -> None:
    """Click rank ``rank``'s frame in the Callstack: Variables then shows that rank's."""
    page.locator(FRAMES, has_text=f"rank {rank} · <module>").click()
    _wait_variables(page, {"rank": str(rank), "step": str(step)}, f"rank {rank}'s frame clicked")


def _replies(traffic: list[dict[str, Any]], command: str) -> list[dict[str, Any]]:
    return [
        m
        for m in traffic
        if m["dir"] == "received"
        and m["type"] == "debug_reply"
        and m["content"].get("command") == command
    ]


def _evaluate(page, console, traffic: list[dict[str, Any]], expr: str) -> str:
    """Type ``expr`` in the debug console's prompt and run it (Shift+Enter): what it shows,
    once the page has also redrawn the Callstack it asks for again after an evaluate."""
    outputs = console.locator(".jp-CodeConsole-content .jp-OutputArea-output")
    before, traces = outputs.count(), len(_replies(traffic, "stackTrace"))
    # typed into the prompt's editor itself: a keystroke that reached the notebook instead
    # (JupyterLab activates the notebook to show a picked frame's line) would edit or run
    # its cells
    prompt = console.locator(".jp-CodeConsole-promptCell .cm-content").first
    prompt.fill(expr)
    assert prompt.inner_text().strip() == expr, prompt.inner_text()
    prompt.press("Shift+Enter")
    deadline = time.monotonic() + 30
    while outputs.count() <= before or len(_replies(traffic, "stackTrace")) <= traces:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{expr!r} in the debug console: {console.inner_text()[-500:]}, "
                f"stackTrace replies {len(_replies(traffic, 'stackTrace'))} (were {traces})"
            )
        page.wait_for_timeout(100)
    page.locator(FRAMES).first.wait_for(timeout=30_000)  # the Callstack, drawn again
    return str(outputs.nth(before).inner_text().strip())


def _latencies(page, reach: Path, stops: int) -> list[dict[str, Any]]:
    """For each rank and each of the first ``stops`` steps: seconds from the rank's reaching
    the line to the page's Callstack first listing its frame after that."""
    log = page.evaluate("() => window.__hvdnbCallstack || []")
    out = []
    for step in range(stops):
        for rank in range(2):
            f = reach / f"reach{rank}-{step}"
            if not f.exists():
                continue
            at = float(f.read_text()) * 1000
            shown = next((t for t, names in log if t >= at and f"rank {rank} · " in names), None)
            out.append(
                {
                    "rank": rank,
                    "step": step,
                    "reached_ms": at,
                    "shown_ms": shown,
                    "latency_s": None if shown is None else round((shown - at) / 1000, 3),
                }
            )
    return out


def test_a_breakpoint_stops_both_ranks_in_the_page_and_each_rank_is_picked_by_its_frame(
    lab, tmp_path
):
    reach = tmp_path / "reach"
    reach.mkdir()
    write_notebook(
        lab["work"] / "debugger.ipynb",
        [
            ("markdown", FILLER),
            ("code", START),
            ("code", TRAIN.format(reach=str(reach))),
            ("code", NEXT),
        ],
    )
    traffic: list[dict[str, Any]] = []
    latency: list[dict[str, Any]] = []
    with lab_page(lab, "debugger.ipynb", last=lambda pg: _shot(pg, "last")) as page:
        try:
            lost_pick = _walk(page, traffic, reach, latency)
        finally:
            ARTIFACTS.mkdir(exist_ok=True)
            (ARTIFACTS / "debugger-traffic.json").write_text(json.dumps(traffic, indent=1))
            (ARTIFACTS / "debugger-latency.json").write_text(json.dumps(latency, indent=1))
            try:  # the page's own log: the Callstack's frames and the "Paused" bar, by time
                log = page.evaluate(
                    "() => ({callstack: window.__hvdnbCallstack || [],"
                    " paused: window.__hvdnbPaused || []})"
                )
            except Exception as exc:
                log = {"error": str(exc)}
            (ARTIFACTS / "debugger-page-log.json").write_text(json.dumps(log, indent=1))
    print("\n    a rank reached the breakpoint's line -> the page's Callstack listed it:")
    for row in latency:
        print(f"      step {row['step']} rank {row['rank']}: {row['latency_s']} s")
    assert lost_pick is None, lost_pick


def _walk(
    page, traffic: list[dict[str, Any]], reach: Path, latency: list[dict[str, Any]]
) -> str | None:
    """The walk; what went wrong with the pick after a console evaluate (None: nothing)."""
    # the kernel's websocket opens with the page: reload it to see its frames from the start
    _record_debug_traffic(page, traffic)
    page.reload()
    page.wait_for_selector("text=/\\| Idle/", timeout=90_000)
    cells = page.locator(".jp-Notebook .jp-Cell")
    start, train, nxt = cells.nth(1), cells.nth(2), cells.nth(3)

    # 1. two ranks
    _run_cell(page, start)
    _wait_done(start, 180)
    # the panel leaves the cell while it is redrawn: its text is read until it settles
    # (CI read '' once, between two renders)
    _wait_text(start, ["2 ranks ready"], 30)

    # 2. the debugger on: the notebook toolbar's bug button; its sidebar opens
    _toggle_debugger(page, on=True)
    callstack = page.locator(".jp-DebuggerCallstack")
    try:  # JupyterLab opens the sidebar a moment after the button shows pressed
        callstack.wait_for(state="visible", timeout=10_000)
    except Exception:  # not this time: its tab on the right, as a person would
        page.locator(".jp-SideBar.jp-mod-right li[data-id='jp-debugger-sidebar']").click()
        callstack.wait_for(state="visible", timeout=30_000)
    # Kernel Sources (the notebook's modules) folded away, so Variables has the room
    sources = page.locator("h3.jp-AccordionPanel-title[aria-label='Kernel Sources Section']")
    if sources.count() and sources.first.get_attribute("aria-expanded") == "true":
        sources.first.locator(".lm-AccordionPanel-titleLabel").click()  # not its filter box
    _shot(page, "on")

    # 3. a breakpoint: a click in the training cell's gutter, level with line LINE
    train.scroll_into_view_if_needed()
    line = train.locator(".cm-content .cm-line").nth(LINE - 1)
    assert line.inner_text().strip().startswith("x = torch.ones(1)"), line.inner_text()
    gutter = train.locator(".cm-breakpoint-gutter").first
    gbox, lbox = gutter.bounding_box(), line.bounding_box()
    page.mouse.click(gbox["x"] + gbox["width"] / 2, lbox["y"] + lbox["height"] / 2)
    # the red dot, on that line (the gutter's hidden spacer holds one too)
    marker = train.locator(
        ".cm-breakpoint-gutter .cm-gutterElement .cm-breakpoint-icon >> visible=true"
    )
    marker.first.wait_for(state="visible", timeout=15_000)
    assert marker.count() == 1, marker.count()
    mbox = marker.first.bounding_box()
    assert (
        abs((mbox["y"] + mbox["height"] / 2) - (lbox["y"] + lbox["height"] / 2)) < lbox["height"]
    ), (mbox, lbox)
    page.locator(".jp-DebuggerBreakpoints-body").get_by_text(str(LINE)).first.wait_for(
        timeout=15_000
    )
    _shot(page, "breakpoint")

    # 4. run it: both ranks stop at the line
    page.evaluate(WATCH_JS)
    _run_cell(page, train)
    frames = _wait_frames(page, BOTH, "both ranks stopped", timeout=120)
    assert all(loc.endswith(f":{LINE}") for _, loc, _ in frames), frames

    # 5. Variables: the followed rank's (listed first; its tree view shows an object's
    # type); the other rank's once its frame is clicked
    followed = int(frames[0][0].split()[1])
    other = 1 - followed
    values = _wait_variables(page, {"rank": str(followed), "step": "0"}, f"rank {followed}")
    assert values.get("t") == "Tensor", values
    _shot(page, "stopped")
    page.locator(".jp-DebuggerVariables-toolbar .jp-TableView-Button").first.click()
    page.locator(".jp-DebuggerVariables-grid").first.wait_for(state="visible", timeout=15_000)
    page.wait_for_timeout(500)  # the table is drawn on a canvas: nothing in the DOM says when
    _shot(page, "variables-table")
    page.locator(".jp-DebuggerVariables-toolbar .jp-TreeView-Button").first.click()
    _pick(page, other, 0)
    _shot(page, "picked")

    # 6. Continue: the picked rank goes on (it waits in all_reduce); the page follows the
    # other, still stopped; Continue again: both meet in all_reduce and stop at step 1
    _click(page, "continue")
    _wait_frames(page, [f"rank {followed} · <module>"], f"rank {other} continued")
    _wait_variables(page, {"rank": str(followed), "step": "0"}, f"the page follows rank {followed}")
    _shot(page, "continued")
    _click(page, "continue")
    frames = _wait_frames(page, BOTH, "both ranks stopped at the next step", timeout=120)
    _wait_variables(page, {"step": "1"}, "step 1")
    _shot(page, "stopped-again")
    latency.extend(_latencies(page, reach, 2))

    # the debug console (the Callstack's Evaluate button), on the picked rank: a tensor
    # shows its shape, dtype and device, not its whole repr. JupyterLab asks for the
    # Callstack again after an evaluate (and for the stopped threads, rank 0's listed
    # first) and keeps the frame picked if it is still listed: rank 1's pick survives, and
    # Continue lets rank 1 go on
    followed = int(frames[0][0].split()[1])
    _pick(page, 1, 1)
    _click(page, "evaluate")
    console = page.locator(".jp-DebugConsole").first
    console.wait_for(state="visible", timeout=30_000)
    on = _evaluate(page, console, traffic, "rank")
    assert _evaluate(page, console, traffic, "t") == "Tensor(3, 4) float32 cpu"
    selected = [name for name, _, sel in _frames(page) if sel]
    _shot(page, "console")
    _click(page, "continue")
    left = _wait_one_frame(page, "one rank continued at step 1")
    _shot(page, "continued-after-console")
    lost = []
    if on != "1":
        lost.append(f"the console evaluated on rank {on}")
    if selected != ["rank 1 · <module>"]:
        lost.append(f"the Callstack selected {selected}")
    if left != "rank 0 · <module>":
        lost.append("Continue let rank 0 go on")
    lost_pick = (
        f"rank 1's frame picked (rank {followed} followed) and the console used: "
        + "; ".join(lost)
        + " (the page's frame ids change at every stackTrace: JupyterLab does not find "
        "the picked frame again and selects the first)"
        if lost
        else None
    )

    # 7. Terminate: every rank goes on (the Callstack empties: the page's log of it). It
    # restarts JupyterLab's debugger with the breakpoints kept, so ranks still in the loop
    # may stop again at a later step; the bug button then turns the debugger off, and the
    # cell ends; the next cell runs
    seen = page.evaluate("() => window.__hvdnbCallstack.length")
    attached = len(_replies(traffic, "attach"))
    _click(page, "terminate")
    page.wait_for_function(
        "(n) => window.__hvdnbCallstack.slice(n).some(([t, names]) => names === '')",
        arg=seen,
        timeout=60_000,
    )
    # the restart's attach answered: the button is usable (120 s: once, at a load of 6 with
    # the other lane busy, 60 s were not enough; alone it takes a second or two)
    since = len(traffic)
    deadline = time.monotonic() + 120
    while len(_replies(traffic, "attach")) <= attached:
        assert time.monotonic() < deadline, (
            "the debugger did not attach again after Terminate; debug messages since: "
            + ", ".join(
                f"{m['dir']} {m['type']} {m['content'].get('command')}"
                for m in traffic[since:][-30:]
            )
        )
        page.wait_for_timeout(100)
    restopped = _frames(page)
    _shot(page, "terminated")
    _toggle_debugger(page, on=False)
    text = _wait_text(train, [r"\[0\] done 0 3\.0", r"\[1\] done 1 3\.0"], 120)
    assert "Error" not in text, text
    _wait_done(train, 60)
    _shot(page, "off")
    _run_cell(page, nxt)
    _wait_text(nxt, [r"\[0\] next 0", r"\[1\] next 1"], 90)
    _wait_done(nxt, 60)
    _shot(page, "next")
    if restopped:
        print(f"\n    after Terminate the ranks stopped again: {restopped}")
    if page.locator(".jp-DebuggerPausedOverlay").count():  # seen now and then (debug.md)
        print("\n    the notebook still shows 'Paused in Debugger' with the debugger off")
    return lost_pick
