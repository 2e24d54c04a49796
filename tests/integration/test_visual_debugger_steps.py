"""JupyterLab's visual debugger on the ranks, past the first stop: stepping on the picked
rank, a module's breakpoints, conditions, pause on exceptions, ``breakpoint()``, a pause
longer than the collective timeout, and the stop button. Over jupyter_client as JupyterLab
speaks it, in the real kernel from the kernelspec, two ranks under mpiexec."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hvdnb.notebook.headless.runner import Kernel
from tests.integration.test_visual_debugger import Debugger

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

#: the ranks' collective timeout in this module's cluster: a pause in the debugger outlasts it
COLLECTIVE_TIMEOUT = 3

LOOP = (
    "%%distributed\n"
    "import os, torch, torch.distributed as dist\n"
    "rank = int(os.environ['RANK'])\n"
    "for step in range(3):\n"
    "    x = torch.ones(1) * step\n"  # line 5 of the cell as the page numbers it
    "    dist.all_reduce(x)\n"
    "print('done', rank, float(x))\n"
)
TIMEOUTS = (
    "%%distributed\n"
    "from torch.distributed import distributed_c10d as c10d\n"
    "import hvdnb.rank.visualdebug as v\n"
    "print('timeouts', sorted({v._timeout_of(g).total_seconds() for g in c10d._world.pg_map}),"
    " 'debugger', v.active())\n"
)


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    env = {
        "HVDNB_PANEL": "inline",
        "HVDNB_RANKS": "2",
        "HVDNB_STALL_AFTER": "1",
        "HVDNB_COLLECTIVE_TIMEOUT": str(COLLECTIVE_TIMEOUT),
    }
    with Kernel(env) as k:
        r = k.run("%dist start -n 2", timeout=240)
        assert r.error is None, r
        r = k.run(TIMEOUTS)  # the debugger never turned on yet: collectives time out
        assert f"timeouts [{COLLECTIVE_TIMEOUT:.1f}] debugger False" in r.text, r
        yield k


@pytest.fixture()
def dbg(kernel: Kernel) -> Iterator[Debugger]:
    """The debugger turned on (initialize, attach), and off again after the test."""
    d = Debugger(kernel)
    init = d.start()
    assert init["success"], init.get("message", init)
    try:
        yield d
    finally:
        d.req("disconnect", restart=False, terminateDebuggee=False)


def _collect(k: Kernel, msg_id: str, within: float = 120) -> tuple[str, str | None]:
    """The cell's printed text and its error ("ename: evalue"), once the kernel is idle."""
    text, error = [], None
    while True:
        try:
            m = k.kc.get_iopub_msg(timeout=within)
        except queue.Empty:
            raise AssertionError(f"the cell did not end; it printed {''.join(text)!r}") from None
        if m["parent_header"].get("msg_id") != msg_id:
            continue
        if m["msg_type"] == "stream":
            text.append(m["content"]["text"])
        elif m["msg_type"] == "error":
            error = f"{m['content']['ename']}: {m['content']['evalue']}"
        elif m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
            return "".join(text), error


def _frames(d: Debugger) -> list[dict[str, Any]]:
    """Every stopped rank's frames, as the page's Callstack lists them."""
    threads = d.req("debugInfo")["body"]["stoppedThreads"]
    if not threads:
        return []
    return list(d.req("stackTrace", threadId=threads[0])["body"]["stackFrames"])


def _top(frames: list[dict[str, Any]], rank: int) -> dict[str, Any] | None:
    mine = [f for f in frames if f["name"].startswith(f"rank {rank} · ")]
    return mine[0] if mine else None


def _until(d: Debugger, ok: Callable[[list[dict[str, Any]]], bool], what: str) -> list[Any]:
    deadline = time.monotonic() + 60
    frames: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        frames = _frames(d)
        if ok(frames):
            return frames
        time.sleep(0.2)
    raise AssertionError(f"{what}: the Callstack shows {[(f['name'], f['line']) for f in frames]}")


