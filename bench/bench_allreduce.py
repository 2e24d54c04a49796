"""Allreduce latency and bus bandwidth: hvdnb vs raw torch.distributed (gloo) vs raw mpi4py.

Run: ``mpiexec -n 2 python bench/bench_allreduce.py [--quick]``. Every variant reduces the
same float32 tensor in place; variants are interleaved round by round so machine noise
hits them equally, and the table shows medians. Bus bandwidth = 2 (n-1)/n * bytes / time
(NCCL-tests' definition). Writes ``bench/results/allreduce.json`` on rank 0.
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
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "allreduce.json"))
    args = ap.parse_args()
    hvd.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    n, rank = hvd.size(), hvd.rank()
    sizes = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    # many short blocks: a burst of load from another job spoils a few blocks, not a median
    rounds = 3 if args.quick else 25
    rows = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        arr = t.numpy()
        iters = max(3, min(400, (16 << 20) // nbytes) // (4 if args.quick else 1))
        variants = {
            "hvdnb": lambda: hvd.allreduce_(t, op=hvd.Sum, name="bench"),
            "gloo": lambda: dist.all_reduce(t),
            "mpi4py": lambda: comm.Allreduce(MPI.IN_PLACE, arr, MPI.SUM),
        }
        samples: dict[str, list[float]] = {k: [] for k in variants}
        for f in variants.values():
            for _ in range(max(2, iters // 10)):
                f()
        for _ in range(rounds):
            for k, f in variants.items():
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    f()
                dt = (time.perf_counter() - t0) / iters
                samples[k].append(comm.allreduce(dt, op=MPI.MAX))
                t.fill_(1.0)
        med = {k: statistics.median(v) for k, v in samples.items()}
        best = min(med["gloo"], med["mpi4py"])
        row = {"bytes": nbytes, "iters": iters}
        for k, v in med.items():
            row[f"{k}_us"] = v * 1e6
            row[f"{k}_busbw_GBps"] = 2 * (n - 1) / n * nbytes / v / 1e9
        row["hvdnb_vs_best_raw"] = best / med["hvdnb"]
        rows.append(row)
    if rank == 0:
        print(f"allreduce float32 in place, {n} ranks, medians of {rounds} interleaved rounds")
        print(f"{'size':>8} | {'hvdnb us':>9} {'GB/s':>6} | {'gloo us':>9} {'GB/s':>6} | "
              f"{'mpi4py us':>9} {'GB/s':>6} | hvdnb/best")
        for r in rows:
            b = r["bytes"]
            label = f"{b >> 20} MB" if b >= 1 << 20 else f"{b >> 10} KB"
            print(f"{label:>8} | {r['hvdnb_us']:9.1f} {r['hvdnb_busbw_GBps']:6.2f} | "
                  f"{r['gloo_us']:9.1f} {r['gloo_busbw_GBps']:6.2f} | {r['mpi4py_us']:9.1f} "
                  f"{r['mpi4py_busbw_GBps']:6.2f} | {r['hvdnb_vs_best_raw']:.2f}x")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"ranks": n, "rounds": rounds, "rows": rows},
                                             indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
