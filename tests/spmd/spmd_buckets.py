"""DistributedOptimizer's buckets on CPU under MPI: at most 4 MB unless HVDNB_FUSION_THRESHOLD.

Checks on every rank: a model with 12.6 MB of gradients (three 4 MB weights, a 5 MB one, small
biases) is planned in buckets of at most 4 MB (a 5 MB weight alone in its own), the same on
every rank; the averaged gradients written back from every bucket equal the full batch's
gradients computed in one process; with ``HVDNB_FUSION_THRESHOLD`` set the threshold is
honoured as given (one 64 MB bucket). Prints ``OK spmd_buckets``.
"""

from __future__ import annotations

import copy
import os

import _spmd

_spmd.setup()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import hvdnb.torch as hvd  # noqa: E402

hvd.init()
n, r = hvd.size(), hvd.rank()
B = 4
MB = 1024 * 1024


def model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Linear(1024, 1024),  # 4 MB weight
        nn.Tanh(),
        nn.Linear(1024, 1024),
        nn.Tanh(),
        nn.Linear(1024, 1280),  # 5 MB weight: larger than the cap, alone in its bucket
        nn.Tanh(),
        nn.Linear(1280, 819),  # ~4 MB weight
        nn.Tanh(),
        nn.Linear(819, 3),
    )


torch.manual_seed(0)
X, Y = torch.randn(n * B, 1024), torch.randint(0, 3, (n * B,))
mine = slice(r * B, (r + 1) * B)
loss_fn = nn.CrossEntropyLoss()

ref = model()
loss_fn(ref(X), Y).backward()

os.environ.pop("HVDNB_FUSION_THRESHOLD", None)
net = model()
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters()
)
sizes = [sum(p.numel() * p.element_size() for p in b.params) for b in opt._hvd_buckets]
total = sum(p.numel() * 4 for p in net.parameters())
assert len(sizes) >= 4, f"{total} bytes of gradients planned as {sizes}: expected >= 4 buckets"
big = [s for s in sizes if s > 4 * MB]
assert big == [1024 * 1280 * 4], f"only the 5 MB weight may exceed 4 MB alone: {sizes}"
assert all(len(b.params) == 1 for b in opt._hvd_buckets if b.params[0].numel() == 1024 * 1280)
everyone = hvd.allgather_object(sizes)
assert all(s == sizes for s in everyone), f"ranks planned different buckets: {everyone}"

loss_fn(net(X[mine]), Y[mine]).backward()
opt.synchronize()
for (name, p), q in zip(net.named_parameters(), ref.parameters()):
    assert p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-6), name

os.environ["HVDNB_FUSION_THRESHOLD"] = str(64 * MB)
net2 = copy.deepcopy(ref)
opt2 = hvd.DistributedOptimizer(
    torch.optim.SGD(net2.parameters(), lr=0.1), named_parameters=net2.named_parameters()
)
assert len(opt2._hvd_buckets) == 1, f"HVDNB_FUSION_THRESHOLD ignored: {len(opt2._hvd_buckets)}"
del os.environ["HVDNB_FUSION_THRESHOLD"]
print(f"OK spmd_buckets rank {r}: buckets {sizes}", flush=True)
