"""DistributedOptimizer(op=hvd.Adasum): Horovod's delta optimizer against Adasum's formula.

Every rank steps on its own batch. Each check rebuilds the expected parameters from every
rank's local delta (a plain optimizer with the same state takes the same local step; the
deltas are gathered) with Adasum's formula for two vectors,
``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b``, applied per parameter in the tree order
hvdnb and Horovod use (pairs at distance 1, 2, 4, ...: ``((0, 1), (2, 3))`` for four ranks).
Variants: SGD with momentum, Adam, ``backward_passes_per_step=2``, fp16 compression of the
deltas; Horovod's errors. A size that is not a power of two must raise Horovod's
NotImplementedError on every rank, and the job must go on working. Prints
``OK spmd_adasum``.
"""

from __future__ import annotations

import copy

import _spmd

_spmd.setup()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import hvdnb.torch as hvd  # noqa: E402

hvd.init()
n, r = hvd.size(), hvd.rank()
HOROVOD_POW2 = "Running Adasum with non-power of 2 ranks is not supported yet."
B = 6


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 5))


def raises(kind: type[BaseException], text: str, fn) -> None:
    try:
        fn()
    except kind as e:
        assert text in str(e), f"{kind.__name__} without {text!r}: {e}"
        return
    raise RuntimeError(f"no {kind.__name__} ({text!r})")


def adasum(vs: list[torch.Tensor]) -> torch.Tensor:
    """Adasum's formula in float64, pairs at distance 1, 2, 4, ..."""
    v = [x.double().reshape(-1) for x in vs]
    d = 1
    while d < len(v):
        for i in range(0, len(v), 2 * d):
            a, b = v[i], v[i + d]
            dot = a @ b
            v[i] = (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b
        d *= 2
    return v[0]


def check(label: str, make, bpps: int = 1, fp16: bool = False, steps: int = 3) -> None:
    torch.manual_seed(7)  # the same start on every rank
    net = model()
    local = copy.deepcopy(net)
    local_opt = make(local.parameters())
    kw: dict = {"named_parameters": net.named_parameters(), "op": hvd.Adasum}
    if bpps != 1:
        kw["backward_passes_per_step"] = bpps
    if fp16:
        kw["compression"] = hvd.Compression.fp16
    opt = hvd.DistributedOptimizer(make(net.parameters()), **kw)
    assert isinstance(opt, type(local_opt)), type(opt).__mro__
    g = torch.Generator().manual_seed(1000 * r + 11)  # each rank its own data
    for step in range(steps):
        before = [p.detach().clone() for p in net.parameters()]
        # the reference's local step: same parameters, same optimizer state, same data
        local.load_state_dict(net.state_dict())
        local_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        opt.zero_grad()
        local_opt.zero_grad()
        for _ in range(bpps):
            x, y = torch.randn(B, 12, generator=g), torch.randint(0, 5, (B,), generator=g)
            nn.functional.cross_entropy(net(x), y).backward()
            nn.functional.cross_entropy(local(x), y).backward()
        if fp16 and n == 1:  # the plain wrapper's step sees fp16-rounded gradients
            for q in local.parameters():
                q.grad = q.grad.half().float()
        local_opt.step()
        grads = [p.grad.clone() for p in net.parameters()]
        seen: list = []
        listener = hvd.add_comm_listener(lambda *a: seen.append(a[:2]))
        opt.step()
        hvd.remove_comm_listener(listener)
        # one Adasum allreduce per parameter (per-layer coefficients), fp16 deltas on the wire
        expect = [
            (f"DistributedOptimizer.adasum.{nm}", p.numel() * (2 if fp16 else 4))
            for nm, p in net.named_parameters()
        ]
        assert n == 1 or seen == expect, f"{label}: {seen} != {expect}"
        # gradients and optimizer state stay local (Horovod's delta optimizer). One rank gets
        # Horovod's plain wrapper (Adasum of one vector is itself): it compresses the
        # gradients, not the deltas, so there fp16 rounds them
        if fp16 and n == 1:
            grads = [b.half().float() for b in grads]
        assert all(torch.equal(a.grad, b) for a, b in zip(net.parameters(), grads)), label
        for (k, sa), sb in zip(opt.state.items(), local_opt.state.values()):
            for key in sa:
                assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), (
                    f"{label}: optimizer state {key} is not the local one"
                )
        for i, (p, p0, q) in enumerate(zip(net.parameters(), before, local.parameters())):
            delta = (q.detach() - p0).reshape(-1)
            if fp16:
                delta = delta.half().float()
            every = hvd.allgather(delta[None], name=f"{label}.ref.{step}.{i}")
            ref = adasum(list(every))
            got = (p.detach().double() - p0.double()).reshape(-1)
            scale = ref.abs().max().item()
            tol = 1e-3 * scale + 1e-6 if fp16 else 1e-5 * scale + 1e-7
            err = (got - ref).abs().max().item()
            assert err <= tol, (
                f"{label} step {step} param {i}: |got - adasum| = {err:.3g} > {tol:.3g}"
            )
            if n > 1 and i == 0:
                mean = every.double().mean(0)
                assert (got - mean).abs().max().item() > 10 * tol, f"{label}: equals the mean"
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        every = hvd.allgather(flat[None], name=f"{label}.same.{step}")
        assert all(torch.equal(every[k], every[0]) for k in range(n)), f"{label}: ranks differ"


if n & (n - 1):
    # Horovod's error on every rank, before any collective: nobody is left waiting
    net = model()
    raises(
        NotImplementedError,
        HOROVOD_POW2,
        lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1),
            named_parameters=net.named_parameters(),
            op=hvd.Adasum,
        ),
    )
    # and the job goes on: a plain optimizer and a collective still work
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    net(torch.randn(4, 12)).sum().backward()
    opt.step()
    assert hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist() == [float(n)] * 3
else:
    check("sgd momentum", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    check("adam", lambda ps: torch.optim.Adam(ps, lr=1e-2))
    check("two passes per step", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5), bpps=2)
    check("fp16 deltas", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), fp16=True)

    # Horovod's errors around the delta optimizer
    net = model()
    sgd = lambda: torch.optim.SGD(net.parameters(), lr=0.1)
    if n > 1:
        solo = hvd.add_process_set([0])
        raises(
            NotImplementedError,
            "non-global process sets",
            lambda: hvd.DistributedOptimizer(sgd(), op=hvd.Adasum, process_set=solo),
        )
        hvd.remove_process_set(solo)
    raises(
        ValueError,
        "gradient_predivide_factor",
        lambda: hvd.DistributedOptimizer(sgd(), op=hvd.Adasum, gradient_predivide_factor=2.0),
    )
    if n > 1:
        raises(
            ValueError,
            "backward_passes_per_step must be > 0",
            lambda: hvd.DistributedOptimizer(sgd(), op=hvd.Adasum, backward_passes_per_step=0),
        )
        opt = hvd.DistributedOptimizer(sgd(), op=hvd.Adasum, backward_passes_per_step=2)
        x = torch.randn(4, 12)
        net(x).sum().backward()
        opt.zero_grad()  # one pass of two: allowed
        net(x).sum().backward()
        raises(AssertionError, "before optimizer.step()", opt.zero_grad)
        raises(AssertionError, "more than backward_passes_per_step", net(x).sum().backward)
        raises(
            AssertionError, "Skipping synchronization", lambda: opt.skip_synchronize().__enter__()
        )
        opt.synchronize()  # a no-op, as in Horovod
        opt.step()  # every rank, together: the counts start again
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()

print(f"OK spmd_adasum (rank {r} of {n})", flush=True)
