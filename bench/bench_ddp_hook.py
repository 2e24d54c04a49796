"""What hvdnb's automatic DDP timing costs a DDP step: stock DDP against the same DDP with
the hook every model on an hvdnb rank gets (``hvdnb.rank.frameworks.ddp_hooks``; the same
hook as ``hvdnb.ddp_comm_hook``).

Run: ``mpiexec -n 2 python bench/bench_ddp_hook.py [--quick]``. MLP 784-512-512-10, batch 64
per rank, one torch thread per rank, SGD, and ``hvdnb.log(step, loss)`` every step in both
variants (the panel's line a DDP user adds), so the difference is the hook alone. The two
models train side by side, interleaved in blocks whose order swaps every pair; the table
shows each variant's median ms per step and the median over block pairs of timed / stock
(1.00: free). Writes ``bench/results/ddp-hook.json`` on rank 0.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdnb
from hvdnb.rank import rendezvous


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "ddp-hook.json"))
    args = ap.parse_args()
    rendezvous.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )
    stock = DDP(copy.deepcopy(base))
    timed = hvdnb.ddp_comm_hook(DDP(copy.deepcopy(base)))
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    steps = {"stock": 0, "timed": 0}

    def block(name: str, model: nn.Module, opt: torch.optim.Optimizer, n: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            hvdnb.log(steps[name], loss)
            steps[name] += 1
        return (time.perf_counter() - t0) / n * 1e3

    opts = {
        "stock": torch.optim.SGD(stock.parameters(), lr=0.01),
        "timed": torch.optim.SGD(timed.parameters(), lr=0.01),
    }
    models = {"stock": stock, "timed": timed}
    pairs, per = (6, 20) if args.quick else (30, 50)
    for name in models:
        block(name, models[name], opts[name], 20)  # warm up
    ms: dict[str, list[float]] = {"stock": [], "timed": []}
    ratios = []
    for i in range(pairs):
        order = ("stock", "timed") if i % 2 == 0 else ("timed", "stock")
        got = {name: block(name, models[name], opts[name], per) for name in order}
        for name, v in got.items():
            ms[name].append(v)
        ratios.append(got["timed"] / got["stock"])
    if dist.get_rank() == 0:
        med = {k: statistics.median(v) for k, v in ms.items()}
        print(f"{dist.get_world_size()} ranks, {pairs} block pairs x {per} steps")
        print(
            f"stock DDP {med['stock']:.2f} ms/step, timed {med['timed']:.2f} ms/step, "
            f"timed / stock (median of pairs) {statistics.median(ratios):.3f}"
        )
        Path(args.out).write_text(
            json.dumps({"ranks": dist.get_world_size(), "ms": ms, "ratios": ratios}, indent=1)
        )


if __name__ == "__main__":
    main()
