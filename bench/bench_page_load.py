"""What a page that loads while a cell trains waits for: kernel info and every widget's state.

The "Python 3 (hvdnb)" kernel is started from its kernelspec and driven over jupyter_client
(``hvdnb.notebook.headless.runner.Kernel``), as JupyterLab drives it. ``%dist start -n N``
shows the panel; a ``%%distributed`` cell then trains (``hvdnb.log`` every 10 ms) until the
script releases it. Meanwhile a second client, with a session of its own, does what a
reloaded page (or a second tab) does: ``kernel_info_request``, then ipywidgets' control comm
(``comm_open`` on ``jupyter.widget.control``, ``request_states``). Timed: from each request
to its answer (the kernel info reply; the ``update_states`` comm message). The anchor, in the
same run: the same requests while no cell runs.

A request still unanswered after ``--wait`` seconds is recorded as that many seconds with
``answered: false`` (on a kernel where the main shell answers them, they wait for the cell).

Usage: ``python bench/bench_page_load.py [-n 2] [--rounds 5] [--wait 10] [--json PATH]``
(default ``bench/results/page_load.json``)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from hvdnb.notebook.headless.runner import Kernel

HELD = """%%distributed
import os, time, hvdnb
step = 0
while not os.path.exists({release!r}):
    hvdnb.log(step, 1.0 / (step + 1))
    if step == 5:
        open({started!r}, "a").close()
    step += 1
    time.sleep(0.01)
"""


def _page_load(k: Kernel, wait: float) -> dict[str, Any]:
    page = k.page()
    try:
        t0 = time.perf_counter()
        try:
            page.kernel_info(reply=True, timeout=wait)
            info, info_ok = time.perf_counter() - t0, True
        except Exception:
            info, info_ok = wait, False
        t1 = time.perf_counter()
        got = Kernel.widget_states(page, wait)
        states = time.perf_counter() - t1 if got is not None else wait
        return {
            "kernel_info_s": info,
            "kernel_info_answered": info_ok,
            "states_s": states,
            "states_answered": got is not None,
        }
    finally:
        page.stop_channels()


def _until_idle(k: Kernel, msg_id: str) -> None:
    while True:
        m = k.kc.get_iopub_msg(timeout=300)
        if (
            m["parent_header"].get("msg_id") == msg_id
            and m["msg_type"] == "status"
            and m["content"]["execution_state"] == "idle"
        ):
            return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--wait", type=float, default=10.0)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "page_load.json"))
    args = ap.parse_args()
    rows: dict[str, list[dict[str, Any]]] = {"while a cell trains": [], "idle kernel": []}
    with Kernel({"HVDNB_PANEL": "side"}) as k, tempfile.TemporaryDirectory() as td:
        r = k.run(f"%dist start -n {args.n} --timeout 120", timeout=240)
        assert r.error is None, r
        for i in range(args.rounds):
            release, started = Path(td, f"release{i}"), Path(td, f"started{i}")
            msg_id = k.kc.execute(HELD.format(release=str(release), started=str(started)))
            while not started.exists():
                time.sleep(0.05)
            rows["while a cell trains"].append(_page_load(k, args.wait))
            release.touch()
            _until_idle(k, msg_id)
            rows["idle kernel"].append(_page_load(k, args.wait))  # the anchor
    out: dict[str, Any] = {"n": args.n, "rounds": args.rounds, "load_avg": os.getloadavg()}
    print(f"a page loading, {args.n} ranks, {args.rounds} rounds (load {out['load_avg'][0]:.2f})")
    print(f"{'':22} {'kernel info (ms)':>18} {'widget states (ms)':>20} {'answered':>9}")
    for name, got in rows.items():
        ki = statistics.median(g["kernel_info_s"] for g in got) * 1000
        st = statistics.median(g["states_s"] for g in got) * 1000
        ok = sum(g["kernel_info_answered"] and g["states_answered"] for g in got)
        print(f"{name:22} {ki:18.1f} {st:20.1f} {ok:>5}/{len(got)}")
        out[name] = {"median_kernel_info_ms": ki, "median_states_ms": st, "rounds": got}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
