"""What JupyterLab's visual debugger costs the ranks, and how soon the page hears of a stop.

One real kernel from the kernelspec over jupyter_client (as JupyterLab drives it), the
panel shown, 2 ranks. Each round measures, with the debugger off and then on (turned on as
JupyterLab does: ``initialize``, ``attach``, ``configurationDone``; no breakpoint set), in
an order that alternates between rounds:

- ``noop``: the median of ``--cells`` no-op ``%%distributed`` cells, as a ratio to as many
  ``%%px`` cells on the same engines, interleaved;
- ``mlp``: the median step of the MLP 784-512-512-10 (``hvdnb.torch.DistributedOptimizer``,
  batch 64 per rank, ``hvdnb.log`` every step) over ``--steps`` steps in a ``%%distributed``
  cell, timed on each rank with ``perf_counter`` around the step;
- ``tiny``: the same for a Linear(16, 16) model, batch 8: a step that is mostly Python,
  where a tracing debugger costs most.

Then, with the debugger on, the stop latency: a breakpoint on a line that follows
``reach = time.time()`` in a loop; for each of ``--stops`` stops, the time from ``reach``
(read back from the stopped frame) to the first ``stopped`` event on iopub after it (as
the page receives it; same host, same clock), per rank and pass.

Prints a table and writes ``bench/results/debugger.json``.
Usage: ``python bench/bench_debugger.py [--rounds 3] [--cells 20] [--steps 200] [--stops 5]``
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hvdnb.notebook.headless.runner import Kernel

RESULTS = ROOT / "bench" / "results"
med = statistics.median


def _step_cell(model: str, batch: int, width: int, steps: int) -> str:
    return (
        "%%distributed -q -o got\n"
        "import time, statistics, torch, hvdnb, hvdnb.torch as hvd\n"
        "from torch import nn\n"
        "hvd.init(); torch.set_num_threads(1); torch.manual_seed(0)\n"
        f"m = {model}\n"
        "opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01),"
        " named_parameters=m.named_parameters())\n"
        f"X, Y = torch.randn({batch}, {width}), torch.randint(0, 10, ({batch},))\n"
        "loss_fn = nn.CrossEntropyLoss()\n"
        "ts = []\n"
        f"for s in range({steps}):\n"
        "    t0 = time.perf_counter()\n"
        "    opt.zero_grad(); loss = loss_fn(m(X), Y); loss.backward(); opt.step()\n"
        "    hvdnb.log(s, loss)\n"
        "    ts.append(time.perf_counter() - t0)\n"
        "1e3 * statistics.median(ts[20:])"
    )


MLP = "nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))"
TINY = "nn.Linear(16, 10)"


class Dap:
    """JupyterLab's debugger requests, over the control channel."""

    def __init__(self, k: Kernel) -> None:
        self.k, self.seq = k, 0

    def req(self, command: str, **arguments: Any) -> dict[str, Any]:
        self.seq += 1
        return self.k.debug_request(self.seq, command, **arguments)

    def on(self) -> None:
        assert self.req("initialize", clientID="jupyterlab", adapterID="python")["success"]
        assert self.req("attach")["success"]
        assert self.req("configurationDone")["success"]

    def off(self) -> None:
        self.req("disconnect", restart=False, terminateDebuggee=False)


def _step_ms(k: Kernel, cell: str) -> float:
    r = k.run(cell)
    assert r.error is None, r
    r = k.run("import json\nprint(json.dumps(got))")
    return float(med(json.loads(r.text.strip()).values()))


def _noop_ratio(k: Kernel, cells: int) -> tuple[float, float]:
    ours, px = [], []
    pair = [(ours, "%%distributed\npass"), (px, "%%px\npass")]
    for i in range(cells):
        for acc, code in pair if i % 2 == 0 else pair[::-1]:
            r = k.run(code)
            assert r.error is None, r
            acc.append(r.seconds)
    return 1e3 * med(ours), 1e3 * med(px)


def _sitting(k: Kernel, args: argparse.Namespace) -> dict[str, float]:
    noop, px = _noop_ratio(k, args.cells)
    return {
        "noop_ms": noop,
        "noop_px_ms": px,
        "noop_ratio": noop / px,
        "mlp_step_ms": _step_ms(k, _step_cell(MLP, 64, 784, args.steps)),
        "tiny_step_ms": _step_ms(k, _step_cell(TINY, 8, 16, args.steps * 5)),
    }


