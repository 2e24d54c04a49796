"""Ranks that disagree raise CollectiveMismatchError on every rank, never hang.

Each case makes rank 0 and the other ranks call a collective with different arguments;
every rank must raise a clear error (no hang, no corrupt result) and the next collective
must work. Prints ``OK spmd_errors`` on each rank.
"""

from __future__ import annotations

import _spmd

_spmd.setup()

import torch  # noqa: E402

import hvdnb.torch as hvd  # noqa: E402

hvd.init()
n, r = hvd.size(), hvd.rank()
odd = r != 0  # every rank but 0 disagrees with rank 0

CASES = {
    # case: (call, words the message must contain)
    "shape": (lambda: hvd.allreduce(torch.ones(3 + odd), name="s"), ["shape", "(3,)", "(4,)"]),
    "shape, large path": (lambda: hvd.allreduce(torch.ones(100_000 + odd), name="L"), ["shape"]),
    "inline vs large": (
        lambda: hvd.allreduce(torch.ones(10 if odd else 100_000), name="m"),
        ["shape"],
    ),
    "dtype": (
        lambda: hvd.allreduce(
            torch.ones(3, dtype=torch.float64 if odd else torch.float32), name="d"
        ),
        ["dtype", "float64"],
    ),
    "op": (
        lambda: hvd.allreduce(torch.ones(3), name="o", op=hvd.Max if odd else hvd.Sum),
        ["op", "Max", "Sum"],
    ),
    "root": (lambda: hvd.broadcast(torch.ones(3), root_rank=int(odd), name="b"), ["root_rank"]),
    "name": (lambda: hvd.allreduce(torch.ones(3), name=f"n{int(odd)}"), ["name", "n0", "n1"]),
    "collective": (
        lambda: hvd.allgather(torch.ones(3)) if odd else hvd.allreduce(torch.ones(3)),
        ["collective", "allgather", "allreduce"],
    ),
    "allgather trailing": (
        lambda: hvd.allgather(torch.ones(2, 3 + odd), name="g"),
        ["trailing_shape"],
    ),
    "broadcast_parameters": (
        lambda: hvd.broadcast_parameters({"w": torch.ones(2 + odd)}, root_rank=0),
        ["shape"],
    ),
}

for case, (call, words) in CASES.items():
    if n == 1:  # nobody to disagree with: each call is an ordinary one and must succeed
        call()
        continue
    try:  # a call that hangs instead is ended by the hang guard (_spmd.setup): a failure
        call()
    except hvd.CollectiveMismatchError as e:
        msg = str(e)
        for w in words + ["every rank must"]:
            assert w.lower() in msg.lower(), f"{case}: {w!r} not in {msg!r}"
    else:
        raise AssertionError(f"{case}: no error on rank {r}")
    # the job is still usable
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))

# Horovod lets one rank call allreduce_async and another allreduce for the same tensor
for numel in (10, 100_000):
    t = torch.ones(numel)
    got = (
        hvd.synchronize(hvd.allreduce_async(t, name=f"mix{numel}", op=hvd.Sum))
        if odd
        else hvd.allreduce(t, name=f"mix{numel}", op=hvd.Sum)
    )
    assert torch.equal(got, torch.full((numel,), float(n))), f"sync/async mix at {numel}"
    # in place too, on the planned path of rank 0 (which may block only when all can)
    t = torch.ones(numel)
    for rep in range(2):
        t.fill_(1.0)
        if odd:
            hvd.synchronize(hvd.allreduce_async_(t, name=f"mix_{numel}", op=hvd.Sum))
        else:
            hvd.allreduce_(t, name=f"mix_{numel}", op=hvd.Sum)
        assert torch.equal(t, torch.full((numel,), float(n))), f"in-place mix at {numel}"

# a wrong root everywhere (agreed, but outside the set) raises ValueError everywhere
try:
    hvd.broadcast(torch.ones(1), root_rank=n, name="bad root")
    raise AssertionError("root outside the process set accepted")
except ValueError as e:
    assert "outside" in str(e)
# Adasum: equal vectors combine to themselves; a non-power-of-two set refuses on every rank
if n & (n - 1) == 0:
    v = torch.arange(4.0) + 1
    assert torch.allclose(hvd.allreduce(v, op=hvd.Adasum), v)
    # orthogonal vectors add up (Adasum's point: no double counting of shared directions)
    e = torch.zeros(n * 2)
    e[r] = 1.0
    assert torch.allclose(hvd.allreduce(e, op=hvd.Adasum), (torch.arange(n * 2) < n).float())
else:
    try:
        hvd.allreduce(torch.ones(4), op=hvd.Adasum)
        raise AssertionError("Adasum on a non-power-of-two set accepted")
    except NotImplementedError as e:
        assert "power-of-two" in str(e)
hvd.barrier()
print(f"OK spmd_errors rank {r}", flush=True)
