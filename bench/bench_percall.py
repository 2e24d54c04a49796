"""The per-call floor of hvdnb.torch's allreduce against raw MPI (issue 41's harness).

Run: ``mpiexec -n 2 python bench/bench_percall.py [--blocks 15] [--calls 50]``; 4 ranks
oversubscribed (``-n 4``) checks the structure (a second message per call shows there too).

What a Horovod user pays per call when they call ``allreduce`` per metric, per callback or
per tensor of an unfused model: ``hvd.allreduce_(t, name="g<size>", op=hvd.Sum)`` (in place,
one name per size reused by every call, as DistributedOptimizer names its tensors) and
``hvd.allreduce(t, name=..., op=hvd.Sum)`` (out of place: a new tensor per call), against
mpi4py's ``Allreduce`` on numpy buffers of the same size (in place: ``IN_PLACE``; out of
place: into a preallocated receive buffer, mpi4py's cheapest form). After ``--warmup``
calls of each, ``--blocks`` blocks of ``--calls`` calls alternate hvdnb and mpi4py (the
order swapped every block, so noise hits both alike); each block's time per call is
recorded, and the table shows the medians and the median over blocks of
mpi4py's time / hvdnb's time in the same block pair (1.0: as fast as raw MPI; above 1:
faster). Every block's numbers go to ``bench/results/percall-<n>.json`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

import hvdnb.torch as hvd

SIZES = (4 << 10, 16 << 10, 64 << 10)


def _time_block(fn, calls: int) -> float:
    MPI.COMM_WORLD.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def _pair(size: int) -> dict[str, tuple]:
    """The four callables for one size: (hvdnb, mpi4py) in place and out of place."""
    n = size // 4
    # zeros: an in-place sum repeated thousands of times stays finite
    t_in = torch.zeros(n)
    t_out = torch.zeros(n)
    a_in = np.zeros(n, dtype=np.float32)
    a_send = np.zeros(n, dtype=np.float32)
    a_recv = np.empty_like(a_send)
    comm = MPI.COMM_WORLD
    name_in, name_out = f"g{size}", f"o{size}"

    def hvd_in() -> None:
        hvd.allreduce_(t_in, name=name_in, op=hvd.Sum)

    def mpi_in() -> None:
        comm.Allreduce(MPI.IN_PLACE, a_in, op=MPI.SUM)

    def hvd_out() -> None:
        hvd.allreduce(t_out, name=name_out, op=hvd.Sum)

    def mpi_out() -> None:
        comm.Allreduce(a_send, a_recv, op=MPI.SUM)

    return {"in place": (hvd_in, mpi_in), "out of place": (hvd_out, mpi_out)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=15)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hvd.init()
    n, rank = hvd.size(), hvd.rank()
    out = args.out or str(Path(__file__).parent / "results" / f"percall-{n}.json")
    rows = []
    for size in SIZES:
        for mode, (h, m) in _pair(size).items():
            for _ in range(args.warmup):
                h()
                m()
            hv, mp, ratios = [], [], []
            for b in range(args.blocks):
                first, second = (h, m) if b % 2 == 0 else (m, h)
                t1 = _time_block(first, args.calls)
                t2 = _time_block(second, args.calls)
                th, tm = (t1, t2) if b % 2 == 0 else (t2, t1)
                hv.append(th)
                mp.append(tm)
                ratios.append(tm / th)
            rows.append(
                {
                    "bytes": size,
                    "mode": mode,
                    "hvdnb_us": [x * 1e6 for x in hv],
                    "mpi4py_us": [x * 1e6 for x in mp],
                    "ratio": ratios,
                    "hvdnb_median_us": statistics.median(hv) * 1e6,
                    "mpi4py_median_us": statistics.median(mp) * 1e6,
                    "ratio_median": statistics.median(ratios),
                }
            )
    if rank == 0:
        print(
            f"{n} ranks, {args.blocks} blocks x {args.calls} calls (mpi4py / hvdnb: 1.0 = as fast)"
        )
        print(f"{'size':>6} {'mode':<13} {'hvdnb us':>9} {'mpi4py us':>10} {'ratio':>6}")
        for r in rows:
            print(
                f"{r['bytes'] // 1024:>4}KB {r['mode']:<13} {r['hvdnb_median_us']:>9.1f} "
                f"{r['mpi4py_median_us']:>10.1f} {r['ratio_median']:>6.2f}"
            )
        meta = {
            "ranks": n,
            "host": platform.node(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "mpi": MPI.Get_library_version().splitlines()[0],
            "blocks": args.blocks,
            "calls": args.calls,
            "warmup": args.warmup,
        }
        Path(out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print("wrote", out)


if __name__ == "__main__":
    main()
