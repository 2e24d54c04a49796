"""DistributedOptimizer, broadcast_parameters / optimizer state, SyncBatchNorm, lr rules.

Checks on every rank: N ranks with batch B each train exactly like one process with
batch N*B; differently initialised models become identical after broadcast_parameters;
SyncBatchNorm matches BatchNorm over the global batch. Prints ``OK spmd_optimizer``.
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
B = 8


def model() -> nn.Module:
    # 20x1024 weights = 80 KB: above the inline size, so the large (nonblocking) path runs too
    return nn.Sequential(
        nn.Linear(20, 1024), nn.Tanh(), nn.Linear(1024, 16), nn.ReLU(), nn.Linear(16, 3)
    )


def flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


# broadcast_parameters: different seeds, identical after
torch.manual_seed(100 + r)
net = model()
before = hvd.allgather(flat(net)[None])
assert n == 1 or not torch.equal(before[0], before[-1]), "seeds gave equal models"
hvd.broadcast_parameters(net.state_dict(), root_rank=0)
everyone = hvd.allgather(flat(net)[None])
assert all(torch.equal(everyone[k], everyone[0]) for k in range(n)), "parameters differ"

torch.manual_seed(0)
X, Y = torch.randn(6, n * B, 20), torch.randint(0, 3, (6, n * B))
mine = slice(r * B, (r + 1) * B)
VARIANTS = [
    ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1), {}, 1e-5),
    (
        "momentum, small buckets",
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        {"HVDNB_FUSION_THRESHOLD": "4096"},
        1e-5,
    ),
    ("adam, predivide", lambda ps: torch.optim.Adam(ps, lr=1e-3), {}, 1e-4),
    ("fp16 compression", lambda ps: torch.optim.SGD(ps, lr=0.1), {}, 2e-3),
    ("two groups", lambda ps: torch.optim.SGD(ps, lr=0.1), {}, 1e-5),
]
for label, make, env, tol in VARIANTS:
    os.environ.update(env)
    torch.manual_seed(1)
    ref = model()
    dist_net = copy.deepcopy(ref)
    ref_opt = make(ref.parameters())
    kw: dict = {"named_parameters": dist_net.named_parameters()}
    if "predivide" in label:
        kw["gradient_predivide_factor"] = 2.0
    if "fp16" in label:
        kw["compression"] = hvd.Compression.fp16
    if "groups" in label:
        kw["groups"] = 2
    opt = hvd.DistributedOptimizer(make(dist_net.parameters()), **kw)
    assert isinstance(opt, type(ref_opt)), type(opt).__mro__
    for step in range(len(X)):
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(X[step]), Y[step]).backward()
        ref_opt.step()
        opt.zero_grad()
        nn.functional.cross_entropy(dist_net(X[step][mine]), Y[step][mine]).backward()
        opt.step()
    err = (flat(ref) - flat(dist_net)).abs().max().item()
    assert err < tol, f"{label}: max |single - distributed| = {err:.2e} > {tol}"
    for k in env:
        del os.environ[k]

# backward_passes_per_step=2: two half batches per rank == one full batch per rank
torch.manual_seed(1)
ref = model()
dist_net = copy.deepcopy(ref)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(dist_net.parameters(), lr=0.1), backward_passes_per_step=2
)
for step in range(3):
    ref_opt.zero_grad()
    nn.functional.cross_entropy(ref(X[step]), Y[step]).backward()
    ref_opt.step()
    opt.zero_grad()
    for half in range(2):
        rows = slice(r * B + half * B // 2, r * B + (half + 1) * B // 2)
        (nn.functional.cross_entropy(dist_net(X[step][rows]), Y[step][rows]) / 2).backward()
    opt.step()
assert (flat(ref) - flat(dist_net)).abs().max() < 1e-5

# the timing hook sees every fused bucket, once per step
seen: list = []
listener = hvd.add_comm_listener(lambda *a: seen.append(a))
opt = hvd.DistributedOptimizer(torch.optim.SGD(dist_net.parameters(), lr=0.1))
opt.zero_grad()
dist_net(X[0][mine]).sum().backward()
opt.step()
hvd.remove_comm_listener(listener)
nbytes = sum(p.numel() * 4 for p in dist_net.parameters())
assert [(a[0], a[1]) for a in seen] == [("DistributedOptimizer.bucket.0", nbytes)], seen

# zero_grad between backward and step is refused, as in Horovod
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(dist_net.parameters(), lr=0.1), backward_passes_per_step=2
)
opt.zero_grad()
for half in range(2):
    dist_net(X[0][mine]).sum().backward()
try:
    opt.zero_grad()
    raise AssertionError("zero_grad with pending allreduces accepted")
except AssertionError as e:
    assert "before optimizer.step()" in str(e), e
opt.synchronize()

# broadcast_optimizer_state: Adam state of rank 0 everywhere
torch.manual_seed(5)
net = model()
hvd.broadcast_parameters(net.state_dict(), 0)
adam = torch.optim.Adam(net.parameters(), lr=1e-3 * (r + 1))
for _ in range(r + 1):
    net(X[0]).sum().backward()
    adam.step()
hvd.broadcast_optimizer_state(adam, root_rank=0)
assert adam.param_groups[0]["lr"] == 1e-3
steps = hvd.allgather(torch.tensor([float(adam.state[net[0].weight]["step"])]))
assert steps.tolist() == [1.0] * n, steps

# SyncBatchNorm == BatchNorm1d over the global batch (outputs, input grads, running stats)
torch.manual_seed(2)
xs = torch.randn(n * B, 4, 3) * 3 + 1
bn = nn.BatchNorm1d(4)
sbn = hvd.SyncBatchNorm(4)
xg = xs.clone().requires_grad_()
ref_out = bn(xg)
(ref_out**3).sum().backward()
xl = xs[mine].clone().requires_grad_()
yl = sbn(xl)
(yl**3).sum().backward()
assert torch.allclose(yl, ref_out[mine], atol=1e-4), "SyncBatchNorm output"
assert torch.allclose(xl.grad, xg.grad[mine], atol=1e-3), (xl.grad - xg.grad[mine]).abs().max()
assert torch.allclose(sbn.running_mean, bn.running_mean, atol=1e-5)
assert torch.allclose(sbn.running_var, bn.running_var, atol=1e-4), (sbn.running_var, bn.running_var)
wg = hvd.allreduce(sbn.weight.grad, op=hvd.Sum)
assert torch.allclose(wg, bn.weight.grad, rtol=1e-3, atol=1e-3), (wg, bn.weight.grad)
conv = hvd.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4)))
assert isinstance(conv[1], hvd.SyncBatchNorm)

# lr rules use size()
assert hvd.scale_lr(0.1) == 0.1 * n
sgd = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=hvd.scale_lr(0.1))
sched = hvd.LinearWarmup(sgd, warmup_steps=4)
lrs = []
for _ in range(6):
    lrs.append(sgd.param_groups[0]["lr"])
    sgd.step()
    sched.step()
assert abs(lrs[0] - 0.1) < 1e-9 and abs(lrs[4] - 0.1 * n) < 1e-9 and lrs == sorted(lrs), lrs
print(f"OK spmd_optimizer rank {r}", flush=True)
