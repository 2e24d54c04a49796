"""Training step time of models with many parameter tensors: hvdnb vs DDP vs hand MPI vs none.

Run: ``mpiexec -n 2 python bench/bench_models.py [--quick] [--model resnet18|transformer|both]``.

Two CPU models, one torch thread per rank, SGD, the same seed everywhere:

- ``resnet18``: torchvision's resnet18 layout written out here (62 parameter tensors, 11.2 M
  parameters; torchvision does not install beside this torch), batch 8 per rank, 32x32 px,
  10 classes, BatchNorm in training mode (local statistics, as DDP without SyncBN);
- ``transformer``: 6 pre-norm encoder blocks, width 256, 4 heads, MLP 1024 (74 tensors, most
  of them small norm weights and biases), batch 8 x 32 tokens.

Variants, interleaved block by block so machine noise hits them equally (the median of each
variant's per-block times, and the median of per-block ratios to DDP, which pair blocks run
back to back): ``hvdnb`` (``hvd.DistributedOptimizer``), ``ddp_gloo`` (torch DDP),
``hand_mpi`` (every gradient concatenated into one buffer, one mpi4py ``Allreduce`` per step,
copied back: the floor for a step with no overlap) and ``no_comm`` (the step alone). Prints a
table per model and writes ``bench/results/models.json`` (``--out``) on rank 0.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdnb.torch as hvd


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """torchvision's resnet18 layout (stem conv 7x7/2 + maxpool, 4 stages of 2 blocks)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.pool = nn.MaxPool2d(3, 2, 1)
        layers: list[nn.Module] = []
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = self.layers(x)
        out: torch.Tensor = self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))
        return out


class Transformer(nn.Module):
    """Pre-norm encoder blocks over token embeddings, mean-pooled into a classifier."""

    def __init__(self, width: int = 256, depth: int = 6, heads: int = 4, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(1000, width)
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(self.blocks(self.embed(x))).mean(1))
        return out


