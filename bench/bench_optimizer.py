"""DistributedOptimizer's own cost per step, on one rank: hvdnb vs the plain optimizer.

Run: ``python bench/bench_optimizer.py [--rounds 15] [--steps 300]`` (one process; it sets
torchrun's variables itself, so hvdnb.torch runs over gloo without mpiexec). A small MLP
(32-32-32-10, batch 8: six parameters, ~0.1 ms of compute) makes the step's Python show:
what DistributedOptimizer adds per step is its hooks, the bucket's flatten and copy back,
the planned allreduce (one rank: no header exchange) and its wait. The two variants train
their own copy of the model, interleaved block by block; the table shows the median step
time of each and the difference. Writes ``bench/results/optimizer.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15, help="interleaved blocks per variant")
    ap.add_argument("--steps", type=int, default=300, help="steps per block")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "optimizer.json"))
    args = ap.parse_args()
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))

    import torch
    from torch import nn

    import hvdnb.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = nn.Sequential(
        nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)
    )
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    loss_fn = nn.CrossEntropyLoss()
    m_hvd, m_plain = copy.deepcopy(base), copy.deepcopy(base)
    variants = {
        "hvdnb": (
            m_hvd,
            hvd.DistributedOptimizer(
                torch.optim.SGD(m_hvd.parameters(), lr=0.01),
                named_parameters=m_hvd.named_parameters(),
            ),
        ),
        "plain": (m_plain, torch.optim.SGD(m_plain.parameters(), lr=0.01)),
    }

    def block(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        return (time.perf_counter() - t0) / n

    for model, opt in variants.values():
        block(model, opt, 200)
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for k, (model, opt) in variants.items():
            samples[k].append(block(model, opt, args.steps))
    med = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
    added = med["hvdnb"] - med["plain"]
    print(
        f"one rank (gloo), MLP 32-32-32-10 batch 8, median of {args.rounds} interleaved "
        f"blocks x {args.steps} steps"
    )
    print(f"{'variant':>8} | {'us/step':>8}")
    for k, v in med.items():
        print(f"{k:>8} | {v:8.1f}")
    print(f"DistributedOptimizer adds {added:.1f} us per step")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "torch": torch.__version__,
                "rounds": args.rounds,
                "steps": args.steps,
                "median_us": med,
                "added_us": added,
                "samples_us": {k: [x * 1e6 for x in v] for k, v in samples.items()},
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
