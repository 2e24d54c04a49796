"""Comm listeners report a collective's own time and the time the step was blocked by it.

A DistributedOptimizer over 6 x Linear(256, 256), one layer per bucket, so buckets start
mid-backward. Checked on counts, order and the intervals' structure, never on how fast
anything ran (figures are bench/'s): every step reports each bucket once, with its size and
backend; each own time is positive and finite and each report comes after its bucket's
launch; a bucket's own time is its own, not the time from its launch to its report: the
buckets' own intervals do not overlap (a collective's clock starts when the one queued
before it ends), so their sum fits between the start of backward and the step's last
report, which the launch-to-report times (overlapping, all running to ``step()``) exceed;
``exposed`` summed over a step's buckets is above 0 and at most the wall time of
backward + ``step()`` (it counts the blocking header swap inside the gradient hook, which
runs during backward). Runs under mpiexec (MPI) and with torchrun's variables (gloo).
Prints ``OK spmd_comm_timing`` on each rank.
"""

from __future__ import annotations

import math
import statistics
import time

import _spmd

_spmd.setup()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import hvdnb.torch as hvd  # noqa: E402

hvd.init()
torch.set_num_threads(1)
n, r = hvd.size(), hvd.rank()
backend = "mpi" if hvd.mpi_enabled() else "gloo"
#: perf_counter stamps are taken on either side of hvdnb's own: the gap between them
EPS = 1e-4

torch.manual_seed(0)
layers = [nn.Linear(256, 256) for _ in range(6)]
model = nn.Sequential(*[m for lin in layers for m in (lin, nn.Tanh())])
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01),
    named_parameters=model.named_parameters(),
    groups=[[lin.weight, lin.bias] for lin in layers],
)
x = torch.randn(512, 256)

launched: dict[str, float] = {}
# our hook runs after the optimizer's (registration order): the bucket was just launched
first_of_bucket = {
    lin.weight: f"DistributedOptimizer.bucket.{len(layers) - 1 - i}" for i, lin in enumerate(layers)
}
for p, bname in first_of_bucket.items():
    p.register_post_accumulate_grad_hook(
        lambda _p, bname=bname: launched.__setitem__(bname, time.perf_counter())
    )

reports: list[tuple[str, int, float, str, float, float]] = []


def listener(name: str, nbytes: int, seconds: float, be: str, exposed: float) -> None:
    reports.append((name, nbytes, float(seconds), be, exposed, time.perf_counter()))


nbytes = (256 * 256 + 256) * 4
names = {f"DistributedOptimizer.bucket.{i}" for i in range(len(layers))}
hvd.add_comm_listener(listener)
per_bucket: dict[str, list[float]] = {}
lag: dict[str, list[float]] = {}
for step in range(20):
    reports.clear()
    launched.clear()
    opt.zero_grad()
    loss = model(x).square().mean()
    tb = time.perf_counter()
    loss.backward()
    opt.step()
    wall_bs = time.perf_counter() - tb
    buckets = [rep for rep in reports if rep[0].startswith("DistributedOptimizer.bucket.")]
    assert sorted(b[0] for b in buckets) == sorted(names), reports  # each bucket once
    assert all(b[1] == nbytes and b[3] == backend for b in buckets), buckets
    assert all(math.isfinite(b[2]) and b[2] > 0 for b in buckets), buckets
    assert all(b[5] > launched[b[0]] for b in buckets), (buckets, launched)  # report after launch
    # own intervals are disjoint and lie in [start of backward, the bucket's report]
    last = max(b[5] for b in buckets)
    own = sum(b[2] for b in buckets)
    assert own <= last - tb + EPS, (own, last - tb, buckets)
    # exposed = blocking in the gradient hook (during backward) + waiting in step()
    exposed = sum(b[4] for b in buckets)
    assert 0 < exposed <= wall_bs + EPS, (exposed, wall_bs)
    assert all(0 <= b[4] <= wall_bs for b in buckets), buckets
    for b in buckets:
        per_bucket.setdefault(b[0], []).append(b[2])
        lag.setdefault(b[0], []).append(b[5] - launched[b[0]])
hvd.remove_comm_listener(listener)

# figures for the eye (asserting on them is bench/'s job, not a test's)
first = "DistributedOptimizer.bucket.0"
own0, lag0 = statistics.median(per_bucket[first]), statistics.median(lag[first])
print(
    f"{backend}: bucket.0 own {own0 * 1e3:.3f} ms, launch-to-report {lag0 * 1e3:.3f} ms",
    flush=True,
)
print(f"OK spmd_comm_timing rank {r}", flush=True)
