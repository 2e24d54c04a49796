"""Repeated named allreduces (no header round: the check travels with the data), and every
way ranks can fall out of step under a name that was seen before.

Each disagreement must raise the same clear ``CollectiveMismatchError`` on every rank
(never hang: a rank stuck past the hang guard fails the run), leave an in-place tensor as
it was, and leave the group usable (the next allreduce gives the right sum). Meant for 3
and 4 ranks (the butterfly: an odd rank folded into a partner, and recursive doubling),
and passes on 2 (one message with the header) and without MPI (gloo). Prints
``OK spmd_cache`` on each rank.
"""

from __future__ import annotations

from collections.abc import Callable

import _spmd

_spmd.setup()

import torch  # noqa: E402

import hvdnb.torch as hvd  # noqa: E402

hvd.init()
n, r = hvd.size(), hvd.rank()
odd = r != 0  # every rank but 0 disagrees with rank 0
TOTAL = n * (n + 1) // 2  # the sum of (rank + 1)
SMALL, LARGE = 1000, 70_000  # 4 KB: data and check in one round; 280 KB: check, then MPI


def usable() -> None:
    """The group still works: a fresh allreduce and a cached one give the right sums."""
    got = hvd.allreduce(torch.full((5,), float(r + 1)), op=hvd.Sum)
    assert torch.equal(got, torch.full((5,), float(TOTAL))), got
    t = torch.full((7,), float(r + 1))
    hvd.allreduce_(t, op=hvd.Sum, name="usable")
    assert torch.equal(t, torch.full((7,), float(TOTAL))), t


def raises(case: str, call: Callable[[], object], words: list[str]) -> None:
    """``call`` raises CollectiveMismatchError naming ``words`` on this rank (one rank has
    nobody to disagree with: there the call must simply succeed). A call that hangs instead
    is ended by the script's hang guard (``_spmd.setup``), which fails the run."""
    if n == 1:
        call()
        usable()
        return
    msg = ""
    try:
        call()
    except hvd.CollectiveMismatchError as e:
        msg = str(e)
    assert msg, f"{case}: no error on rank {r}"
    for w in [*words, "every rank must"]:
        assert w.lower() in msg.lower(), f"{case}: {w!r} not in {msg!r}"
    # the same diagnosis on every rank (the call it names is each rank's own)
    what = msg.split("ranks disagree: ", 1)[-1]
    assert hvd.allgather_object(what) == [what] * n, f"{case}: ranks differ: {what!r}"
    usable()


# -- repeated names: the right result every time, the same bits on every rank -------------
for numel in (1, SMALL, 16384, LARGE):
    for dt in (torch.float32, torch.float64, torch.int32, torch.int64):
        x = torch.full((numel,), r + 1, dtype=dt)
        y = x.clone()
        for rep in range(4):
            y.copy_(x)
            hvd.allreduce_(y, op=hvd.Sum, name=f"rep.{numel}.{dt}")
            assert torch.equal(y, torch.full_like(x, TOTAL)), (numel, dt, rep, y[:3])
            got = hvd.allreduce(x, op=hvd.Max, name=f"oop.{numel}.{dt}")
            assert torch.equal(got, torch.full_like(x, n)) and torch.equal(x, y.fill_(r + 1))
avg = torch.randn(3, 333, generator=torch.Generator().manual_seed(r))
mine = avg.clone()
for rep in range(3):
    a = hvd.allreduce(mine, name="avg")  # Average divides: correctly rounded
    assert torch.allclose(a, hvd.allgather(mine.unsqueeze(0)).mean(0), atol=1e-6)
    assert a.shape == (3, 333) and torch.equal(mine, avg)
    every = hvd.allgather_object(a.numpy().tobytes())
    assert all(b == every[0] for b in every), "ranks got different bits"
g = torch.ones(SMALL, requires_grad=True)  # a parameter: numpy needs it detached
got = hvd.synchronize(hvd.allreduce_async(g, op=hvd.Sum, name="grad"))
assert torch.equal(got.detach(), torch.full((SMALL,), float(n)))
with torch.no_grad():
    for rep in range(2):
        hvd.allreduce_(g, op=hvd.Average, name="grad_")
assert torch.equal(g.detach(), torch.ones(SMALL))
for rep in range(2):  # no data: the round carries the check alone
    assert hvd.allreduce(torch.ones(0), op=hvd.Sum, name="empty").shape == (0,)
    assert hvd.allreduce(torch.ones(0, 3), op=hvd.Sum).shape == (0, 3)
z = torch.tensor(float(r + 1))  # a 0-d tensor
for rep in range(2):
    assert hvd.allreduce(z, op=hvd.Sum, name="scalar").shape == ()
    assert hvd.allreduce(z, op=hvd.Sum, name="scalar").item() == TOTAL

# -- the same name, another shape or dtype (small: one round; large: check round) ----------
for numel in (SMALL, LARGE):
    t = torch.full((numel,), float(r + 1))
    for rep in range(2):  # cached now
        hvd.allreduce_(t.fill_(r + 1), op=hvd.Sum, name=f"shape{numel}")
    t.fill_(r + 1)
    u = torch.full((numel + odd,), float(r + 1))
    raises(
        f"shape {numel}",
        lambda: hvd.allreduce_(u, op=hvd.Sum, name=f"shape{numel}"),
        ["shape"],
    )
    assert torch.equal(u, torch.full_like(u, r + 1)), "a failed allreduce_ wrote its tensor"
    # the name is still good with the agreed shape
    hvd.allreduce_(t, op=hvd.Sum, name=f"shape{numel}")
    assert torch.equal(t, torch.full_like(t, TOTAL))
    v = torch.full((numel,), r + 1, dtype=torch.float64 if odd else torch.float32)
    raises(
        f"dtype {numel}",
        lambda: hvd.allreduce_(v, op=hvd.Sum, name=f"shape{numel}"),
        ["dtype", "float64", "float32"],
    )
    assert torch.equal(v, torch.full_like(v, r + 1))
    raises(
        f"op {numel}",
        lambda: hvd.allreduce(t, op=hvd.Max if odd else hvd.Sum, name=f"shape{numel}"),
        ["op", "Max", "Sum"],
    )

