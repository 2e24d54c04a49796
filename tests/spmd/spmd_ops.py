"""Every collective x every dtype, checked against size() on every rank.

Run under ``mpiexec -n N`` (MPI transport) or with torchrun-style variables (gloo).
Prints ``OK spmd_ops`` on each rank when every check passed.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import _spmd

_spmd.setup()

import torch  # noqa: E402

import hvdnb.torch as hvd  # noqa: E402

hvd.init()
n, r = hvd.size(), hvd.rank()
DTYPES = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]
# small shapes ride inline with the header (2 ranks, MPI); 70000 elements take the large path
SHAPES = [(), (17,), (3, 5), (70000,)]


def full(shape: tuple[int, ...], v: float, dt: torch.dtype) -> torch.Tensor:
    return torch.full(shape, v, dtype=dt)


def eq(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    )
    assert torch.equal(a, b), (
        f"{what}: got {a.flatten()[:4].tolist()} expected {b.flatten()[:4].tolist()}"
    )


total = n * (n + 1) // 2
for dt in DTYPES:
    is_float = dt.is_floating_point
    for shape in SHAPES:
        x = full(shape, r + 1, dt)
        tag = f"{dt} {shape}"
        eq(hvd.allreduce(x, op=hvd.Sum), full(shape, total, dt), f"sum {tag}")
        avg = total / n if is_float else math.trunc(total / n)
        eq(hvd.allreduce(x), full(shape, avg, dt), f"average {tag}")
        eq(hvd.allreduce(x, op=hvd.Min), full(shape, 1, dt), f"min {tag}")
        eq(hvd.allreduce(x, op=hvd.Max), full(shape, n, dt), f"max {tag}")
        eq(hvd.allreduce(x, op=hvd.Product), full(shape, math.factorial(n), dt), f"prod {tag}")
        eq(x, full(shape, r + 1, dt), f"input untouched {tag}")
        if is_float:
            got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
            eq(got, full(shape, total / 2, dt), f"scaled {tag}")
        for rep in range(2):  # named calls are planned once, then replayed
            eq(hvd.allreduce(x, name=f"p.{dt}.{shape}"), full(shape, avg, dt), f"named avg {tag}")
            yy = x.clone()
            hvd.allreduce_(yy, op=hvd.Max, name=f"p_.{dt}.{shape}")
            eq(yy, full(shape, n, dt), f"named allreduce_ {tag}")
            if is_float:
                eq(
                    hvd.allreduce(x, op=hvd.Sum, name=f"ps.{dt}.{shape}", postscale_factor=0.5),
                    full(shape, total / 2, dt),
                    f"named scaled {tag}",
                )
        for op, want in (
            (hvd.Sum, total),
            (hvd.Min, 1),
            (hvd.Max, n),
            (hvd.Product, math.factorial(n)),
        ):
            for rep in range(2):  # every op on the planned paths, in place and not
                yy = x.clone()
                assert hvd.allreduce_(yy, op=op, name=f"o_.{op}.{dt}.{shape}") is yy
                eq(yy, full(shape, want, dt), f"named allreduce_ op {op} {tag}")
                eq(
                    hvd.allreduce(x, op=op, name=f"o.{op}.{dt}.{shape}"),
                    full(shape, want, dt),
                    f"named allreduce op {op} {tag}",
                )
        y = x.clone()
        assert hvd.allreduce_(y, op=hvd.Sum) is y
        eq(y, full(shape, total, dt), f"allreduce_ {tag}")
        h = hvd.allreduce_async(x, op=hvd.Max)
        hvd.poll(h)
        eq(hvd.synchronize(h), full(shape, n, dt), f"async {tag}")
        z = x.clone()
        h = hvd.allreduce_async_(z, op=hvd.Sum)
        hvd.synchronize(h)
        eq(z, full(shape, total, dt), f"async_ {tag}")
        # broadcast from the last rank, out of place and in place
        eq(hvd.broadcast(x, root_rank=n - 1), full(shape, n, dt), f"broadcast {tag}")
        b = x.clone()
        hvd.broadcast_(b, root_rank=0)
        eq(b, full(shape, 1, dt), f"broadcast_ {tag}")
    # allgather with a different first dimension on every rank
    g = hvd.allgather(full((r + 1, 3), r, dt))
    expect = torch.cat([full((k + 1, 3), k, dt) for k in range(n)])
    eq(g, expect, f"allgather {dt}")
    eq(
        hvd.synchronize(hvd.allgather_async(full((2,), r, dt))),
        torch.cat([full((2,), k, dt) for k in range(n)]),
        f"allgather_async {dt}",
    )
    # alltoall: rank r sends k+1 rows of value 10*r+k to rank k
    send = torch.cat([full((k + 1, 2), 10 * r + k, dt) for k in range(n)])
    out, rsplits = hvd.alltoall(send, splits=[k + 1 for k in range(n)])
    eq(out, torch.cat([full((r + 1, 2), 10 * k + r, dt) for k in range(n)]), f"alltoall {dt}")
    assert rsplits.tolist() == [r + 1] * n, rsplits
    eq(
        hvd.alltoall(full((2 * n,), r, dt)),
        torch.cat([full((2,), k, dt) for k in range(n)]),
        f"alltoall even {dt}",
    )
    # reducescatter: 2n+1 rows; the first rank gets one more
    rs = hvd.reducescatter(full((2 * n + 1, 2), r + 1, dt), op=hvd.Sum)
    rows = 2 + (1 if r < 1 else 0)
    eq(rs, full((rows, 2), total, dt), f"reducescatter {dt}")

# grouped allreduce: mixed shapes and dtypes, named, in place and async
ts = [
    full((3,), r + 1, torch.float32),
    full((2, 2), r + 1, torch.int32),
    full((), r, torch.float64),
]
out = hvd.grouped_allreduce(ts, op=hvd.Sum, name="grouped")
eq(out[0], full((3,), total, torch.float32), "grouped 0")
eq(out[1], full((2, 2), total, torch.int32), "grouped 1")
eq(out[2], full((), total - n, torch.float64), "grouped 2")
hvd.grouped_allreduce_(ts, op=hvd.Max)
eq(ts[1], full((2, 2), n, torch.int32), "grouped_ in place")
res = hvd.synchronize(hvd.grouped_allreduce_async([full((4,), 1.0, torch.float32)], op=hvd.Sum))
eq(res[0], full((4,), float(n), torch.float32), "grouped async")

# non-contiguous input, compression, autograd
nc = torch.arange(6, dtype=torch.float32).view(2, 3).t() * (r + 1)
eq(
    hvd.allreduce(nc, op=hvd.Sum),
    torch.arange(6, dtype=torch.float32).view(2, 3).t() * total,
    "non-contiguous",
)
c = hvd.allreduce(torch.full((5,), 1.5 * (r + 1)), compression=hvd.Compression.fp16, op=hvd.Sum)
assert c.dtype == torch.float32 and torch.allclose(c, torch.full((5,), 1.5 * total)), c
w = torch.full((4,), float(r + 1), requires_grad=True)
(hvd.allreduce(w, op=hvd.Sum) * 2).sum().backward()
eq(w.grad, torch.full((4,), 2.0 * n), "allreduce gradient")
w2 = torch.full((2,), float(r), requires_grad=True)
(hvd.allgather(w2) ** 2).sum().backward()
# Horovod averages the gradient over ranks (every rank holds the whole output)
eq(w2.grad, torch.full((2,), 2.0 * r), "allgather gradient")

# objects, barrier, join
got = hvd.broadcast_object({"a": r, "s": "x" * (r + 1)}, root_rank=n - 1)
assert got == {"a": n - 1, "s": "x" * n}, got
assert hvd.allgather_object((r, "y" * r)) == [(k, "y" * k) for k in range(n)]
hvd.barrier()
assert 0 <= hvd.join() < n

# process sets: {0} alone, and every rank but the last
if n == 1:  # {0} is the global set at one rank: Horovod refuses a second set of the same ranks
    try:
        hvd.add_process_set([0])
        raise AssertionError("a duplicate of the global process set was accepted")
    except ValueError as e:
        assert "exists already" in str(e), e
solo = hvd.add_process_set([0]) if n > 1 else None
if solo is None:
    pass
elif r == 0:
    eq(
        hvd.allreduce(full((3,), 5.0, torch.float32), op=hvd.Sum, process_set=solo),
        full((3,), 5.0, torch.float32),
        "process set {0}",
    )
else:
    try:
        hvd.allreduce(full((3,), 5.0, torch.float32), process_set=solo)
        raise AssertionError("a non-member ran a process set's collective")
    except ValueError as e:
        assert "not a member" in str(e), e
if solo is not None:
    assert hvd.remove_process_set(solo) and not hvd.remove_process_set(solo)
if n > 2:
    ps = hvd.add_process_set(list(range(n - 1)))
    if r < n - 1:
        eq(
            hvd.allreduce(full((2,), 1.0, torch.float32), op=hvd.Sum, process_set=ps),
            full((2,), float(n - 1), torch.float32),
            "process set",
        )
assert hvd.global_process_set.size() == n and hvd.global_process_set.rank() == r

# timing hook and timeline
seen = []
listener = hvd.add_comm_listener(lambda *a: seen.append(a))
hvd.allreduce(full((1000,), 1.0, torch.float32), name="listened")
assert hvd.remove_comm_listener(listener)
assert seen and seen[-1][0] == "listened" and seen[-1][1] == 4000 and seen[-1][2] > 0, seen
assert seen[-1][3] in ("mpi", "gloo"), seen
print(f"backend {seen[-1][3]}", flush=True)
tmp = Path(hvd.broadcast_object(tempfile.mkdtemp() if r == 0 else None, 0))
hvd.start_timeline(tmp / "tl.json")
for i in range(5):
    hvd.allreduce(full((10,), 1.0, torch.float32), name=f"tl.{i}")
merged = hvd.stop_timeline()
if r == 0:
    events = json.loads(merged.read_text())
    names = [e["name"] for e in events if e.get("ph") == "X"]
    assert sum(nm == "tl.3" for nm in names) == n, names
    assert {e["pid"] for e in events} == set(range(n))
print(f"OK spmd_ops rank {r}", flush=True)
