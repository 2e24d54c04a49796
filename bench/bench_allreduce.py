"""Allreduce latency and bus bandwidth: hvdnb vs raw torch.distributed vs raw mpi4py.

Run: ``mpiexec -n 2 python bench/bench_allreduce.py [--quick] [--cuda]``. Every variant
reduces the same float32 tensor in place; variants are interleaved round by round so
machine noise hits them equally, and the table shows medians. Bus bandwidth = 2 (n-1)/n *
bytes / time (NCCL-tests' definition; 0 on one rank). On CPU the raw variants are
torch.distributed over gloo and mpi4py; with ``--cuda`` the tensors live on each rank's GPU
and the raw variant is torch.distributed over the group's backend (NCCL with a GPU per
rank), timed with ``torch.cuda.synchronize()`` before each clock read (mpi4py is left out:
MPICH's wheel is not CUDA-aware). Writes ``bench/results/allreduce.json`` on rank 0
(``allreduce-cuda.json`` with ``--cuda``).
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
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    name = "allreduce-cuda.json" if args.cuda else "allreduce.json"
    args.out = args.out or str(Path(__file__).parent / "results" / name)
    hvd.init()
    from mpi4py import MPI

    dev = torch.device("cuda", torch.cuda.current_device()) if args.cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if args.cuda else (lambda: None)
    raw = dist.get_backend() if args.cuda else "gloo"

    comm = MPI.COMM_WORLD.Dup()
    n, rank = hvd.size(), hvd.rank()
    sizes = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    # many short blocks: a burst of load from another job spoils a few blocks, not a median
    rounds = 3 if args.quick else 25
    rows = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, device=dev)
        iters = max(3, min(400, (16 << 20) // nbytes) // (4 if args.quick else 1))
        variants = {
            "hvdnb": lambda: hvd.allreduce_(t, op=hvd.Sum, name="bench"),
            raw: lambda: dist.all_reduce(t),
        }
        if not args.cuda:
            arr = t.numpy()
            variants["mpi4py"] = lambda: comm.Allreduce(MPI.IN_PLACE, arr, MPI.SUM)
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
        best = min(v for k, v in med.items() if k != "hvdnb")
        row = {"bytes": nbytes, "iters": iters}
        for k, v in med.items():
            row[f"{k}_us"] = v * 1e6
            row[f"{k}_busbw_GBps"] = 2 * (n - 1) / n * nbytes / v / 1e9
        row["hvdnb_vs_best_raw"] = best / med["hvdnb"]
        rows.append(row)
    if rank == 0:
        where = f"on {torch.cuda.get_device_name(dev)}" if args.cuda else "on CPU"
        print(
            f"allreduce float32 in place {where}, {n} ranks, medians of {rounds} "
            "interleaved rounds (hvdnb/best: best raw time / hvdnb time)"
        )
        keys = list(variants)
        print(
            f"{'size':>8} | "
            + " | ".join(f"{k + ' us':>11} {'GB/s':>6}" for k in keys)
            + " | hvdnb/best"
        )
        for r in rows:
            b = r["bytes"]
            label = f"{b >> 20} MB" if b >= 1 << 20 else f"{b >> 10} KB"
            cells = " | ".join(f"{r[k + '_us']:11.1f} {r[k + '_busbw_GBps']:6.2f}" for k in keys)
            print(f"{label:>8} | {cells} | {r['hvdnb_vs_best_raw']:.2f}x")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "ranks": n,
            "rounds": rounds,
            "device": where,
            "raw_backend": raw,
            "torch": torch.__version__,
        }
        Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
