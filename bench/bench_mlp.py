"""Training step time of an MLP 784-512-512-10: hvdnb vs torch DDP vs hand MPI vs none.

Run: ``mpiexec -n 2 python bench/bench_mlp.py [--quick] [--cuda]``. Batch 64 per rank, one
torch thread per rank, SGD. With ``--cuda`` the model and batch live on each rank's GPU, DDP
uses the group's backend (NCCL with a GPU per rank), the hand-MPI variant is left out
(MPICH's wheel is not CUDA-aware) and each block ends with ``torch.cuda.synchronize()``. The variants train their own copy of the same model; they are
interleaved block by block so machine noise hits them equally; the table shows the median
step time per variant and its ratio to DDP. Writes ``bench/results/mlp.json`` on rank 0.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdnb.torch as hvd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer blocks (smoke test)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--cuda", action="store_true", help="model and batch on each rank's GPU")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.out = args.out or str(
        Path(__file__).parent / "results" / ("mlp-cuda.json" if args.cuda else "mlp.json")
    )
    hvd.init()
    torch.set_num_threads(1)
    from mpi4py import MPI

    dev = torch.device("cuda", torch.cuda.current_device()) if args.cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if args.cuda else (lambda: None)
    ddp_name = f"ddp_{dist.get_backend()}"

    comm = MPI.COMM_WORLD.Dup()
    n, rank = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    base = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    ).to(dev)
    torch.manual_seed(1 + rank)
    X = torch.randn(args.batch, 784, device=dev)
    Y = torch.randint(0, 10, (args.batch,), device=dev)
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

    m_none = copy.deepcopy(base)
    m_hvd = copy.deepcopy(base)
    m_ddp = DDP(copy.deepcopy(base))
    m_mpi = copy.deepcopy(base)
    mpi_params = list(m_mpi.parameters())
    mpi_flat = torch.zeros(sum(p.numel() for p in mpi_params), device=dev)

    def hand_mpi() -> None:
        torch.cat([p.grad.reshape(-1) for p in mpi_params], out=mpi_flat)
        comm.Allreduce(MPI.IN_PLACE, mpi_flat.numpy(), MPI.SUM)
        mpi_flat.div_(n)
        for p, g in zip(mpi_params, mpi_flat.split([p.numel() for p in mpi_params])):
            p.grad.copy_(g.view_as(p))

    variants = {
        "hvdnb": stepper(
            m_hvd,
            hvd.DistributedOptimizer(
                torch.optim.SGD(m_hvd.parameters(), lr=0.01),
                named_parameters=m_hvd.named_parameters(),
            ),
        ),
        ddp_name: stepper(m_ddp, torch.optim.SGD(m_ddp.parameters(), lr=0.01)),
        "hand_mpi": stepper(m_mpi, torch.optim.SGD(m_mpi.parameters(), lr=0.01), hand_mpi),
        "no_comm": stepper(m_none, torch.optim.SGD(m_none.parameters(), lr=0.01)),
    }
    if args.cuda:
        del variants["hand_mpi"]
    blocks, per_block = (4, 10) if args.quick else (12, 25)
    for f in variants.values():
        for _ in range(5):
            f()
    sync()
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(blocks):
        for k, f in variants.items():
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(per_block):
                f()
            sync()
            dt = (time.perf_counter() - t0) / per_block
            samples[k].append(comm.allreduce(dt, op=MPI.MAX))
    # the distributed variants must have trained identically
    a = torch.cat([p.detach().reshape(-1) for p in m_hvd.parameters()])
    b = torch.cat([p.detach().reshape(-1) for p in m_ddp.module.parameters()])
    drift = (a - b).abs().max().item()
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    if rank == 0:
        where = torch.cuda.get_device_name(dev) if args.cuda else "CPU"
        print(
            f"MLP 784-512-512-10 on {where}, batch {args.batch}/rank, {n} ranks, 1 thread/rank, "
            f"median of {blocks} interleaved blocks x {per_block} steps"
        )
        print(f"{'variant':>10} | {'ms/step':>8} | {'vs DDP':>6}")
        for k, v in med.items():
            print(f"{k:>10} | {v:8.2f} | {v / med[ddp_name]:5.2f}x")
        print(f"max |hvdnb - DDP| parameter difference after training: {drift:.1e}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {
                    "ranks": n,
                    "device": where,
                    "ddp": ddp_name,
                    "torch": torch.__version__,
                    "batch_per_rank": args.batch,
                    "blocks": blocks,
                    "steps": per_block,
                    "median_ms": med,
                    "samples_ms": {k: [x * 1e3 for x in v] for k, v in samples.items()},
                    "hvdnb_vs_ddp": med["hvdnb"] / med[ddp_name],
                    "param_drift": drift,
                },
                indent=1,
            )
        )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
