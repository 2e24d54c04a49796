"""What more ranks than cores cost a training step: the same MLP step at 2, 3 and 4 ranks.

``%dist start`` refuses more ranks than cores unless ``--oversubscribe`` is given; this bench
shows why. For each world size it runs ``mpiexec -n N`` of this script's worker: each rank
takes hvdnb's thread count (this host's cores divided by its ranks, at least 1), trains an
MLP 784-512-512-10 with ``hvd.DistributedOptimizer`` (batch 64 per rank, SGD) for
``--steps`` steps after 20 warm-up steps, and times every step; rank 0 reports the median,
the 99th percentile and the slowest step, and the table the host's 1-minute load average
read after each size's run (the bench's own ranks included). Ranks beyond the cores share them with each
other (and with whatever else the host runs), so a step waits whenever a peer in its
allreduce is not scheduled.

Usage: ``python bench/bench_oversubscribe.py [--sizes 2 3 4] [--steps 300]``; prints a table
and writes ``bench/results/oversubscribe.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hvdnb.torch as hvd

ROOT = Path(__file__).resolve().parents[1]


def worker(steps: int, out: str) -> None:
    hvd.init()
    threads = max(1, (os.cpu_count() or 1) // hvd.local_size())  # as hvdnb's ranks take
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU())
    model.append(nn.Linear(512, 10))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    times = []
    for step in range(steps + 20):
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step >= 20:
            times.append(time.perf_counter() - t0)
    if hvd.rank() == 0:
        Path(out).write_text(json.dumps({"threads": threads, "step_s": times}))


def one(n: int, steps: int) -> dict[str, Any]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    with tempfile.TemporaryDirectory(prefix="hvdnb-bench-oversub-") as tmp:
        out = Path(tmp) / "rank0.json"
        cmd = [str(mpiexec), "-n", str(n), sys.executable, __file__, "--worker", str(out)]
        cmd += ["--steps", str(steps)]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
        got = json.loads(out.read_text())
    ms = sorted(1e3 * t for t in got["step_s"])
    return {
        "ranks": n,
        "threads_per_rank": got["threads"],
        "steps": len(ms),
        "median_ms": statistics.median(ms),
        "p99_ms": ms[int(0.99 * (len(ms) - 1))],
        "max_ms": ms[-1],
        "load_avg": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "oversubscribe.json"))
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.steps, args.worker)
        return
    rows = [one(n, args.steps) for n in args.sizes]
    cores = os.cpu_count()
    print(f"MLP 784-512-512-10 step, batch 64 per rank, {args.steps} steps, {cores} cores")
    print(
        f"{'ranks':>5} | {'threads':>7} | {'median ms':>9} | {'p99 ms':>7} | {'max ms':>7} | load"
    )
    for r in rows:
        print(
            f"{r['ranks']:>5} | {r['threads_per_rank']:>7} | {r['median_ms']:>9.1f} | "
            f"{r['p99_ms']:>7.1f} | {r['max_ms']:>7.1f} | {r['load_avg'][0]:.2f}"
        )
    res = {
        "rows": rows,
        "cores": cores,
        "machine": f"{cores} cores, shared with other work",
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