def _at(frames: list[dict[str, Any]], rank: int, name: str, line: int) -> bool:
    top = _top(frames, rank)
    return top is not None and top["name"] == f"rank {rank} · {name}" and top["line"] == line


@pytest.mark.timeout(300)
def test_a_conditional_breakpoint_holds_one_rank_past_the_collective_timeout(kernel, dbg):
    """``rank == 1 and step == 1`` stops rank 1 only. Held there for twice the collective
    timeout, its peer waits in all_reduce without timing out, and the cell says who waits
    on whom instead of reporting a stall. Turned off, the timeouts are back."""
    path = dbg.req("dumpCell", code=LOOP)["body"]["sourcePath"]
    bp = dbg.req(
        "setBreakpoints",
        source={"path": path},
        breakpoints=[{"line": 5, "condition": "rank == 1 and step == 1"}],
    )
    assert bp["success"], bp
    assert dbg.req("configurationDone")["success"]
    msg_id = kernel.kc.execute(LOOP)
    frames = _until(dbg, lambda f: _at(f, 1, "<module>", 5), "rank 1 stopped at line 5")
    assert _top(frames, 0) is None, frames  # the condition is false on rank 0
    ev = dbg.req("evaluate", expression="(rank, step)", frameId=_top(frames, 1)["id"])
    assert ev["body"]["result"] == "(1, 1)", ev
    time.sleep(2 * COLLECTIVE_TIMEOUT + 1)  # rank 0 waits in all_reduce all this time
    thread = dbg.req("debugInfo")["body"]["stoppedThreads"][0]
    assert dbg.req("continue", threadId=thread)["success"]
    text, error = _collect(kernel, msg_id)
    assert error is None, (error, text)
    assert "done 0 4.0" in text and "done 1 4.0" in text, text  # 2 + 2 at the last step
    assert (
        "rank 1 paused in JupyterLab's debugger; rank 0 waits on it in all_reduce at <cell " in text
    ), text
    assert "stalled" not in text, text
    held = kernel.run(TIMEOUTS)
    assert "timeouts [86400.0] debugger True" in held.text, held
    assert dbg.req("disconnect", restart=False, terminateDebuggee=False)["success"]
    after = kernel.run(TIMEOUTS)
    assert f"timeouts [{COLLECTIVE_TIMEOUT:.1f}] debugger False" in after.text, after


