"""JupyterLab's visual debugger on the ranks, over jupyter_client as JupyterLab speaks it:
``debug_request`` on the control channel (initialize, attach, dumpCell, setBreakpoints,
configurationDone, debugInfo, stackTrace, scopes, variables, evaluate, continue,
disconnect) while a ``%%distributed`` cell runs, in the real kernel from the kernelspec."""

from __future__ import annotations

import queue
import time
from typing import Any

import pytest

from hvdnb.notebook.headless.runner import Kernel

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

CELL = (
    "%%distributed\n"
    "import os, torch\n"
    "rank = int(os.environ['RANK'])\n"
    "t = torch.ones(3, 4) * rank\n"
    "for step in range(2):\n"
    "    y = step + rank\n"  # line 6 of the cell as the page numbers it
    "print('done', rank)\n"
)


class Debugger:
    """What JupyterLab's debugger sends, one request at a time."""

    def __init__(self, k: Kernel) -> None:
        self.k, self.seq = k, 0

    def req(self, command: str, **arguments: Any) -> dict[str, Any]:
        self.seq += 1
        return self.k.debug_request(self.seq, command, **arguments)

    def start(self) -> dict[str, Any]:
        """The bug button: initialize and attach, as JupyterLab sends them."""
        init = self.req(
            "initialize",
            clientID="jupyterlab",
            adapterID="python",
            pathFormat="path",
            linesStartAt1=True,
            columnsStartAt1=True,
        )
        if init["success"]:
            assert self.req("attach")["success"]
        return init

    def stopped(self, n: int, within: float = 90) -> list[int]:
        """The page's thread ids of the ranks stopped, once ``n`` are (as a reloaded page
        learns them: debugInfo)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            got = self.req("debugInfo")["body"]["stoppedThreads"]
            if len(got) >= n:
                return list(got)
            time.sleep(0.2)
        raise AssertionError(f"{n} ranks did not stop within {within} s: {got}")


def _until_idle(k: Kernel, msg_id: str) -> str:
    text = []
    while True:
        try:
            m = k.kc.get_iopub_msg(timeout=120)
        except queue.Empty:
            raise AssertionError("the cell did not end") from None
        if m["parent_header"].get("msg_id") != msg_id:
            continue
        if m["msg_type"] == "stream":
            text.append(m["content"]["text"])
        if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
            return "".join(text)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("n", [2, 3])
def test_a_breakpoint_stops_every_rank_and_each_reads_its_own_values(n):
    with Kernel({"HVDNB_PANEL": "inline", "HVDNB_RANKS": str(n)}) as k:
        r = k.run(f"%dist start -n {n}" + (" --oversubscribe" if n > 2 else ""), timeout=240)
        assert r.error is None, r
        d = Debugger(k)
        init = d.start()
        assert init["success"], init.get("message", init)
        path = d.req("dumpCell", code=CELL)["body"]["sourcePath"]
        bp = d.req("setBreakpoints", source={"path": path}, breakpoints=[{"line": 6}])
        assert bp["success"], bp
        assert d.req("configurationDone")["success"]
        msg_id = k.kc.execute(CELL)

        threads = d.stopped(n)
        frames = d.req("stackTrace", threadId=threads[0])["body"]["stackFrames"]
        named = sorted(f["name"] for f in frames)
        # each stopped rank's frame, named by its rank, at the cell's line as the page shows it
        assert named == [f"rank {r} · <module>" for r in range(n)], frames
        assert {(f["line"], f["source"]["path"]) for f in frames} == {(6, path)}, frames
        for f in frames:
            rank = int(f["name"].split()[1])
            scopes = d.req("scopes", frameId=f["id"])["body"]["scopes"]
            variables = d.req("variables", variablesReference=scopes[0]["variablesReference"])
            values = {v["name"]: v["value"] for v in variables["body"]["variables"]}
            assert values["rank"] == str(rank) and values["step"] == "0", values
            assert values["t"] == "Tensor(3, 4) float32 cpu", values["t"]  # not its whole repr
            ev = d.req("evaluate", expression="rank * 100 + step", frameId=f["id"], context="repl")
            assert ev["body"]["result"] == str(rank * 100), ev

        # Terminate / turning the debugger off: every rank goes on, the cell ends
        assert d.req("disconnect", restart=False, terminateDebuggee=False)["success"]
        text = _until_idle(k, msg_id)
        for rank in range(n):
            assert f"done {rank}" in text, text
        r = k.run("%%distributed\nprint('next', rank)")
        assert r.error is None and all(f"next {rank}" in r.text for rank in range(n)), r


@pytest.mark.timeout(200)
def test_the_debugger_starts_when_the_port_it_picked_was_taken_meanwhile():
    """ipykernel picks the notebook's debugpy port by binding and unbinding it; another
    process can take it before debugpy binds it (seen once in CI). The debugger then tries
    a fresh port instead of answering ``success: False`` without a reason."""
    with Kernel({"HVDNB_PANEL": "inline"}) as k:
        r = k.run(
            "import socket\n"
            "_held = socket.socket()\n"
            "_held.bind(('127.0.0.1', 0))\n"
            "_held.listen()\n"
            "get_ipython().kernel.debugger.debugpy_client.debugpy_port = "
            "str(_held.getsockname()[1])\n"
            "print('held', _held.getsockname()[1])"
        )
        assert r.error is None and "held" in r.text, r
        held = int(r.text.split()[-1])
        d = Debugger(k)
        init = d.req("initialize", clientID="jupyterlab", adapterID="python")
        assert init["success"], init.get("message", init)
        r = k.run("print(get_ipython().kernel.debugger.debugpy_client.debugpy_port)")
        assert r.error is None and int(r.text.split()[-1]) != held, r
        assert d.req("attach")["success"]
        assert d.req("disconnect", restart=False, terminateDebuggee=False)["success"]
