"""What hvdnb's automatic DDP timing costs a compiled DDP step: ``torch.compile`` of stock DDP
against ``torch.compile`` of the same DDP built as every DDP model on an hvdnb rank is
(``hvdnb.rank.frameworks.ddp_hooks``: its buckets timed from the first backward on).

Run: ``mpiexec -n 2 python bench/bench_compile.py [--quick] [--aa] [--backend B]``. An MLP
784-512-512-512-10 (a module of its own: Dynamo compiles a user's ``forward``, not
``nn.Sequential``'s) in DDP with 1 MB buckets (DDPOptimizer splits the graph per bucket),
batch 64 per rank, one torch thread per rank, SGD, inductor by default, and
``hvdnb.log(step, loss)`` every step in both variants (the panel's line a DDP user adds), so
the difference is hvdnb's timing alone. The two models compile in turn (the table gives
each one's Dynamo graph breaks: they must be equal), then train side by side, interleaved
in blocks of 20 steps (short, so that a pair's two blocks see the same machine) whose order
swaps every pair; the table shows each variant's median ms per step and the median over
block pairs of timed / stock (1.00: free). ``--aa`` builds both without hvdnb: the same
table for two identical variants, the noise floor. Dynamo's cache is emptied before each
model compiles; the one compiled second leaves the frames both then run (its guards pass
for the other too: hvdnb adds nothing Dynamo guards on). Writes
``bench/results/compile.json`` on rank 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdnb
from hvdnb.rank import rendezvous
from hvdnb.rank.frameworks import ddp_hooks


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(784, 512), nn.Linear(512, 512)
        self.c, self.d = nn.Linear(512, 512), nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--aa", action="store_true", help="both variants without hvdnb")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "compile.json"))
    args = ap.parse_args()
    w = rendezvous.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    state = MLP().state_dict()

    def build() -> Any:
        m = MLP()
        m.load_state_dict(state)
        return DDP(m, bucket_cap_mb=1)

    stock = build()  # torch's own constructor: hvdnb's hooks are not installed yet
    if not args.aa:
        ddp_hooks.install(rendezvous.place(w, "cpu"))  # what an engine's bootstrap does
    timed = build()
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    models = {
        k: torch.compile(m, backend=args.backend) for k, m in (("stock", stock), ("timed", timed))
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    steps = {"stock": 0, "timed": 0}

    def block(name: str, n: int) -> float:
        model, opt = models[name], opts[name]
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

    breaks: dict[str, int] = {}
    compile_s: dict[str, float] = {}
    for name in models:  # compile and warm up, one model at a time, each from scratch
        torch._dynamo.reset()
        counters.clear()
        t0 = time.perf_counter()
        block(name, 20)
        compile_s[name] = time.perf_counter() - t0
        breaks[name] = sum(counters["graph_break"].values())
    hooked = {"stock": bool(stock._comm_hooks), "timed": bool(timed._comm_hooks)}
    assert hooked == {"stock": False, "timed": not args.aa}, hooked
    pairs, per = (6, 20) if args.quick else (60, 20)
    ms: dict[str, list[float]] = {"stock": [], "timed": []}
    ratios = []
    for i in range(pairs):
        order = ("stock", "timed") if i % 2 == 0 else ("timed", "stock")
        got = {name: block(name, per) for name in order}
        for name, v in got.items():
            ms[name].append(v)
        ratios.append(got["timed"] / got["stock"])
    if dist.get_rank() == 0:
        med = {k: statistics.median(v) for k, v in ms.items()}
        ratio = statistics.median(ratios)
        label = "A/A: both without hvdnb" if args.aa else "hvdnb's automatic DDP timing"
        print(
            f"{dist.get_world_size()} ranks, torch.compile(backend={args.backend!r}), "
            f"{pairs} block pairs x {per} steps, {label}"
        )
        print(f"{'variant':<8} {'ms/step':>8} {'graph breaks':>13} {'compile+warm s':>15}")
        for k in ("stock", "timed"):
            print(f"{k:<8} {med[k]:>8.2f} {breaks[k]:>13} {compile_s[k]:>15.1f}")
        print(f"timed / stock (median of pairs) {ratio:.3f}")
        Path(args.out).write_text(
            json.dumps(
                {
                    "ranks": dist.get_world_size(),
                    "backend": args.backend,
                    "aa": args.aa,
                    "graph_breaks": breaks,
                    "compile_s": compile_s,
                    "ratio": ratio,
                    "ms": ms,
                    "ratios": ratios,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