@pytest.mark.timeout(300)
def test_stepping_acts_on_the_picked_rank_and_a_modules_breakpoint_stops_every_rank(
    kernel, dbg, tmp_path: Path
):
    module = tmp_path / "dbgsteps.py"
    module.write_text("def scale(x, rank):\n    y = x * (rank + 1)\n    return y\n")
    cell = (
        "%%distributed\n"
        f"import os, sys, torch, torch.distributed as dist; sys.path.insert(0, {str(tmp_path)!r})\n"
        "import dbgsteps\n"
        "rank = int(os.environ['RANK'])\n"
        "for step in range(2):\n"
        "    v = dbgsteps.scale(step, rank)\n"  # line 6
        "    dist.all_reduce(torch.ones(1))\n"
        "print('done', rank, v)\n"
    )
    path = dbg.req("dumpCell", code=cell)["body"]["sourcePath"]
    assert dbg.req("setBreakpoints", source={"path": path}, breakpoints=[{"line": 6}])["success"]
    assert dbg.req("configurationDone")["success"]
    msg_id = kernel.kc.execute(cell)
    frames = _until(
        dbg, lambda f: _at(f, 0, "<module>", 6) and _at(f, 1, "<module>", 6), "both at line 6"
    )
    followed = dbg.req("debugInfo")["body"]["stoppedThreads"][0]
    # picking rank 1's frame picks rank 1: stepping acts on it, whichever thread the page follows
    dbg.req("scopes", frameId=_top(frames, 1)["id"])
    assert dbg.req("stepIn", threadId=followed)["success"]
    frames = _until(dbg, lambda f: _at(f, 1, "scale", 2), "rank 1 stepped into scale")
    assert _at(frames, 0, "<module>", 6), frames  # rank 0 did not move
    assert _top(frames, 1)["source"]["path"] == str(module), frames
    assert dbg.req("next", threadId=followed)["success"]
    _until(dbg, lambda f: _at(f, 1, "scale", 3) and _at(f, 0, "<module>", 6), "next on rank 1")
    assert dbg.req("stepOut", threadId=followed)["success"]
    _until(dbg, lambda f: _at(f, 1, "<module>", 6), "rank 1 stepped out")

    # the module's line 3, opened in the editor: rank 0 (still before its call at step 0)
    # stops there; rank 1 goes on to wait for it in all_reduce; then both stop at step 1
    assert dbg.req("setBreakpoints", source={"path": path}, breakpoints=[])["success"]
    assert dbg.req("setBreakpoints", source={"path": str(module)}, breakpoints=[{"line": 3}])[
        "success"
    ]
    for _ in range(2):  # rank 1 (picked), then rank 0 (the page follows the next one stopped)
        thread = dbg.req("debugInfo")["body"]["stoppedThreads"][0]
        assert dbg.req("continue", threadId=thread)["success"]
    frames = _until(
        dbg, lambda f: _at(f, 0, "scale", 3) and _top(f, 1) is None, "rank 0 at module line 3"
    )
    assert (
        dbg.req("evaluate", expression="y", frameId=_top(frames, 0)["id"])["body"]["result"] == "0"
    )
    thread = dbg.req("debugInfo")["body"]["stoppedThreads"][0]
    assert dbg.req("continue", threadId=thread)["success"]
    frames = _until(
        dbg, lambda f: _at(f, 0, "scale", 3) and _at(f, 1, "scale", 3), "both at step 1's line 3"
    )
    y = dbg.req("evaluate", expression="y", frameId=_top(frames, 1)["id"])["body"]["result"]
    assert y == "2", y  # step 1 on rank 1: 1 * (1 + 1)
    assert dbg.req("disconnect", restart=False, terminateDebuggee=False)["success"]
    text, error = _collect(kernel, msg_id)
    assert error is None and "done 0 1" in text and "done 1 2" in text, (error, text)


@pytest.mark.timeout(300)
def test_pause_on_exceptions_stops_the_rank_that_raised_and_never_the_notebook(kernel, dbg):
    cell = (
        "%%distributed\n"
        "import os\n"
        "rank = int(os.environ['RANK'])\n"
        "if rank == 0:\n"
        "    raise ValueError('boom')\n"  # line 5
        "print('ok', rank)\n"
    )
    dbg.req("dumpCell", code=cell)
    assert dbg.req("setExceptionBreakpoints", filters=["userUnhandled"])["success"]
    assert dbg.req("configurationDone")["success"]
    msg_id = kernel.kc.execute(cell)
    frames = _until(dbg, lambda f: _at(f, 0, "<module>", 5), "rank 0 stopped at its raise")
    assert _top(frames, 1) is None, frames
    thread = dbg.req("debugInfo")["body"]["stoppedThreads"][0]
    info = dbg.req("exceptionInfo", threadId=thread)
    assert info["success"] and "ValueError" in info["body"]["exceptionId"], info
    assert dbg.req("continue", threadId=thread)["success"]
    # the cell fails naming rank 0; the notebook's own debugpy does not stop at the error
    # it raises for the ranks (it would hold the cell until someone pressed Continue)
    text, error = _collect(kernel, msg_id, within=60)
    assert error is not None and "ValueError" in error and "rank 0" in error, (error, text)
    assert "ok 1" in text, text
    assert dbg.req("debugInfo")["body"]["stoppedThreads"] == []
    r = kernel.run("%%distributed\nprint('next', rank)")
    assert r.error is None and "next 0" in r.text and "next 1" in r.text, r


