"""What OpenMP's spinning wait costs a rank on a host shared with other work.

Notebook 07's "slow loader" step, in one process standing for a rank at 1 rank (torch takes
every core: hvdnb's thread count at 1 rank): 64 records decoded one by one in Python (a JSON
row each, with a 0.1 ms sleep for a slow store), then the forward and backward pass of the
lesson's MLP 64-256-256-10 on the batch. Only the compute (forward + backward) is timed, per
batch. OpenMP's default wait policy keeps torch's worker threads spinning after each
parallel region; while the loader runs on the main thread they spin on the other cores, and
when another process takes one of those cores a spinner and the thread it waits for share
it.

Each row is a fresh process (``OMP_WAIT_POLICY`` is read when torch loads its OpenMP): the
policy unset (OpenMP's default) or ``PASSIVE``, with one core kept busy by a ``yes >
/dev/null`` this bench starts (``yes``) or without it (``host``: only what the host already
runs, which on a shared box may be more than a core's worth). Reports the compute per batch
over ``--batches`` batches after 5 warm-up batches: median, mean and range, and the load
average when the row started.

Usage: ``python bench/bench_omp_wait.py [--batches 200]``; prints a table and writes
``bench/results/omp_wait.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, statistics, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
batches = int(sys.argv[1])
torch.manual_seed(0)
rows = [json.dumps([float(i % 17) / 16.0] * 64) for i in range(64 * 8)]
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                      nn.Linear(256, 10))
y = torch.randint(0, 10, (64,))
compute = []
for b in range(batches + 5):
    xs = []
    for i in range(64):                       # the slow loader: one record at a time
        time.sleep(1e-4)
        xs.append(torch.tensor(json.loads(rows[(b * 64 + i) % len(rows)])))
    x = torch.stack(xs)
    t0 = time.perf_counter()
    F.cross_entropy(model(x), y).backward()
    if b >= 5:
        compute.append(time.perf_counter() - t0)
print(json.dumps({"threads": torch.get_num_threads(), "compute_s": compute}))
"""


@contextlib.contextmanager
def busy_core(on: bool) -> Iterator[None]:
    """One core kept busy by ``yes > /dev/null`` while the block runs (when ``on``)."""
    if not on:
        yield
        return
    proc = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.terminate()
        proc.wait()


def one(policy: str | None, busy: bool, batches: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    with busy_core(busy):
        load = os.getloadavg()[0]
        res = subprocess.run(
            [sys.executable, "-c", WORKER, str(batches)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
    got = json.loads(res.stdout.strip().splitlines()[-1])
    ms = [1e3 * t for t in got["compute_s"]]
    return {
        "policy": policy or "default",
        "busy_core": "yes" if busy else "host",
        "threads": got["threads"],
        "median_ms": statistics.median(ms),
        "mean_ms": statistics.fmean(ms),
        "min_ms": min(ms),
        "max_ms": max(ms),
        "load_avg_at_start": load,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "omp_wait.json"))
    args = ap.parse_args(argv)
    rows = [
        one(policy, busy, args.batches) for busy in (True, False) for policy in (None, "PASSIVE")
    ]
    print(f"compute per batch (forward + backward), {args.batches} batches, {os.cpu_count()} cores")
    print(
        f"{'policy':>8} | {'busy':>4} | {'threads':>7} | {'median ms':>9} | {'mean ms':>7} | "
        f"{'range ms':>15} | load"
    )
    for r in rows:
        print(
            f"{r['policy']:>8} | {r['busy_core']:>4} | {r['threads']:>7} | {r['median_ms']:>9.1f} | "
            f"{r['mean_ms']:>7.1f} | {r['min_ms']:>6.1f}-{r['max_ms']:<8.1f} | "
            f"{r['load_avg_at_start']:.2f}"
        )
    res = {
        "rows": rows,
        "batches": args.batches,
        "machine": f"{os.cpu_count()} cores, shared with other work",
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
