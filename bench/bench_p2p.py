"""What the GPU point-to-point rules (``hvdnb.rank.gpurules``) cost per call.

Run: ``mpiexec -n 2 python bench/bench_p2p.py [--rounds 20] [--reps 400] [--bytes 4096]``.
Every rank joins the job as an engine does (``rendezvous.init_process_group``, which guards
``torch.distributed``'s send/recv), then exchanges a buffer with its ring neighbours
(``isend`` right, ``recv`` from the left), in interleaved blocks: the guarded functions
against torch's own (``__wrapped__``), swapping the order every round. The table shows the
median time per exchange of each and the median of the per-round differences. Rank 0 writes
``bench/results/p2p.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20, help="interleaved blocks per variant")
    ap.add_argument("--reps", type=int, default=400, help="exchanges per block")
    ap.add_argument("--bytes", type=int, default=4096, help="bytes per message")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "p2p.json"))
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    from hvdnb.rank import gpurules, rendezvous

    w = rendezvous.init_process_group("gloo")
    assert gpurules.installed() and getattr(dist.isend, "__hvdnb_guarded__", False)
    if w.size < 2:
        raise SystemExit("run under mpiexec -n 2 (or more): a ring needs a neighbour")
    right, left = (w.rank + 1) % w.size, (w.rank - 1) % w.size
    out = torch.ones(args.bytes // 4)
    inbox = torch.empty_like(out)
    variants = {
        "guarded": (dist.isend, dist.recv),
        "torch": (dist.isend.__wrapped__, dist.recv.__wrapped__),  # type: ignore[attr-defined]
    }

    def block(isend, recv) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.reps):
            req = isend(out, right)
            recv(inbox, left)
            req.wait()
        return (time.perf_counter() - t0) / args.reps

    for isend, recv in variants.values():  # warm up both
        block(isend, recv)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(block(*variants[name]))
    diffs = [g - t for g, t in zip(times["guarded"], times["torch"])]
    if w.rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{w.size} ranks, {args.bytes} B per message, {args.rounds} rounds x {args.reps}")
        print(f"{'variant':10s}{'us/exchange':>14s}")
        for name, t in med.items():
            print(f"{name:10s}{1e6 * t:14.2f}")
        d = statistics.median(diffs)
        print(
            f"the rules add {1e6 * d:+.2f} us per exchange (median of per-round differences; "
            f"{100 * d / med['torch']:+.1f} %)"
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {
                    "ranks": w.size,
                    "bytes": args.bytes,
                    "us": {k: 1e6 * v for k, v in med.items()},
                    "added_us": 1e6 * d,
                    "rounds": times,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