@pytest.mark.timeout(300)
def test_breakpoint_stops_in_the_visual_debugger_and_is_pdbs_again_once_it_is_off(kernel, dbg):
    cell = (
        "%%distributed\n"
        "import os\n"
        "rank = int(os.environ['RANK'])\n"
        "here = rank * 10\n"
        "breakpoint()\n"  # line 5
        "print('after', here)\n"
    )
    dbg.req("dumpCell", code=cell)
    assert dbg.req("configurationDone")["success"]
    msg_id = kernel.kc.execute(cell)
    frames = _until(
        dbg, lambda f: _at(f, 0, "<module>", 5) and _at(f, 1, "<module>", 5), "both at line 5"
    )
    ev = dbg.req("evaluate", expression="here", frameId=_top(frames, 1)["id"])
    assert ev["body"]["result"] == "10", ev
    assert dbg.req("disconnect", restart=False, terminateDebuggee=False)["success"]
    text, error = _collect(kernel, msg_id)
    assert error is None and "after 0" in text and "after 10" in text, (error, text)
    # off: breakpoint() goes to the ranks' pdb (prompted in the notebook) again
    r = kernel.run(TIMEOUTS)
    assert "debugger False" in r.text and "debugger True" not in r.text, r


@pytest.mark.timeout(300)
def test_the_stop_button_ends_a_cell_held_in_the_debugger_and_the_ranks_stop_again(kernel, dbg):
    path = dbg.req("dumpCell", code=LOOP)["body"]["sourcePath"]
    assert dbg.req("setBreakpoints", source={"path": path}, breakpoints=[{"line": 5}])["success"]
    assert dbg.req("configurationDone")["success"]
    msg_id = kernel.kc.execute(LOOP)
    _until(dbg, lambda f: _at(f, 0, "<module>", 5) and _at(f, 1, "<module>", 5), "both held")
    kernel.km.interrupt_kernel()
    text, error = _collect(kernel, msg_id, within=60)
    assert error is not None and "KeyboardInterrupt" in error, (error, text)
    assert "restarting the cluster" not in text, text
    assert dbg.req("debugInfo")["body"]["stoppedThreads"] == []
    # the same cell again: the ranks stop at the breakpoint again, and go on to the end
    msg_id = kernel.kc.execute(LOOP)
    _until(dbg, lambda f: _at(f, 0, "<module>", 5) and _at(f, 1, "<module>", 5), "held again")
    assert dbg.req("disconnect", restart=False, terminateDebuggee=False)["success"]
    text, error = _collect(kernel, msg_id)
    assert error is None and "done 0 4.0" in text and "done 1 4.0" in text, (error, text)


@pytest.mark.timeout(300)
def test_terminate_mid_cell_goes_on_and_the_next_stop_still_outlasts_the_collective_timeout(
    kernel, dbg
):
    """JupyterLab's Terminate is a disconnect and a new initialize and attach, with the
    page's breakpoints sent again, while the cell runs: the ranks go on, stop again at the
    next step (2 s later, of 8: the page's requests take a moment, more on a loaded box), and their peers still wait past ``collective_timeout``."""
    slow = LOOP.replace("    dist.all_reduce(x)\n", "    dist.all_reduce(x)\n    time.sleep(2)\n")
    slow = slow.replace("import os, ", "import os, time, ").replace("range(3)", "range(8)")
    path = dbg.req("dumpCell", code=slow)["body"]["sourcePath"]
    bps = [{"line": 5, "condition": "rank == 0"}]
    assert dbg.req("setBreakpoints", source={"path": path}, breakpoints=bps)["success"]
    msg_id = kernel.kc.execute(slow)
    frames = _until(dbg, lambda f: _at(f, 0, "<module>", 5), "rank 0 held at step 0")
    step = dbg.req("evaluate", expression="step", frameId=_top(frames, 0)["id"])["body"]
    assert step["result"] == "0", step
    assert dbg.req("disconnect", restart=False, terminateDebuggee=False)["success"]
    assert dbg.req("initialize", clientID="jupyterlab", adapterID="python")["success"]
    assert dbg.req("attach")["success"]
    assert dbg.req("setBreakpoints", source={"path": path}, breakpoints=bps)["success"]

    def later(f: list[dict[str, Any]]) -> bool:
        top = _top(f, 0)
        if top is None or not _at(f, 0, "<module>", 5):
            return False
        return dbg.req("evaluate", expression="step", frameId=top["id"])["body"]["result"] != "0"

    _until(dbg, later, "rank 0 held again at a later step")
    time.sleep(2 * COLLECTIVE_TIMEOUT + 1)  # rank 1 waits in all_reduce all this time
    assert dbg.req("disconnect", restart=False, terminateDebuggee=False)["success"]
    text, error = _collect(kernel, msg_id)
    assert error is None and "done 0 14.0" in text and "done 1 14.0" in text, (error, text)