def _stop_latency(k: Kernel, d: Dap, stops: int) -> list[float]:
    cell = (
        "%%distributed\n"
        "import time\n"
        f"for i in range({stops}):\n"
        "    reach = time.time()\n"
        "    i = i\n"  # line 5: the breakpoint
        "print('done')\n"
    )
    path = d.req("dumpCell", code=cell)["body"]["sourcePath"]
    assert d.req("setBreakpoints", source={"path": path}, breakpoints=[{"line": 5}])["success"]
    msg_id = k.kc.execute(cell)
    seen: dict[tuple[int, float], float] = {}  # (rank, its reach time) -> latency
    while len(seen) < stops * 2:  # both ranks stop at each pass
        try:
            m = k.kc.get_iopub_msg(timeout=60)
        except queue.Empty:
            raise AssertionError(f"no stop after {len(seen)}") from None
        heard = time.time()
        if m["msg_type"] != "debug_event" or m["content"].get("event") != "stopped":
            continue
        # the page follows one thread: the event may name the followed rank while another
        # stopped too; the Callstack lists every stopped rank's frames
        thread = m["content"]["body"]["threadId"]
        frames = d.req("stackTrace", threadId=thread)["body"]["stackFrames"]
        ranks = set()
        for f in frames:
            rank = int(f["name"].split()[1])
            ev = d.req("evaluate", expression="reach", frameId=f["id"])["body"]["result"]
            seen.setdefault((rank, float(ev)), heard - float(ev))
            ranks.add(rank)
        # only the ranks read here go on: one that stopped since is read at its own event
        for t in d.req("debugInfo")["body"]["stoppedThreads"]:
            if t // 1_000_000 - 1 in ranks:
                d.req("continue", threadId=t)
    out = list(seen.values())
    d.req("setBreakpoints", source={"path": path}, breakpoints=[])
    while True:  # the cell's end
        m = k.kc.get_iopub_msg(timeout=60)
        if (
            m["parent_header"].get("msg_id") == msg_id
            and m["msg_type"] == "status"
            and m["content"]["execution_state"] == "idle"
        ):
            return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cells", type=int, default=20)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--stops", type=int, default=5)
    args = ap.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    k = Kernel({"HVDNB_PANEL": "inline", "HVDNB_RANKS": "2"})
    try:
        r = k.run("%dist start -n 2", timeout=240)
        assert r.error is None, r
        k.run("v = hvdnb.current().client[:]\nv.block = True\nv.activate()")
        k.run("%%px\npass")
        k.run("%%distributed\npass")
        d = Dap(k)
        for i in range(args.rounds):
            for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
                if side == "on":
                    d.on()
                    k.run("%%distributed\npass")  # the ranks' debugpy starts and attaches
                rows[side].append(_sitting(k, args))
                if side == "on":
                    d.off()
                print(f"round {i + 1} {side}: {json.dumps(rows[side][-1])}", flush=True)
        d.on()
        latency = _stop_latency(k, d, args.stops)
        d.off()
    finally:
        k.close()

    def ratio(key: str) -> float:
        return med(on[key] / off[key] for on, off in zip(rows["on"], rows["off"]))

    table = {
        "no-op cell / %%px (ratio)": (
            med(r["noop_ratio"] for r in rows["off"]),
            med(r["noop_ratio"] for r in rows["on"]),
            ratio("noop_ratio"),
        ),
        "MLP step, logged (ms)": (
            med(r["mlp_step_ms"] for r in rows["off"]),
            med(r["mlp_step_ms"] for r in rows["on"]),
            ratio("mlp_step_ms"),
        ),
        "tiny step, Linear(16, 10), logged (ms)": (
            med(r["tiny_step_ms"] for r in rows["off"]),
            med(r["tiny_step_ms"] for r in rows["on"]),
            ratio("tiny_step_ms"),
        ),
    }
    print(f"\n{'':42} {'off':>10} {'on':>10} {'on/off':>8}")
    for name, (a, b, q) in table.items():
        print(f"{name:42} {a:10.3f} {b:10.3f} {q:8.2f}")
    print(
        f"\nstop latency, rank at the line -> 'stopped' on iopub: median "
        f"{1e3 * med(latency):.0f} ms, max {1e3 * max(latency):.0f} ms over {len(latency)} stops"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "debugger.json").write_text(
        json.dumps(
            {
                "args": vars(args),
                "rounds": rows,
                "table": {k: dict(zip(("off", "on", "ratio"), v)) for k, v in table.items()},
                "stop_latency_s": latency,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
