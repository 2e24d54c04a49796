"""Core latencies, hvdnb vs raw ipyparallel, side by side in one run (2 ranks).

- cold start to ready: ``ipyparallel.Cluster(engines="mpi", n=2).start_and_connect_sync()``
  (engines only) vs ``hvdnb.Cluster(n=2).start()`` (engines + torch imported + process group)
- a no-op cell's round trip: ``view.execute("pass", block=True)`` on a default ipyparallel
  cluster vs ``%%distributed pass`` through IPython (output collected too) on an hvdnb
  cluster, interleaved with both alive; plus ``view.execute`` on the hvdnb cluster (the
  "same controller" row) to separate hvdnb's controller settings from its cell path
- stop: ``stop_cluster_sync()`` vs ``hvdnb.Cluster.stop()``
- the real kernel (``bench_kernel.py``): the "Python 3 (hvdnb)" kernel started from its
  kernelspec and driven over jupyter_client, the panel shown, ``%%distributed`` against
  ``%%px`` on the same engines: no-op cells (empty panel, after a logged run), an output
  flood, the first cell after ``%dist start``. The bare-shell rows above stay beside it:
  a bare ``InteractiveShell`` has no panel display and no IOPub, so it cannot see what
  only the real kernel pays.

Prints a table and writes ``bench/results/core.json``.
Usage: ``python bench/bench_core.py [--starts 3] [--cells 200] [--kernel-cells 40]
[--steps 20000] [--lines 20000] [--floods 5]`` (``--kernel-cells 0`` skips the real kernel)
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "core.json"


def _raw_start_stop() -> tuple[float, float]:
    import ipyparallel as ipp

    t0 = time.perf_counter()
    c = ipp.Cluster(engines="mpi", n=2, log_level=logging.WARNING)
    client = c.start_and_connect_sync()
    client.wait_for_engines(2)
    start = time.perf_counter() - t0
    client.close()
    t1 = time.perf_counter()
    c.stop_cluster_sync()
    return start, time.perf_counter() - t1


def _hvdnb_start_stop() -> tuple[float, float]:
    import hvdnb

    t0 = time.perf_counter()
    c = hvdnb.Cluster(n=2).start()
    start = time.perf_counter() - t0
    t1 = time.perf_counter()
    c.stop()
    return start, time.perf_counter() - t1


def _cells(n: int) -> tuple[list[float], list[float], list[float]]:
    """Raw ``view.execute`` on a default ipyparallel cluster, hvdnb's cell on an hvdnb
    cluster, and ``view.execute`` on the hvdnb cluster; all three interleaved, with both
    clusters alive the whole time so machine noise hits them alike."""
    import io
    import sys

    import ipyparallel as ipp
    from IPython.core.interactiveshell import InteractiveShell

    import hvdnb

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "hvdnb")
    raw_cluster = ipp.Cluster(engines="mpi", n=2, log_level=logging.WARNING)
    raw_client = raw_cluster.start_and_connect_sync()
    raw_client.wait_for_engines(2)
    c = hvdnb.Cluster(n=2).start()
    raw_view, same_view = raw_client[:], c.client[:]
    raw, ours, same = [], [], []
    real_stdout = sys.stdout
    try:
        for _ in range(10):  # warm up every path
            raw_view.execute("pass", block=True)
            same_view.execute("pass", block=True)
            sys.stdout = io.StringIO()
            shell.run_cell_magic("distributed", "", "pass")
            sys.stdout = real_stdout

        def raw_cell() -> None:
            raw_view.execute("pass", block=True)

        def our_cell() -> None:
            sys.stdout = io.StringIO()
            try:
                shell.run_cell_magic("distributed", "", "pass")
            finally:
                sys.stdout = real_stdout

        def same_cell() -> None:
            same_view.execute("pass", block=True)

        # a fresh random order each round: whichever runs right after another cluster's
        # cell shares the CPU with that cluster's trailing work (hub records, idle
        # messages), so a fixed order would favour one position
        order = [(raw_cell, raw), (our_cell, ours), (same_cell, same)]
        rng = random.Random(0)
        for _ in range(n):
            rng.shuffle(order)
            for f, out in order:
                t = time.perf_counter()
                f()
                out.append(time.perf_counter() - t)
    finally:
        sys.stdout = real_stdout
        c.stop()
        raw_client.close()
        raw_cluster.stop_cluster_sync()
    return raw, ours, same


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--cells", type=int, default=200)
    ap.add_argument("--kernel-cells", type=int, default=40, help="0: skip the real kernel")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--lines", type=int, default=20000)
    ap.add_argument("--floods", type=int, default=5, help="flood cells per side (medians)")
    args = ap.parse_args()
    # raw ipyparallel finds mpiexec on PATH (hvdnb uses the environment's own): give the
    # baseline the same one, as an activated venv would
    import os
    import sys

    os.environ["PATH"] = os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    )

    raw_start, raw_stop, our_start, our_stop = [], [], [], []
    for _ in range(args.starts):  # interleaved so machine noise hits both
        s, p = _raw_start_stop()
        raw_start.append(s)
        raw_stop.append(p)
        s, p = _hvdnb_start_stop()
        our_start.append(s)
        our_stop.append(p)
    raw_cell, our_cell, same_cell = _cells(args.cells)

    real_kernel = None
    if args.kernel_cells:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_kernel

        real_kernel = bench_kernel.run(args.kernel_cells, args.steps, args.lines, args.floods)

    med = statistics.median

    def p90(xs: list[float]) -> float:
        return sorted(xs)[int(0.9 * (len(xs) - 1))]

    rows = [
        ("cold start to ready (s)", med(raw_start), med(our_start), 0.5),
        ("no-op cell round trip (ms)", 1e3 * med(raw_cell), 1e3 * med(our_cell), 0.8),
        ("no-op cell p90 (ms)", 1e3 * p90(raw_cell), 1e3 * p90(our_cell), None),
        ("  same controller (ms)", 1e3 * med(same_cell), 1e3 * med(our_cell), None),
        ("stop (s)", med(raw_stop), med(our_stop), None),
    ]
    print(
        f"{'measure (median)':30} {'raw ipyparallel':>16} {'hvdnb':>10} {'ratio':>7} {'target':>7}"
    )
    for name, raw, ours, target in rows:
        tgt = f"<= {target}" if target else ""
        print(f"{name:30} {raw:16.3f} {ours:10.3f} {ours / raw:7.2f} {tgt:>7}")
    print(f"stop target: hvdnb <= 1 s (measured {med(our_stop):.2f} s)")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "machine": {
                    "cores": __import__("os").cpu_count(),
                    "python": platform.python_version(),
                },
                "starts": args.starts,
                "cells": args.cells,
                "raw_start_s": raw_start,
                "hvdnb_start_s": our_start,
                "raw_stop_s": raw_stop,
                "hvdnb_stop_s": our_stop,
                "raw_cell_ms_median": 1e3 * med(raw_cell),
                "hvdnb_cell_ms_median": 1e3 * med(our_cell),
                "raw_cell_ms_p90": 1e3 * p90(raw_cell),
                "execute_on_hvdnb_cluster_ms_median": 1e3 * med(same_cell),
                "hvdnb_cell_ms_p90": 1e3 * p90(our_cell),
                "ratios": {name: ours / raw for name, raw, ours, _ in rows},
                "real_kernel": real_kernel,
            },
            indent=1,
        )
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
