"""Allreduce latency and bus bandwidth: hvdnb vs raw torch.distributed vs raw mpi4py.

Run: ``mpiexec -n 2 python bench/bench_allreduce.py [--quick] [--cuda] [--max-bytes N]
[--sizes B,B,...]``.
The in-place variants reduce the same float32 tensor in place: ``hvdnb`` is a named
``hvd.allreduce_`` repeated (as DistributedOptimizer issues them), against torch.distributed
and mpi4py's ``Allreduce(IN_PLACE, ...)``. The out-of-place pair (CPU): ``hvdnb_oop`` is
``hvd.allreduce`` (a new tensor per call) against ``mpi4py_oop``, ``Allreduce(send, recv)``
into an array allocated per call (``np.empty_like``, the cheapest allocation there is).
Variants are interleaved round by round so machine noise hits them equally, and the table
shows medians and the ratios ``hvdnb/best`` (best raw in-place time / hvdnb time, of the
medians; above 1 hvdnb is faster), ``vs mpi4py`` and ``oop vs mpi4py`` (the median over
rounds of the ratio within a round: each hvdnb block runs right before its anchor's). Bus
bandwidth = 2 (n-1)/n * bytes / time (NCCL-tests' definition; 0 on one rank). With
``--cuda`` the tensors live on each rank's GPU and the raw variant is torch.distributed over the group's backend (NCCL with a
GPU per rank), timed with ``torch.cuda.synchronize()`` before each clock read (mpi4py is
left out: MPICH's wheel is not CUDA-aware). Writes ``bench/results/allreduce.json`` on rank
0 for 2 ranks, ``allreduce-<n>.json`` for n ranks (``allreduce-cuda.json`` with
``--cuda``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hvdnb.torch as hvd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer rounds (smoke test)")
    ap.add_argument("--cuda", action="store_true", help="tensors on each rank's GPU")
    ap.add_argument("--no-gloo", action="store_true", help="leave torch.distributed out (CPU)")
    ap.add_argument("--max-bytes", type=int, default=64 << 20, help="largest size")
    ap.add_argument("--sizes", default=None, help="comma-separated sizes in bytes (instead)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hvd.init()
    import numpy as np
    from mpi4py import MPI

    name = "allreduce-cuda.json" if args.cuda else "allreduce.json"
    if not args.cuda and hvd.size() != 2:
        name = f"allreduce-{hvd.size()}.json"
    args.out = args.out or str(Path(__file__).parent / "results" / name)

    dev = torch.device("cuda", torch.cuda.current_device()) if args.cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if args.cuda else (lambda: None)
    raw = dist.get_backend() if args.cuda else "gloo"

    comm = MPI.COMM_WORLD.Dup()
    n, rank = hvd.size(), hvd.rank()
    sizes = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    sizes = [b for b in sizes if b <= args.max_bytes]
    if args.sizes:
        sizes = [int(b) for b in args.sizes.split(",")]
    # many short blocks: a burst of load from another job spoils a few blocks, not a median
    rounds = 3 if args.quick else 25
    rows = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, device=dev)
        iters = max(3, min(400, (16 << 20) // nbytes) // (4 if args.quick else 1))
        src = torch.ones_like(t)  # the out-of-place input (never written)
        # each hvdnb variant right before its mpi4py anchor: their ratio is taken per round
        variants = {"hvdnb": lambda: hvd.allreduce_(t, op=hvd.Sum, name="bench")}
        if not args.cuda:
            arr, sarr = t.numpy(), src.numpy()
            variants["mpi4py"] = lambda: comm.Allreduce(MPI.IN_PLACE, arr, MPI.SUM)
            variants["hvdnb_oop"] = lambda: hvd.allreduce(src, op=hvd.Sum, name="bench_oop")
            variants["mpi4py_oop"] = lambda: comm.Allreduce(sarr, np.empty_like(sarr), MPI.SUM)
        if args.cuda or not args.no_gloo:
            variants[raw] = lambda: dist.all_reduce(t)
        samples: dict[str, list[float]] = {k: [] for k in variants}
        for f in variants.values():
            for _ in range(max(2, iters // 10)):
                f()
        sync()
        for _ in range(rounds):
            for k, f in variants.items():
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    f()
                sync()
                dt = (time.perf_counter() - t0) / iters
                samples[k].append(comm.allreduce(dt, op=MPI.MAX))
                t.fill_(1.0)
        med = {k: statistics.median(v) for k, v in samples.items()}
        best = min(v for k, v in med.items() if k not in ("hvdnb", "hvdnb_oop", "mpi4py_oop"))
        row: dict[str, float] = {"bytes": nbytes, "iters": iters}
        for k, v in med.items():
            row[f"{k}_us"] = v * 1e6
            row[f"{k}_busbw_GBps"] = 2 * (n - 1) / n * nbytes / v / 1e9
        row["hvdnb_vs_best_raw"] = best / med["hvdnb"]
        if "mpi4py" in med:
            # the median of per-round ratios: a burst of load from another job hits both
            # blocks of a round alike, where it can shift one variant's median alone
            for key, a, b in (
                ("hvdnb_vs_mpi4py", "mpi4py", "hvdnb"),
                ("oop_vs_mpi4py_oop", "mpi4py_oop", "hvdnb_oop"),
            ):
                row[key] = statistics.median(x / y for x, y in zip(samples[a], samples[b]))
        rows.append(row)
    if rank == 0:
        where = f"on {torch.cuda.get_device_name(dev)}" if args.cuda else "on CPU"
        print(
            f"allreduce float32 in place {where}, {n} ranks, medians of {rounds} "
            "interleaved rounds (hvdnb/best: best raw time / hvdnb time)"
        )
        keys = list(variants)
        ratios = ["hvdnb_vs_best_raw", "hvdnb_vs_mpi4py", "oop_vs_mpi4py_oop"]
        ratios = [k for k in ratios if k in rows[0]]
        heads = {"hvdnb_vs_best_raw": "hvdnb/best", "hvdnb_vs_mpi4py": "vs mpi4py"}
        print(
            f"{'size':>8} | "
            + " | ".join(f"{k + ' us':>14} {'GB/s':>6}" for k in keys)
            + " | "
            + " | ".join(f"{heads.get(k, 'oop vs mpi4py')}" for k in ratios)
        )
        for r in rows:
            b = int(r["bytes"])
            label = f"{b >> 20} MB" if b >= 1 << 20 else f"{b >> 10} KB"
            cells = " | ".join(f"{r[k + '_us']:14.1f} {r[k + '_busbw_GBps']:6.2f}" for k in keys)
            rs = " | ".join(f"{r[k]:9.2f}x" for k in ratios)
            print(f"{label:>8} | {cells} | {rs}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "ranks": n,
            "rounds": rounds,
            "device": where,
            "raw_backend": raw if raw in keys else None,
            "torch": torch.__version__,
        }
        Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
