"""Horovod semantics beyond the plain collectives, checked on every rank.

Async ops are matched by name (a rank may queue one before a barrier that another rank
reaches first), a name queued twice is refused, ``poll`` tells the truth, ``join``
serves allreduces with zeros and returns the last rank to join, other collectives fail
on every active rank while a rank has joined, and the deprecated ``average=`` still
works with a warning. Prints ``OK spmd_horovod`` on each rank.
"""

from __future__ import annotations

import warnings

import _spmd

_spmd.setup()

import torch  # noqa: E402

import hvdnb.torch as hvd  # noqa: E402

hvd.init()
n, r = hvd.size(), hvd.rank()

# capability queries answer for this process
assert hvd.is_initialized() and hvd.gloo_built() and not hvd.ccl_built()
assert hvd.nccl_built() == 0 or torch.cuda.is_available()
assert hvd.mpi_enabled() != hvd.gloo_enabled()

# rank 0 queues an op, then every rank meets at a barrier, then the others queue theirs:
# the barrier runs first, the queued op later, matched by its name
t = torch.full((5,), float(r + 1))
if r == 0:
    h = hvd.allreduce_async(t, name="late", op=hvd.Sum)
    assert not hvd.poll(h)  # nothing was sent yet
    try:
        hvd.allreduce_async(t, name="late")
        raise AssertionError("a second op with a queued name was accepted")
    except ValueError as e:
        assert "late" in str(e)
hvd.barrier()
if r != 0:
    h = hvd.allreduce_async(t, name="late", op=hvd.Sum)
assert torch.equal(hvd.synchronize(h), torch.full((5,), n * (n + 1) / 2))

# ranks may queue async ops in different orders: matched by name
a, b = torch.ones(3), torch.full((4,), 2.0)
names = ["x", "y"] if r % 2 else ["y", "x"]
hs = {nm: hvd.allreduce_async(a if nm == "x" else b, name=nm, op=hvd.Sum) for nm in names}
assert torch.equal(hvd.synchronize(hs["x"]), torch.full((3,), float(n)))
assert torch.equal(hvd.synchronize(hs["y"]), torch.full((4,), 2.0 * n))

# a mismatch raises on every rank, and the next collective works (one rank has nobody to
# disagree with: the call is an ordinary one)
try:
    hvd.allreduce(torch.ones(2 + (r == n - 1 and n > 1)), name="bad")
    assert n == 1, "mismatch accepted"
except hvd.CollectiveMismatchError:
    assert n > 1, "one rank saw a mismatch with itself"
assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))

# join: rank 0 joins first; the others' allreduce gets zeros from it (Average divides by n)
if r == 0:
    last = hvd.join()
else:
    got = hvd.allreduce(torch.full((6,), float(n)), name="while_joined")
    assert torch.equal(got, torch.full((6,), float(n - 1))), got
    try:
        hvd.allgather(torch.ones(2), name="gather_while_joined")
        raise AssertionError("allgather with a joined rank accepted")
    except RuntimeError as e:
        assert "join" in str(e)
    last = hvd.join()
assert (last != 0 or n == 1) and hvd.allgather_object(last) == [last] * n  # 0: it was alone

# deprecated average= works, with a DeprecationWarning
with warnings.catch_warnings(record=True) as ws:
    warnings.simplefilter("always")
    s = hvd.allreduce(torch.ones(3), average=False)
assert torch.equal(s, torch.full((3,), float(n)))
assert any(issubclass(w.category, DeprecationWarning) for w in ws)

# grouped allgather / reducescatter, sparse allreduce
g = hvd.grouped_allgather([torch.full((1, 2), float(r)), torch.full((2,), float(r))])
assert g[0].shape == (n, 2) and g[1].shape == (2 * n,)
rs = hvd.grouped_reducescatter([torch.ones(2 * n, 3)], op=hvd.Sum)
assert torch.equal(rs[0], torch.full((2, 3), float(n)))
dense = torch.zeros(4, 3)
dense[r % 4] = 1.0
out = hvd.sparse_allreduce_async(dense.to_sparse(), name="sp", op=hvd.Sum)()
assert torch.equal(out.to_dense(), hvd.allreduce(dense, op=hvd.Sum))
print(f"OK spmd_horovod rank {r}", flush=True)
