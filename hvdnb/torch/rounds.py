"""Negotiation of hvdnb.torch collectives: handles, deferred async ops, rounds, join.

Owns: ``Handle`` (a started collective: its data phase in flight, a finish step, the timing
the comm listeners get), ``Op`` (a collective described by its 128-byte header and a
``start(headers)`` that runs its data phase), the per-transport queue of async ops that
were submitted but not yet negotiated, and the *round*: the header exchange every rank
of a process set takes part in before any data moves.

How ranks agree (Horovod's contract without its background thread):

- A blocking collective, or a DistributedOptimizer bucket, on a rank with nothing queued
  sends its own header. When every rank sent the same signature, the data phase starts at
  once: the hot path, one header exchange. A small allreduce over MPI sends no header
  round at all: its header (two ranks) or a check word of its signature (more ranks, the
  butterfly of ``butterfly.py``) travels with the data, and when the check fails every
  rank learns it in the same round and gets every rank's header to settle as below.
- ``*_async`` calls queue their op and return: nothing is sent (``poll`` says False) until
  the next round: a collective or ``synchronize`` on this process set. A rank with queued
  ops, a joined rank, or headers that disagree turn the round into a *full round*: every
  rank sends the list of ops it is waiting for (pickled, the slow path) and every rank
  computes the same outcome from the same lists: ops present on every active rank run in
  the first active rank's order; ops present on some ranks only stay queued (Horovod
  matches async ops by name, so a rank may submit them in another order or later); an op
  whose ranks disagree fails with ``CollectiveMismatchError`` on every rank; and when no op
  is common while every rank is blocked (Horovod would hang), what each rank waits for
  fails on every rank. No rank is ever left inside a collective after an error.
- ``join``: a joined rank keeps taking part in rounds, contributing zeros to allreduces
  (as Horovod does; Average still divides by the full size) and failing every other
  collective on the active ranks, until every rank has joined.
- Threads: one thread at a time negotiates and starts collectives in a process (``SERIAL``,
  reentrant; held from the header exchange to the start of the data phase, not while a
  handle is waited on). TensorFlow runs a graph's independent ops on several threads, and
  two calls from two threads would otherwise share the staging buffers and pair their
  header exchanges with the peer's crosswise: ranks then decided differently (one started
  the data phase while the other reported a mismatch) and deadlocked. Serialized, each rank
  runs its calls in some order: ranks that picked the same order succeed, others get the
  same ``CollectiveMismatchError`` on every rank.

Never: issue a collective outside a round, decide differently on different ranks (every
decision is a function of what all ranks sent), block in ``poll``, or know any collective's
semantics (those live above: ``reduce.py``, ``collectives.py``).
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch

import hvdnb.torch.listeners as _lst
from hvdnb.torch.timing import cuda_wait
from hvdnb.torch.transport import HDR, HDR_BYTES, SIG_BYTES, Kind

__all__ = [
    "DTYPES",
    "SERIAL",
    "CollectiveMismatchError",
    "Handle",
    "Op",
    "after_exchange",
    "blocking",
    "defer",
    "full_round",
    "join_round",
    "kind_of",
    "mismatch_error",
    "rounds",
    "settle",
    "wire_dtype",
]

DTYPES = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
)
HALF = (torch.float16, torch.bfloat16)
#: held by the one thread that negotiates and starts a collective in this process (see
#: the module doc): every entry point into a round takes it
SERIAL = threading.RLock()


class CollectiveMismatchError(RuntimeError):
    """Ranks called a collective with different arguments; raised on every rank."""


def wire_dtype(dtype: torch.dtype, backend: str, cuda: bool = False) -> torch.dtype:
    """The dtype an allreduce of ``dtype`` travels in (every rank computes the same)."""
    if dtype in HALF and not cuda:
        return torch.float32  # summed in float32, like NCCL's accumulators
    if dtype == torch.int16 and backend == "gloo":
        return torch.int32  # gloo refuses int16
    if dtype == torch.bool:
        return torch.uint8
    return dtype


def kind_of(h: bytes) -> int:
    return int.from_bytes(h[:8], "little", signed=True)


# -- handles ----------------------------------------------------------------------------
class Handle:
    """A started collective: ``wait()`` finishes it once and returns its result.

    ``meta`` is (name, nbytes, backend) when comm listeners were registered at launch;
    ``own`` / ``exp`` accumulate the blocking seconds of the collective and of the calling
    thread, ``gloo`` is a GlooClock record, ``cuda`` an NcclSeconds (NCCL's own timing;
    the exposed time is then a CudaGap on the compute stream).
    """

    __slots__ = ("cuda", "exp", "finish", "gloo", "meta", "own", "result", "work")
    #: seconds (a float); on NCCL, once waited, a CudaGap that ``report`` hands on
    exp: Any

    def __init__(
        self, work: Any, finish: Callable[[], Any] | None, result: Any, meta: Any = None
    ) -> None:
        self.work, self.finish, self.result, self.meta = work, finish, result, meta
        self.own = self.exp = 0.0
        self.gloo: Any = None
        self.cuda: Any = None

    def test(self) -> bool:
        w = self.work
        if w is None:
            return True
        return bool(w.Test()) if hasattr(w, "Test") else bool(w.is_completed())

    def wait(self) -> Any:
        w = self.work
        if w is not None:
            if self.meta is None:
                w.Wait() if hasattr(w, "Test") else w.wait()
            elif self.cuda is not None:
                self.exp = cuda_wait(w)
            else:
                t0 = time.perf_counter()
                w.Wait() if hasattr(w, "Test") else w.wait()
                dt = time.perf_counter() - t0
                self.exp += dt
                self.own += dt
            self.work = None
        if self.finish is not None:
            self.result, self.finish = self.finish(), None
        if self.meta is not None:
            self.report()
        return self.result

    def report(self) -> None:
        name, nbytes, backend = self.meta
        self.meta = None
        seconds: Any = self.own
        if self.cuda is not None:
            seconds = self.cuda
        elif self.gloo is not None:
            rec = self.gloo
            if rec[1] != rec[1]:  # the callback has not run yet (it races wait()'s return)
                p = rec[3]
                start = rec[0] if p is None or p[0] != p[0] else max(rec[0], p[0])
                rec[1] = time.perf_counter() - start
            seconds = rec[1]
        _lst.notify(name, nbytes, seconds, backend, self.exp)


class Op:
    """One collective as negotiated: header (signature + per-rank words), a description
    for error messages, and ``start(headers)`` running the data phase (headers by rank)."""

    __slots__ = ("desc", "error", "handle", "hdr", "inline", "name", "start")

    def __init__(
        self,
        name: str,
        hdr: bytes,
        desc: Callable[[], dict[str, Any]],
        start: Callable[[list[bytes]], Handle],
    ) -> None:
        self.name, self.hdr, self.desc, self.start = name, hdr, desc, start
        self.handle: Handle | None = None
        self.error: BaseException | None = None
        #: two ranks over MPI, small data: header and data in one message when this op is
        #: alone in its round (every rank decides the same: same size, same transport).
        #: Returns the finished Handle, or every rank's header when they differed.
        self.inline: Callable[[], Any] | None = None

    @property
    def settled(self) -> bool:
        return self.handle is not None or self.error is not None


def _run(op: Op, hdrs: list[bytes]) -> None:
    try:
        op.handle = op.start(hdrs)
    except Exception as exc:  # a data-phase error is this op's result, on this rank
        op.error = exc


def mismatch_error(tr: Any, mine: dict[str, Any]) -> CollectiveMismatchError:
    """Gather every rank's description (collective) and say what differs."""
    descs = tr.gather_objects(mine)
    return _describe(mine, descs)