# -- only the last rank differs: the others see it only through the flag on the way -------
for numel in (SMALL, LARGE):
    t = torch.full((numel,), float(r + 1))
    hvd.allreduce_(t, op=hvd.Sum, name=f"last{numel}")
    u = torch.full((numel + (r == n - 1),), float(r + 1))
    raises(f"last rank {numel}", lambda: hvd.allreduce_(u, name=f"last{numel}"), ["shape"])
    assert torch.equal(u, torch.full_like(u, r + 1))

# -- a rank that skips a name: rank 0 calls "a" then "b", the others "b" only -------------
for numel in (SMALL, LARGE):
    a, b = torch.ones(numel), torch.ones(numel)
    for rep in range(2):  # both cached on every rank
        hvd.allreduce_(a, op=hvd.Sum, name=f"a{numel}")
        hvd.allreduce_(b, op=hvd.Sum, name=f"b{numel}")
    a.fill_(1.0)
    b.fill_(1.0)

    def skip(numel: int = numel) -> None:
        if r == 0:
            hvd.allreduce_(a, op=hvd.Sum, name=f"a{numel}")
        hvd.allreduce_(b, op=hvd.Sum, name=f"b{numel}")

    raises(f"skipped name {numel}", skip, ["name", f"a{numel}", f"b{numel}"])
    assert torch.equal(a, torch.ones(numel)) and torch.equal(b, torch.ones(numel))

# -- a cached allreduce against another collective -----------------------------------------
c = torch.ones(SMALL)
hvd.allreduce_(c, name="cached")
raises(
    "collective",
    lambda: hvd.broadcast(c, 0, name="cached") if odd else hvd.allreduce_(c, name="cached"),
    ["collective", "broadcast", "allreduce"],
)

# -- async handles interleaved with cached names -------------------------------------------
xs = {nm: torch.full((SMALL,), float(r + 1)) for nm in ("x", "y")}
for rep in range(3):
    for t in xs.values():
        t.fill_(r + 1)
    order = ["x", "y"] if (r + rep) % 2 else ["y", "x"]  # ranks submit in different orders
    hs = {nm: hvd.allreduce_async_(xs[nm], op=hvd.Sum, name=f"async.{nm}") for nm in order}
    w = torch.full((SMALL,), float(r + 1))
    hvd.allreduce_(w, op=hvd.Sum, name="between")  # cached; queued ops on every rank
    assert torch.equal(w, torch.full_like(w, TOTAL))
    for nm in ("x", "y"):
        assert torch.equal(hvd.synchronize(hs[nm]), torch.full((SMALL,), float(TOTAL)))
# rank 0 queues an op, then every rank calls a cached blocking allreduce: it runs first,
# the queued op later, matched by name once the others submit it
late = torch.full((SMALL,), float(r + 1))
if r == 0:
    h = hvd.allreduce_async(late, op=hvd.Sum, name="late")
w = torch.full((SMALL,), float(r + 1))
hvd.allreduce_(w, op=hvd.Sum, name="between")
assert torch.equal(w, torch.full_like(w, TOTAL))
if r != 0:
    h = hvd.allreduce_async(late, op=hvd.Sum, name="late")
assert torch.equal(hvd.synchronize(h), torch.full((SMALL,), float(TOTAL)))
usable()

# -- join: rank 0 joins, the others' cached allreduces get zeros from it ---------------------
j = torch.full((SMALL,), float(n))
for rep in range(2):  # cached with every rank present
    assert torch.equal(hvd.allreduce(j, name="joined"), j)
    assert torch.equal(hvd.allreduce(torch.ones(LARGE), name="joinedL"), torch.ones(LARGE))
if r == 0:
    last = hvd.join()
else:
    for rep in range(3):
        got = hvd.allreduce(j, name="joined")  # Average still divides by every rank
        assert torch.equal(got, torch.full_like(j, float(n - 1))), got[:3]
        got = hvd.allreduce(torch.ones(LARGE), op=hvd.Sum, name="joinedL")
        assert torch.equal(got, torch.full((LARGE,), float(n - 1)))
    try:
        hvd.allgather(torch.ones(2), name="gather_while_joined")
        raise AssertionError("allgather with a joined rank accepted")
    except RuntimeError as e:
        assert "join" in str(e)
    last = hvd.join()
assert (last != 0 or n == 1) and hvd.allgather_object(last) == [last] * n  # 0: it was alone
assert torch.equal(hvd.allreduce(j, name="joined"), j)  # everyone is back
usable()

# -- a process set of three ranks (an odd butterfly inside a larger job) --------------------
if n >= 4:
    trio = hvd.add_process_set([0, 1, 2])
    if r < 3:
        t = torch.full((SMALL,), float(r + 1))
        for rep in range(3):
            hvd.allreduce_(t.fill_(r + 1), op=hvd.Sum, name="trio", process_set=trio)
            assert torch.equal(t, torch.full_like(t, 6.0))
        try:
            hvd.allreduce(torch.ones(3 + (r == 2)), name="trio", process_set=trio)
            raise AssertionError("trio mismatch accepted")
        except hvd.CollectiveMismatchError as e:
            assert "shape" in str(e)
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=trio)[0].item() == 3.0
    hvd.remove_process_set(trio)
usable()
hvd.barrier()
print(f"OK spmd_cache rank {r}", flush=True)
