"""Collectives called from several threads of one rank at once: never a hang, never a
rank-dependent outcome.

TensorFlow runs a graph's independent ops on a pool of threads, so two hvdnb.torch
collectives (a gradient's allreduce and its allgather of sizes, say) can be called at the
same time on one rank and in another order on the other. Horovod queues them; hvdnb
negotiates one call at a time per process, so the calls of each rank are serialized in some
order. Where the ranks picked the same order both calls work; where not, the SPMD contract
is broken and each call raises ``CollectiveMismatchError`` on every rank. Either way every
rank sees the same outcome for each call, and the group stays usable. Before the calls were
serialized, the two threads of one rank shared the staging buffers and the point-to-point
pairing of header exchanges, so one rank started a call's data phase while its peer was
reporting a mismatch: a deadlock. Prints ``OK spmd_threads`` on each rank.
"""

from __future__ import annotations

import threading

import _spmd

_spmd.setup()

import torch  # noqa: E402

import hvdnb.torch as hvd  # noqa: E402

hvd.init()
n, r = hvd.size(), hvd.rank()


def calls(rep: int, named: bool) -> dict[str, object]:
    """Per call: a function returning its result, and the result every rank must get."""

    def nm(s: str) -> str | None:
        return f"{s}.{rep}" if named else None

    big = 100_000  # past the inline size: header round, then MPI's allreduce
    return {
        "allreduce": (
            lambda: hvd.allreduce(torch.ones(5), op=hvd.Sum, name=nm("ar")),
            torch.full((5,), float(n)),
        ),
        "allreduce large": (
            lambda: hvd.allreduce(torch.ones(big), op=hvd.Sum, name=nm("arL")),
            torch.full((big,), float(n)),
        ),
        "allgather": (
            lambda: hvd.allgather(torch.full((r + 1, 2), float(r)), name=nm("ag")),
            torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)]),
        ),
        "broadcast": (
            lambda: hvd.broadcast(torch.full((3,), float(r)), 0, name=nm("bc")),
            torch.zeros(3),
        ),
        "alltoall": (
            lambda: hvd.alltoall(torch.full((n, 2), float(r)), name=nm("a2a")),
            torch.arange(n, dtype=torch.float32).repeat_interleave(2).reshape(n, 2),
        ),
    }


def run_at_once(pairs: dict[str, object]) -> dict[str, str]:
    """Run every call on its own thread, released together; each call's outcome."""
    outcome: dict[str, str] = {}
    go = threading.Barrier(len(pairs))

    def one(key: str, fn: object, want: torch.Tensor) -> None:
        go.wait()
        try:
            got = fn()  # type: ignore[operator]
            outcome[key] = "ok" if torch.equal(got, want) else f"wrong result {got}"
        except hvd.CollectiveMismatchError:
            outcome[key] = "mismatch"
        except Exception as e:  # anything else is a failure the check below reports
            outcome[key] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=one, args=(k, fn, want)) for k, (fn, want) in pairs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcome


keys = list(calls(0, True))
counts = {"ok": 0, "mismatch": 0}
for rep in range(12):
    named = rep % 2 == 0
    every = calls(rep, named)
    # two calls at a time (the TensorFlow case), then all of them
    groups = [keys[i : i + 2] for i in range(0, len(keys), 2)] if rep % 3 else [keys]
    for group in groups:
        out = run_at_once({k: every[k] for k in group})
        seen = hvd.allgather_object(out)
        for k in group:
            per_rank = [s[k] for s in seen]
            assert all(v == per_rank[0] for v in per_rank), f"rep {rep} {k}: {per_rank}"
            assert per_rank[0] in counts, f"rep {rep} {k}: {per_rank[0]}"
            counts[per_rank[0]] += 1
        # the group is still usable, on the planned path and the general one
        assert torch.equal(
            hvd.allreduce(torch.ones(2), op=hvd.Sum, name="check"), torch.full((2,), float(n))
        )
        assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))

# the async queue from several threads: submitted at once, synchronized in one thread
ids: list[int] = []
lock = threading.Lock()


def submit(i: int) -> None:
    h = hvd.allreduce_async(torch.full((4,), float(i)), op=hvd.Sum, name=f"async.{i}")
    with lock:
        ids.append(h)


ts = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
for t in ts:
    t.start()
for t in ts:
    t.join()
got = sorted(float(hvd.synchronize(h)[0]) for h in ids)
assert got == [float(i * n) for i in range(4)], got
hvd.barrier()
if r == 0:
    print(f"outcomes {counts}", flush=True)
print(f"OK spmd_threads rank {r}", flush=True)
