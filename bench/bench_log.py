"""What ``hvdnb.log`` costs and keeps: its per-call cost against another commit's, side by
side in one run, and the points it keeps at the highest rate a rank can log.

- **per call** (``--ab REF``): the same loop in fresh processes, alternating this tree and
  ``REF`` (a ``git worktree`` of that commit), ``--rounds`` each: ``--steps`` steps of a
  small matmul (~0.1-1 ms, an ordinary rate), each ending with ``hvdnb.log(step, loss,
  samples=64)`` timed alone with ``perf_counter`` around the call; the recorder sends over a
  channel that drops its messages (the pack and send are in the time). The table shows each
  side's median ns per call over rounds, and the median of per-round ratios this / REF.
- **kept** (``--lossless``): a real cluster (``hvdnb.Cluster``), cells that call
  ``hvdnb.log`` as fast as a rank can (nothing else in the loop): ``--cells`` cells of
  ``--cell-steps`` steps at 2 ranks, then ``--seconds`` seconds at 3 ranks (oversubscribed
  on a small box). For each: calls per second per rank, points logged, points that
  ``hvdnb.metrics()`` returns, points and messages lost, and the notebook's resident memory
  (RSS) before the cells and after them (the store holding every point), and with
  ``hvdnb.metrics("loss")``'s rows made too (a Python object per point, the user's list).

Prints a table and writes ``bench/results/log.json``.
Usage: ``python bench/bench_log.py [--ab 5cb4ccf^] [--rounds 5] [--steps 20000] [--lossless]
[--cells 3] [--cell-steps 100000] [--seconds 60]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "log.json"

# one round in a fresh process: prints the median ns per timed call
CHILD = r"""
import statistics, sys, time
import torch
torch.set_num_threads(1)
from hvdnb.rank.metrics.core import Recorder
import hvdnb.rank.metrics.recorder as recorder

class Drop:
    queued = 0
    def send(self, kind, **payload):
        self.queued += 1

rec = Recorder(0, Drop(), 0.25, steady_interval=1.0, warm=2.0)
recorder._RECORDER = rec
log = recorder.log
steps = int(sys.argv[1])
a = torch.randn(64, 64)
times = []
pc = time.perf_counter
for step in range(steps):
    loss = (a @ a).mean()
    t0 = pc()
    log(step, loss, samples=64)
    times.append(pc() - t0)
print(statistics.median(times) * 1e9, sum(times) / len(times) * 1e9)
"""


def _worktree(ref: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="hvdnb-ab-")) / "tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), ref],
        check=True,
        capture_output=True,
    )
    return path


def _round(tree: Path, steps: int) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(steps)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=tree,
    )
    med, mean = map(float, out.stdout.split())
    return med, mean


def per_call(ref: str, rounds: int, steps: int) -> dict[str, Any]:
    other = _worktree(ref)
    try:
        rev = subprocess.run(
            ["git", "-C", str(other), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        here, there = [], []
        for i in range(rounds):  # alternate which goes first: noise hits both alike
            pair = [(ROOT, here), (other, there)]
            for tree, acc in pair if i % 2 == 0 else pair[::-1]:
                acc.append(_round(tree, steps))
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)],
            capture_output=True,
        )
    ratios = [h[0] / t[0] for h, t in zip(here, there)]
    return {
        "ref": ref,
        "ref_commit": rev,
        "steps": steps,
        "rounds": rounds,
        "this_median_ns": statistics.median(h[0] for h in here),
        "ref_median_ns": statistics.median(t[0] for t in there),
        "this_mean_ns": statistics.median(h[1] for h in here),
        "ref_mean_ns": statistics.median(t[1] for t in there),
        "ratio_median": statistics.median(ratios),
        "rounds_this": here,
        "rounds_ref": there,
    }


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _kept(n: int, cells: int, cell_steps: int, seconds: float) -> dict[str, Any]:
    import hvdnb
    from hvdnb.notebook.cellout.cells import run_cell

    c = hvdnb.Cluster(n=n, oversubscribe=n > 2)
    c.start()
    try:
        rss0 = _rss()
        before = len(hvdnb.metrics("loss"))  # an earlier cluster's, in this session's store
        rates = []
        if seconds:
            code = (
                "import time, hvdnb\nt0 = time.perf_counter(); s = 0\n"
                f"while time.perf_counter() - t0 < {seconds}:\n"
                "    hvdnb.log(s, s * 0.5, samples=8); s += 1\n"
                "(s, s / (time.perf_counter() - t0))"
            )
            cells = 1
        else:
            code = (
                "import time, hvdnb\nt0 = time.perf_counter()\n"
                f"for s in range({cell_steps}):\n    hvdnb.log(s, s * 0.5, samples=8)\n"
                f"({cell_steps}, {cell_steps} / (time.perf_counter() - t0))"
            )
        logged = 0
        for _ in range(cells):
            r = run_cell(c, code, quiet=True)
            for steps, rate in r.values.values():
                logged += steps
                rates.append(rate)
        rss_store = _rss()  # the store holding the points, before any rows are made
        rows = hvdnb.metrics("loss")
        return {
            "ranks": n,
            "cells": cells,
            "calls_per_s_per_rank": statistics.median(rates),
            "logged": logged,
            "returned": len(rows) - before,
            "lost_points": rows.lost_points,
            "lost_messages": rows.lost_messages,
            "notebook_rss_mib_before": rss0 / 2**20,
            "notebook_rss_mib_after": rss_store / 2**20,
            # hvdnb.metrics("loss")'s rows on top (a Python object per point)
            "notebook_rss_mib_with_rows": _rss() / 2**20,
        }
    finally:
        c.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ab", default="", help="a commit to compare the per-call cost with")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--lossless", action="store_true")
    ap.add_argument("--cells", type=int, default=3)
    ap.add_argument("--cell-steps", type=int, default=100_000)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--json", default=str(OUT))
    a = ap.parse_args()
    out: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    if a.ab:
        pc = per_call(a.ab, a.rounds, a.steps)
        out["per_call"] = pc
        print(f"hvdnb.log per call, {a.rounds} rounds of {a.steps} steps (median ns)")
        print(f"{'this tree':>14} {pc['this_median_ns']:>8.0f}")
        print(f"{pc['ref_commit']:>14} {pc['ref_median_ns']:>8.0f}")
        print(f"{'this / ref':>14} {pc['ratio_median']:>8.3f}")
    if a.lossless:
        t0 = time.time()
        out["kept"] = [
            _kept(2, a.cells, a.cell_steps, 0.0),
            _kept(3, 1, 0, a.seconds),
        ]
        out["kept_s"] = time.time() - t0
        print(
            f"{'ranks':>5} {'cells':>5} {'calls/s/rank':>12} {'logged':>9} {'returned':>9} "
            f"{'lost':>5} {'RSS MiB before/after':>21}"
        )
        for k in out["kept"]:
            print(
                f"{k['ranks']:>5} {k['cells']:>5} {k['calls_per_s_per_rank']:>12,.0f} "
                f"{k['logged']:>9,} {k['returned']:>9,} "
                f"{k['lost_points'] + k['lost_messages']:>5} "
                f"{k['notebook_rss_mib_before']:>10.0f}/{k['notebook_rss_mib_after']:<10.0f}"
            )
    Path(a.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