def build(name: str, batch: int, rank: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model: nn.Module = ResNet18() if name == "resnet18" else Transformer()
    torch.manual_seed(1 + rank)
    if name == "resnet18":
        x = torch.randn(batch, 3, 32, 32)
    else:
        x = torch.randint(0, 1000, (batch, 32))
    return model, x, torch.randint(0, 10, (batch,))


def bench_model(name: str, args: argparse.Namespace, comm: object) -> dict[str, object]:
    from mpi4py import MPI

    assert isinstance(comm, MPI.Comm)
    n, rank = hvd.size(), hvd.rank()
    base, X, Y = build(name, args.batch, rank)
    loss_fn = nn.CrossEntropyLoss()

    def stepper(
        model: nn.Module, opt: torch.optim.Optimizer, sync: Callable[[], None] | None = None
    ) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad()
            loss_fn(model(X), Y).backward()
            if sync is not None:
                sync()
            opt.step()

        return step

    m_none, m_hvd, m_mpi = (copy.deepcopy(base) for _ in range(3))
    m_ddp = DDP(copy.deepcopy(base))
    mpi_params = [p for p in m_mpi.parameters() if p.requires_grad]
    mpi_flat = torch.zeros(sum(p.numel() for p in mpi_params))
    mpi_views = [
        v.view_as(p)
        for v, p in zip(torch.split(mpi_flat, [p.numel() for p in mpi_params]), mpi_params)
    ]

    def hand_mpi() -> None:
        torch.cat([p.grad.reshape(-1) for p in mpi_params], out=mpi_flat)  # type: ignore[union-attr]
        comm.Allreduce(MPI.IN_PLACE, mpi_flat.numpy(), MPI.SUM)
        mpi_flat.div_(n)
        torch._foreach_copy_([p.grad for p in mpi_params], mpi_views)  # type: ignore[misc]

    variants = {
        "hvdnb": stepper(
            m_hvd,
            hvd.DistributedOptimizer(
                torch.optim.SGD(m_hvd.parameters(), lr=0.01),
                named_parameters=m_hvd.named_parameters(),
            ),
        ),
        "ddp_gloo": stepper(m_ddp, torch.optim.SGD(m_ddp.parameters(), lr=0.01)),
        "hand_mpi": stepper(m_mpi, torch.optim.SGD(m_mpi.parameters(), lr=0.01), hand_mpi),
        "no_comm": stepper(m_none, torch.optim.SGD(m_none.parameters(), lr=0.01)),
    }
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only.split(",")}
    blocks, per_block = (3, 3) if args.quick else (args.blocks, args.steps)
    for f in variants.values():
        for _ in range(2):
            f()
    samples: dict[str, list[float]] = {k: [] for k in variants}
    keys = list(variants)
    for b in range(blocks):
        # rotate the order every block: no variant always runs first (after the barrier)
        for k in keys[b % len(keys) :] + keys[: b % len(keys)]:
            f = variants[k]
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(per_block):
                f()
            dt = (time.perf_counter() - t0) / per_block
            samples[k].append(comm.allreduce(dt, op=MPI.MAX))
    drift = float("nan")
    if "hvdnb" in variants and "ddp_gloo" in variants:
        a = torch.cat([p.detach().reshape(-1) for p in m_hvd.parameters()])
        b2 = torch.cat([p.detach().reshape(-1) for p in m_ddp.module.parameters()])
        drift = (a - b2).abs().max().item()
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    ratios = {}
    for k in samples:
        for ref in ("ddp_gloo", "hand_mpi"):
            if k != ref and ref in samples:
                ratios[f"{k}/{ref}"] = statistics.median(
                    x / y for x, y in zip(samples[k], samples[ref])
                )
    params = list(base.parameters())
    return {
        "model": name,
        "tensors": len(params),
        "parameters": sum(p.numel() for p in params),
        "blocks": blocks,
        "steps": per_block,
        "median_ms": med,
        "pair_ratios": ratios,
        "samples_ms": {k: [x * 1e3 for x in v] for k, v in samples.items()},
        "param_drift": drift,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 blocks x 3 steps (smoke test)")
    ap.add_argument("--model", default="both", choices=("resnet18", "transformer", "both"))
    ap.add_argument("--batch", type=int, default=8, help="samples per rank (default 8)")
    ap.add_argument("--blocks", type=int, default=8, help="interleaved blocks (default 8)")
    ap.add_argument("--steps", type=int, default=5, help="steps per block (default 5)")
    ap.add_argument("--only", default="", help="comma-separated variants to run (default all)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "models.json"))
    args = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    models = ("resnet18", "transformer") if args.model == "both" else (args.model,)
    results = [bench_model(m, args, comm) for m in models]
    if hvd.rank() != 0:
        return
    load = os.getloadavg()[0]
    print(
        f"{hvd.size()} ranks, CPU, 1 thread/rank, batch {args.batch}/rank, {dist.get_backend()} "
        f"for DDP, load average {load:.2f} at the end"
    )
    for r in results:
        med, rat = r["median_ms"], r["pair_ratios"]
        assert isinstance(med, dict) and isinstance(rat, dict)
        print(
            f"\n{r['model']}: {r['tensors']} tensors, {r['parameters']:,} parameters, "
            f"median of {r['blocks']} interleaved blocks x {r['steps']} steps"
        )
        print(f"{'variant':>9} | {'ms/step':>8} | {'vs DDP':>6} | {'vs MPI':>6}")
        for k, v in med.items():
            d = rat.get(f"{k}/ddp_gloo", 1.0 if k == "ddp_gloo" else float("nan"))
            m = rat.get(f"{k}/hand_mpi", 1.0 if k == "hand_mpi" else float("nan"))
            print(f"{k:>9} | {v:8.1f} | {d:5.2f}x | {m:5.2f}x")
        print(f"max |hvdnb - DDP| parameter difference after training: {r['param_drift']:.1e}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "ranks": hvd.size(),
                "device": "CPU",
                "torch": torch.__version__,
                "batch_per_rank": args.batch,
                "loadavg_1min": load,
                "models": results,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