@pytest.mark.timeout(300)
def test_a_local_cell_keeps_the_stock_debugger_and_auto_modes_cells_stop_the_ranks(kernel, dbg):
    """A cell that runs in the notebook stops in the notebook's own debugpy, as in a plain
    ipykernel; in auto mode a cell without ``%%distributed`` goes to the ranks, and its
    breakpoints with it, at the page's lines (there is no magic line to skip)."""
    local = "a = 1\nb = a + 41\nprint('local', b)\n"
    path = dbg.req("dumpCell", code=local)["body"]["sourcePath"]
    assert dbg.req("setBreakpoints", source={"path": path}, breakpoints=[{"line": 2}])["success"]
    msg_id = kernel.kc.execute(local)
    deadline, threads = time.monotonic() + 60, []
    while not threads and time.monotonic() < deadline:
        threads = dbg.req("debugInfo")["body"]["stoppedThreads"]
        time.sleep(0.2)
    if not threads:  # which of two failures: the cell never stopped, or its stop went unlisted
        try:
            text, error = _collect(kernel, msg_id, within=10)
            pytest.fail(f"the cell ran past its breakpoint: printed {text!r}, error {error}")
        except AssertionError as exc:
            pytest.fail(f"the cell is held, but debugInfo lists no stopped thread ({exc})")
    assert threads[0] < 1_000_000, threads  # the notebook's own thread
    frames = dbg.req("stackTrace", threadId=threads[0])["body"]["stackFrames"]
    assert frames[0]["line"] == 2 and frames[0]["source"]["path"] == path, frames
    assert not frames[0]["name"].startswith("rank "), frames
    assert dbg.req("continue", threadId=threads[0])["success"]
    text, error = _collect(kernel, msg_id)
    assert error is None and "local 42" in text, (error, text)
    assert dbg.req("setBreakpoints", source={"path": path}, breakpoints=[])["success"]

    r = kernel.run("%dist auto on")
    assert r.error is None, r
    try:
        auto = "import os\nrank = int(os.environ['RANK'])\nmine = rank + 100\nprint('auto', mine)\n"
        path = dbg.req("dumpCell", code=auto)["body"]["sourcePath"]
        bp = dbg.req("setBreakpoints", source={"path": path}, breakpoints=[{"line": 4}])
        assert bp["success"], bp
        msg_id = kernel.kc.execute(auto)
        frames = _until(
            dbg, lambda f: _at(f, 0, "<module>", 4) and _at(f, 1, "<module>", 4), "both at 4"
        )
        got = dbg.req("evaluate", expression="mine", frameId=_top(frames, 1)["id"])["body"]
        assert got["result"] == "101", got
        assert dbg.req("setBreakpoints", source={"path": path}, breakpoints=[])["success"]
        for _ in range(2):
            thread = dbg.req("debugInfo")["body"]["stoppedThreads"][0]
            assert dbg.req("continue", threadId=thread)["success"]
        text, error = _collect(kernel, msg_id)
        assert error is None and "auto 100" in text and "auto 101" in text, (error, text)
    finally:
        kernel.run("%dist auto off")