def _describe(
    mine: dict[str, Any], descs: list[dict[str, Any]], ranks: list[int] | None = None
) -> CollectiveMismatchError:
    ranks = list(range(len(descs))) if ranks is None else ranks
    diffs = []
    # every key any rank described, in rank order: the same diagnosis on every rank
    for key in dict.fromkeys(k for d in descs for k in d):
        vals = [d.get(key) for d in descs]
        if any(v != vals[0] for v in vals):
            per = ", ".join(f"rank {r}: {v!r}" for r, v in zip(ranks, vals))
            diffs.append(f"{key} differs ({per})")
    what = "; ".join(diffs) or "headers differ"
    return CollectiveMismatchError(
        f"hvdnb {mine.get('collective')} '{mine.get('name')}': ranks disagree: {what}. Every "
        "rank must call the same collectives in the same order with the same name, dtype, "
        "shape, op and root; look for rank-dependent branches or data-dependent shapes before "
        "this call."
    )


# -- submitting ---------------------------------------------------------------------------
def blocking(tr: Any, op: Op) -> Handle:
    """Negotiate ``op`` now (collective) and start its data phase; raise if it failed."""
    with SERIAL:
        timed = bool(_lst.LISTENERS)
        t0 = time.perf_counter() if timed else 0.0
        if tr.pending:
            rounds(tr, op, op)
        elif op.inline is not None:
            r = op.inline()
            if type(r) is Handle:
                op.handle = r
            else:
                settle(tr, r, op, op)
                if not op.settled:
                    rounds(tr, op, op)
        else:
            hdrs = tr.exchange(op.hdr)
            sig = op.hdr[:SIG_BYTES]
            if all(h[:SIG_BYTES] == sig for h in hdrs):
                op.handle = op.start(hdrs)
            else:
                settle(tr, hdrs, op, op)
                if not op.settled:
                    rounds(tr, op, op)
        if op.error is not None:
            raise op.error
        h = op.handle
        assert h is not None
        if timed and h.meta is not None:
            dt = time.perf_counter() - t0
            h.exp += dt
            h.own += dt
        return h


def after_exchange(tr: Any, hdrs: list[bytes], op: Op) -> Handle:
    """A fast path exchanged ``op``'s header and saw a difference: settle it the slow way."""
    with SERIAL:
        settle(tr, hdrs, op, op)
        if not op.settled:
            rounds(tr, op, op)
        if op.error is not None:
            raise op.error
        assert op.handle is not None
        return op.handle


def defer(tr: Any, op: Op) -> Op:
    """Queue an async op (no communication); it runs in the next round on this set."""
    with SERIAL:
        for o in tr.pending:
            if o.name == op.name:
                raise ValueError(
                    f"an operation named '{op.name}' is already in flight on this rank; async "
                    "collectives in flight at the same time need distinct names"
                )
        tr.pending.append(op)
        return op


def rounds(tr: Any, cur: Op | None, target: Op) -> None:
    """Take part in rounds until ``target`` has run or failed (``cur``: this call's op)."""
    with SERIAL:
        while not target.settled:
            ops = tr.pending + ([cur] if cur is not None and cur not in tr.pending else [])
            if len(ops) == 1 and ops[0].inline is not None:
                only = ops[0]
                r = only.inline()
                if type(r) is Handle:
                    if only in tr.pending:
                        tr.pending.remove(only)
                    only.handle = r
                else:
                    settle(tr, r, cur, target)
                continue
            if len(ops) == 1:
                hdr = ops[0].hdr
            else:
                digest = zlib.crc32(b"".join(o.hdr[:SIG_BYTES] for o in ops))
                hdr = HDR.pack(Kind.ROUND, digest, len(ops), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
            hdrs = tr.exchange(hdr)
            if len(ops) == 1 and all(h[:SIG_BYTES] == hdr[:SIG_BYTES] for h in hdrs):
                only = ops[0]
                if only in tr.pending:
                    tr.pending.remove(only)
                _run(only, hdrs)
                continue
            settle(tr, hdrs, cur, target)


def settle(tr: Any, hdrs: list[bytes], cur: Op | None, target: Op) -> None:
    """Finish a round whose headers were not all the same plain op (every rank is here)."""
    kinds = [kind_of(h) for h in hdrs]
    if Kind.ROUND not in kinds and Kind.JOIN not in kinds:
        blame = cur if cur is not None else target
        if blame in tr.pending:
            tr.pending.remove(blame)
        blame.error = mismatch_error(tr, blame.desc())
        return
    full_round(tr, cur, target)


def full_round(tr: Any, cur: Op | None, target: Op | None, joined: int = -1) -> list[Any]:
    """The slow round: every rank's op list; returns every rank's info (see module doc).

    ``joined`` >= 0 marks a rank inside ``join`` (the number of rounds it has served).
    """
    mine = [] if joined >= 0 else list(tr.pending)
    if cur is not None and cur not in mine:
        mine.append(cur)
    wait = None if target is None else target.name
    info = {"join": joined, "ops": [(o.name, o.hdr) for o in mine], "wait": wait}
    allinfo: list[Any] = tr.gather_objects(info)
    n = len(allinfo)
    active = [r for r in range(n) if allinfo[r]["join"] < 0]
    if not active:
        return allinfo
    joined_ranks = [r for r in range(n) if allinfo[r]["join"] >= 0]
    lists = [dict(allinfo[r]["ops"]) for r in active]
    common = [nm for nm, _ in allinfo[active[0]]["ops"] if all(nm in lst for lst in lists)]
    by_name = {o.name: o for o in mine}
    for nm in common:
        hs = [lst[nm] for lst in lists]
        kind = kind_of(hs[0])
        err: BaseException | None = None
        if any(h[:SIG_BYTES] != hs[0][:SIG_BYTES] for h in hs):
            descs = [_desc_from_header(nm, h) for h in hs]
            err = _describe(descs[0], descs, active)
        elif joined_ranks and kind != Kind.ALLREDUCE:
            err = RuntimeError(
                f"hvdnb {Kind.NAMES.get(kind, kind)} '{nm}': rank(s) {joined_ranks} have "
                "already called join(); only allreduce can run while ranks have joined "
                "(joined ranks contribute zeros), as in Horovod"
            )
        if joined >= 0:
            if err is None:
                _serve_zeros(tr, hs[0])
            continue
        op = by_name[nm]
        if op in tr.pending:
            tr.pending.remove(op)
        if err is not None:
            op.error = err
            continue
        full = [hs[0]] * n
        for i, r in enumerate(active):
            full[r] = hs[i]
        _run(op, full)
    if not common and joined < 0:
        w = target if target is not None else cur
        if w is not None:
            if w in tr.pending:
                tr.pending.remove(w)
            waits = ", ".join(f"rank {r}: {allinfo[r]['wait']!r}" for r in active)
            w.error = CollectiveMismatchError(
                f"hvdnb '{w.name}': ranks wait for different collectives ({waits}) and none "
                "was submitted by every rank, so none can run (Horovod would hang here). "
                "Every rank must submit the same collectives; check rank-dependent branches."
            )
    return allinfo


def _desc_from_header(name: str, h: bytes) -> dict[str, Any]:
    w = HDR.unpack(h)
    kind = Kind.NAMES.get(w[0], str(w[0]))
    dt = DTYPES[w[2] - 1] if 0 < w[2] <= len(DTYPES) else None
    return {
        "collective": kind,
        "name": name,
        "dtype": str(dt),
        "shape": f"#{w[5]:x}",
        "numel": w[6],
        "op": w[3],
        "root_rank": w[4],
    }


def _serve_zeros(tr: Any, hdr: bytes) -> None:
    """A joined rank's part in an allreduce: zeros of the wire dtype and size."""
    w = HDR.unpack(hdr)
    dtype = DTYPES[w[2] - 1]
    wd = wire_dtype(dtype, tr.backend)
    z = torch.zeros(w[6], dtype=wd)
    if w[3] == 2:  # Adasum gathers every rank's vector
        tr.allgatherv(
            z, torch.empty(z.numel() * tr.size, dtype=wd), [z.numel() * z.element_size()] * tr.size
        )
        return
    work = tr.allreduce(z, z, w[3], True)
    if work is not None:
        work.Wait() if hasattr(work, "Test") else work.wait()


def join_round(tr: Any, served: int) -> int | None:
    """One round of a joined rank; returns the last rank to join once every rank has."""
    with SERIAL:
        hdr = HDR.pack(Kind.JOIN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, served, 0, 0, 0)
        hdrs = tr.exchange(hdr)
        if all(kind_of(h) == Kind.JOIN for h in hdrs):
            counts = [HDR.unpack(h)[12] for h in hdrs]
            # the ranks that served fewest rounds joined last; ties: the highest rank
            last = min(counts)
            return max(r for r, c in enumerate(counts) if c == last)
        full_round(tr, None, None, joined=served)
        return None


assert HDR_BYTES == 128
