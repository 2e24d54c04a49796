"""Horovod's allreduce family on tensors, async handles, ``poll`` and ``synchronize``.

Owns: the semantics of allreduce (ops, Average on integers, pre/post scaling, the
deprecated ``average=``, dtype conversions where a transport refuses a type, names and auto
names, Adasum), async handles, and the planned fast paths of repeated named allreduces
over MPI. Every collective is negotiated as ``rounds.py`` describes: each rank sends a
header (kind, name, dtype, shape, op, root, scales) before its data and every rank
compares all headers, so ranks that disagree raise ``CollectiveMismatchError`` on every
rank instead of hanging. Never: reduce half types in half precision (they are summed in
float32), call ``cuda.synchronize``, or skip the header. The other collectives live in
``collectives.py``.

Transport per tensor: CUDA tensors go through torch.distributed (NCCL); CPU tensors through
MPI when the job was started by mpiexec, otherwise gloo.
"""

from __future__ import annotations

import itertools
import time
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hvdnb.torch import listeners as _lst
from hvdnb.torch.process_sets import STATE, ProcessSet, global_process_set
from hvdnb.torch.rounds import (
    DTYPES,
    CollectiveMismatchError,
    Handle,
    Op,
    after_exchange,
    blocking,
    defer,
    rounds,
    wire_dtype,
)
from hvdnb.torch.transport import CALLS, HDR, HDR_BYTES, SIG_BYTES, TAG, Kind, MPITransport

__all__ = [
    "Adasum",
    "Average",
    "CollectiveMismatchError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "Product",
    "Sum",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "poll",
    "synchronize",
]

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OPNAMES = {0: "Average", 1: "Sum", 2: "Adasum", 3: "Min", 4: "Max", 5: "Product"}
_DCODE = {d: i + 1 for i, d in enumerate(DTYPES)}
_NAMEHASH: dict[str, int] = {}


class HorovodInternalError(RuntimeError):
    """Horovod's name for a failed collective (kept so ``except hvd.HorovodInternalError``
    in Horovod scripts works); hvdnb raises ``CollectiveMismatchError`` and friends."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod elastic's signal that hosts changed; hvdnb never raises it (no elastic)."""


# -- helpers ----------------------------------------------------------------------------
def _nh(name: str) -> int:
    h = _NAMEHASH.get(name)
    if h is None:
        if len(_NAMEHASH) > 100_000:
            _NAMEHASH.clear()
        h = _NAMEHASH[name] = zlib.crc32(name.encode())
    return h


def _auto_name(ps: ProcessSet, kind: int) -> str:
    # one counter for every kind: a rank that called another kind by mistake stays in step
    c = ps.counters.get(0, 0)
    ps.counters[0] = c + 1
    return f"{Kind.NAMES[kind]}.noname.{c}"


def _dcode(t: torch.Tensor) -> int:
    code = _DCODE.get(t.dtype)
    if code is None:
        raise TypeError(
            f"hvdnb.torch does not support dtype {t.dtype}; use one of "
            f"{', '.join(str(d) for d in DTYPES)}"
        )
    return code


def _transport(ps: ProcessSet, t: torch.Tensor) -> Any:
    if t.is_cuda or ps.mpi is None:
        tr = ps.torch
    else:
        tr = ps.mpi
    if tr is None:
        ps._require()
        raise ValueError(
            f"this rank is not a member of {ps}; only its members may call its collectives"
        )
    return tr


def _desc(kind: int, name: str, t: torch.Tensor, **kw: Any) -> Callable[[], dict[str, Any]]:
    def build() -> dict[str, Any]:
        d = {
            "collective": Kind.NAMES[kind],
            "name": name,
            "dtype": str(t.dtype),
            "shape": tuple(t.shape),
            "device": t.device.type,
        }
        d.update(kw)
        return d

    return build


def _mismatch(tr: Any, mine: dict[str, Any]) -> None:
    from hvdnb.torch.rounds import mismatch_error

    raise mismatch_error(tr, mine)


def _scale(t: torch.Tensor, f: float, inplace: bool) -> torch.Tensor:
    if t.is_floating_point():
        if t.is_cuda and t.element_size() == 2:
            # Horovod's GPU kernels scale 16-bit floats by the factor rounded to that type
            # (on CPU they compute in float32, as hvdnb's wire dtype does there)
            f = float(torch.tensor(f, dtype=t.dtype))
        return t.mul_(f) if inplace else t * f
    # Horovod scales integers in double precision and truncates
    s = (t.double() * f).to(t.dtype)
    return t.copy_(s) if inplace else s


def _op(op: int | None, average: bool | None) -> int:
    """Horovod's ``average=`` (deprecated) and ``op=``: one of them, Average by default."""
    if average is not None:
        if isinstance(average, str):
            raise TypeError(
                "the second positional argument of Horovod's allreduce is `average` "
                f"(deprecated), not the name: pass name={average!r}"
            )
        if op is not None:
            raise ValueError(
                "The op parameter supersedes average. Please provide only one of them."
            )
        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed in v1.0",
            DeprecationWarning,
            stacklevel=3,
        )
        return Average if average else Sum
    return Average if op is None else int(op)


def _meta(name: str, nbytes: int, backend: str) -> Any:
    return (name, nbytes, backend) if _lst.LISTENERS else None


def _done(name: str, nbytes: int, t0: float, backend: str) -> None:
    """Report a collective that ran inside one blocking call started at ``t0``."""
    if t0:
        dt = time.perf_counter() - t0
        _lst.notify(name, nbytes, dt, backend, dt)


# -- async handles ------------------------------------------------------------------------
class _Async:
    """What ``*_async`` returns a number for: a queued op, then its started Handle."""

    __slots__ = ("op", "post", "tr")

    def __init__(self, op: Op, tr: Any, post: Callable[[Any], Any] | None = None) -> None:
        self.op, self.tr, self.post = op, tr, post

    def done(self) -> bool:
        op = self.op
        if op.error is not None:
            return True
        return op.handle is not None and op.handle.test()

    def wait(self) -> Any:
        op = self.op
        if not op.settled:
            t0 = time.perf_counter()
            rounds(self.tr, None, op)
            if op.handle is not None and op.handle.meta is not None:
                op.handle.exp += time.perf_counter() - t0
        if op.error is not None:
            raise op.error
        assert op.handle is not None
        r = op.handle.wait()
        return r if self.post is None else self.post(r)


_HANDLES: dict[int, Any] = {}
_IDS = itertools.count(1)


def _register(h: Any) -> int:
    hid = next(_IDS)
    _HANDLES[hid] = h
    return hid


def _async(tr: Any, op: Op, post: Callable[[Any], Any] | None = None) -> int:
    return _register(_Async(defer(tr, op), tr, post))


def poll(handle: int) -> bool:
    """Whether the async op behind ``handle`` has completed; never blocks.

    An async op is negotiated in the next round on its process set (any collective or
    ``synchronize`` there), so ``poll`` is False until then, and afterwards until its data
    has arrived. Loop on ``synchronize``, not on ``poll``, to make progress.
    """
    h = _HANDLES.get(handle)
    if h is None:
        raise ValueError(f"unknown or already synchronized handle {handle}")
    return bool(h.done())


def synchronize(handle: int) -> Any:
    """Wait for the async op behind ``handle`` and return its result (once per handle).

    Collective when the op has not been negotiated yet: the other ranks must reach a
    collective or ``synchronize`` on the same process set. Raises what the op raised
    (e.g. ``CollectiveMismatchError`` on every rank).
    """
    h = _HANDLES.pop(handle, None)
    if h is None:
        raise ValueError(f"unknown or already synchronized handle {handle}")
    return h.wait()


# -- allreduce ----------------------------------------------------------------------------
def _check_op(op: int) -> None:
    if op not in _OPNAMES:
        raise ValueError(
            f"op {op!r} is not an hvd op; use hvd.Average, Sum, Adasum, Min, Max or Product"
        )


def _allreduce_op(
    tensor: torch.Tensor,
    inplace: bool,
    name: str | None,
    op: int,
    pre: float,
    post: float,
    ps: ProcessSet,
    shape_key: int | None = None,
    tr: Any = None,
) -> tuple[Any, Op, Callable[[], Handle | None]]:
    """Build one allreduce: (transport, Op, inline attempt or None).

    The inline attempt (two ranks over MPI, small tensors, nothing queued) swaps header and
    data in one message and returns the finished Handle, or None when headers differed
    (the round is then settled by ``after_exchange`` with the op's regular data phase).
    """
    _check_op(op)
    if tr is None:
        tr = _transport(ps, tensor)
    if name is None:
        name = _auto_name(ps, Kind.ALLREDUCE)
    dtype = tensor.dtype
    dcode = _dcode(tensor)
    x = tensor if tensor.is_contiguous() else tensor.contiguous()
    wd = wire_dtype(dtype, tr.backend, x.is_cuda)
    wire = x if wd == dtype else x.to(wd)
    if op == Adasum:
        if not wire.is_floating_point():
            raise ValueError(f"Adasum needs a floating point tensor, not {dtype}")
        if tr.size & (tr.size - 1):
            raise NotImplementedError(
                f"Adasum needs a power-of-two number of ranks (this process set has "
                f"{tr.size}): its pairwise combination tree, like Horovod's, has no rule "
                "for an unpaired rank"
            )
    if pre != 1.0:
        wire = _scale(wire, pre, inplace=wire is not tensor)
    nbytes = x.numel() * x.element_size()
    hdr = HDR.pack(
        Kind.ALLREDUCE,
        _nh(name),
        dcode,
        op,
        0,
        hash(x.shape) if shape_key is None else shape_key,
        x.numel(),
        hash(pre),
        hash(post),
        0,
        0,
        0,
        0,
        nbytes,
        0,
        0,
    )
    n = tr.size
    direct = inplace and wire is tensor
    backend = tr.backend

    def finish(r: torch.Tensor) -> torch.Tensor:
        post_eff = post
        if op == Average:
            if r.is_floating_point():
                if post == 1.0:
                    r.div_(n)  # correctly rounded, as a division (x * (1/3) is not)
                else:
                    post_eff = post / n
            else:
                r.div_(n, rounding_mode="trunc")
        if post_eff != 1.0:
            _scale(r, post_eff, inplace=True)
        if inplace:
            if r is not tensor:
                tensor.copy_(r.view(tensor.shape) if r.shape != tensor.shape else r)
            return tensor
        return r if r.dtype == dtype else r.to(dtype)

    def start(hdrs: list[bytes]) -> Handle:
        if op == Adasum:
            from hvdnb.torch.collectives import adasum_tree

            parts = torch.empty((n, wire.numel()), dtype=wire.dtype)
            tr.allgatherv(wire, parts, [wire.numel() * wire.element_size()] * n)
            res = adasum_tree(parts).view(wire.shape)
            return Handle(None, None, finish(res), _meta(name, nbytes, backend))
        res = wire if direct else torch.empty_like(wire)
        meta = _meta(name, nbytes, backend)
        if meta is not None and backend == "nccl":
            return _nccl_timed(tr, wire, res, op, finish, meta)
        work = tr.allreduce(wire, res, op, True)
        h = Handle(work, lambda: finish(res), None, meta)
        if meta is not None and backend == "gloo" and work is not None:
            h.gloo = tr.clock.attach(work)
        return h

    o = Op(
        name,
        hdr,
        _desc(Kind.ALLREDUCE, name, tensor, op=_OPNAMES[op], prescale=pre, postscale=post),
        start,
    )
    nbw = wire.numel() * wire.element_size()

    def inline() -> Any:
        if not tr.exchange_inline(hdr, wire, nbw):
            peer = tr.rbuf[:HDR_BYTES].tobytes()
            return [hdr, peer] if tr.rank == 0 else [peer, hdr]
        peer_t = tr.peer_view(wire.dtype, wire.shape)
        out = wire if direct else None
        if op <= Sum:
            res = torch.add(wire, peer_t, out=out)
        elif op == Min:
            res = torch.minimum(wire, peer_t, out=out)
        elif op == Max:
            res = torch.maximum(wire, peer_t, out=out)
        else:
            res = torch.mul(wire, peer_t, out=out)
        return Handle(None, None, finish(res), _meta(name, nbytes, backend))

    if type(tr) is MPITransport and nbw <= tr.inline and op != Adasum:
        o.inline = inline
    return tr, o, None


def _nccl_timed(
    tr: Any,
    wire: torch.Tensor,
    res: torch.Tensor,
    op: int,
    finish: Callable[[torch.Tensor], Any],
    meta: Any,
) -> Handle:
    """NCCL, its own kernel time read later from the Work (never here)."""
    from hvdnb.torch.rounds import _NcclSeconds

    work = tr.allreduce(wire, res, op, True)
    h = Handle(work, lambda: finish(res), None, meta)
    h.cuda = _NcclSeconds(work)
    return h


def _allreduce_launch(
    tensor: torch.Tensor,
    inplace: bool,
    name: str | None,
    op: int,
    pre: float,
    post: float,
    ps: ProcessSet,
    shape_key: int | None = None,
) -> Handle:
    """Negotiate now and start the data phase (the caller waits on the Handle)."""
    tr, o, _ = _allreduce_op(tensor, inplace, name, op, pre, post, ps, shape_key)
    return blocking(tr, o)


# -- fast paths: repeated allreduces over MPI, planned once per call site ------------------
# A call site that reduces the same tensor under the same name again and again (the common
# case) gets a plan: its header, signature and MPI arguments are built once, so a call is
# the header check and the reduction with next to no Python between them. Measured: the
# general path's ~25 small steps cost 10-25 us per call after a large reduction has
# flushed the caches, more than the header exchange itself.
_PLAN_OPS = (Average, Sum, Min, Max, Product)
_PLAN_DTYPES = (
    torch.float32,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
)
_NO_PLAN = object()
_LAST: list[Any] = [None]  # every rank's header after a planned exchange that differed
# numpy reductions of the inline path (half the cost of MPI's Reduce_local from Python);
# sums that overflow to inf are silent, as they are in MPI, NCCL and Horovod
_UFUNCS = {Average: np.add, Sum: np.add, Min: np.minimum, Max: np.maximum, Product: np.multiply}
warnings.filterwarnings("ignore", r"overflow encountered", RuntimeWarning, __name__)


def _header(
    t: torch.Tensor, name: str, op: int, post: float, nbytes: int, blocking: int = 0
) -> bytes:
    """The header the general path sends for this call: ranks on either path still match.

    ``blocking`` (outside the signature) is 1 when this rank may use a blocking
    MPI_Allreduce; only when every rank says so do they all use it (see ``_run_big``).
    """
    return HDR.pack(
        Kind.ALLREDUCE,
        _nh(name),
        _DCODE[t.dtype],
        op,
        0,
        hash(t.shape),
        t.numel(),
        hash(1.0),
        hash(post),
        0,
        0,
        0,
        0,
        nbytes,
        blocking,
        0,
    )


_BLOCKING_AT = 14 * 8  # byte offset of the header's ``blocking`` field
_BLOCKING = (1).to_bytes(8, "little")


class _Plan:
    """A small allreduce between two ranks: one Sendrecv (header + data) and one reduction.

    Holds a numpy view of the tensor (keeping it alive while cached; the cache is bounded
    and only small tensors are planned this way).
    """

    __slots__ = (
        "dt",
        "hbuf",
        "hdr",
        "mine",
        "nb",
        "peer",
        "ptr",
        "rreq",
        "rsig",
        "scale",
        "shape",
        "sig",
        "spec",
        "sreq",
        "tr",
        "ufunc",
    )

    def __init__(self, tr: MPITransport, t: torch.Tensor, name: str, op: int, post: float):
        self.tr = tr
        self.nb = t.numel() * t.element_size()
        self.hdr = _header(t, name, op, post, self.nb)
        self.mine = t.numpy().reshape(-1)
        self.peer = tr.rbuf[HDR_BYTES : HDR_BYTES + self.nb].view(self.mine.dtype)
        self.ufunc = _UFUNCS[op]
        self.scale = post / 2 if op == Average else post
        self.ptr = t.data_ptr()
        self.shape = t.shape
        # header (kept here) + the tensor's own memory as one MPI struct type: a call sends
        # both with no copy and no header write; the peer receives them as contiguous bytes
        MPI = tr.MPI
        self.hbuf = np.frombuffer(bytearray(self.hdr), np.uint8)
        self.dt = MPI.Datatype.Create_struct(
            [HDR_BYTES, self.nb], [MPI.Get_address(self.hbuf), self.ptr], [MPI.BYTE, MPI.BYTE]
        ).Commit()
        self.spec = [MPI.BOTTOM, 1, self.dt]
        self.sig = self.hdr[:SIG_BYTES]
        self.rsig = tr.rmv[:SIG_BYTES]
        # persistent requests: the exchange is Start/Wait with no argument parsing (0.8 us
        # less than Sendrecv); they are plain point-to-point, so they match the peer's
        # Sendrecv on the general path
        self.rreq = tr.comm.Recv_init(tr.rspec, tr.peer, TAG)
        self.sreq = tr.comm.Send_init(self.spec, tr.peer, TAG)

    def __del__(self) -> None:
        try:
            if not self.tr.MPI.Is_finalized():
                self.rreq.Free()
                self.sreq.Free()
                self.dt.Free()
        except Exception:  # interpreter teardown: MPI may be gone
            pass


class _BigPlan:
    """A larger allreduce (any number of ranks): header check, then MPI's Iallreduce.

    Keeps no reference to the tensor: its buffer is rebuilt from the address, which the
    plan key includes (a later tensor at the same address, dtype and shape is the same
    memory). ``t.numpy()`` alone costs 1.5 us.
    """

    __slots__ = (
        "buf",
        "comm",
        "count",
        "desc",
        "div",
        "hdr",
        "hspec",
        "in_place",
        "mop",
        "mtype",
        "peer",
        "rblock",
        "rreq",
        "rsig",
        "rspec",
        "scale",
        "sig",
        "sreq",
        "tr",
    )

    def __init__(self, tr: MPITransport, t: torch.Tensor, name: str, op: int, post: float):
        MPI = tr.MPI
        nb = t.numel() * t.element_size()
        hdr = _header(t, name, op, post, nb, blocking=1)
        self.tr, self.comm, self.peer, self.rspec = tr, tr.comm, tr.peer, tr.rspec
        self.rblock = tr.rmv[_BLOCKING_AT : _BLOCKING_AT + 8]
        self.in_place = MPI.IN_PLACE
        self.rsig = tr.rmv[:SIG_BYTES]
        self.hdr = hdr
        self.hspec = [np.frombuffer(bytearray(hdr), np.uint8), MPI.BYTE]
        self.sig = hdr[:SIG_BYTES]
        self.mop = tr.ops[op]
        self.scale = post / tr.size if op == Average else post
        # Average alone divides (correctly rounded, as the general path does)
        self.div = tr.size if op == Average and post == 1.0 else 0
        self.mtype = _mpi_type(MPI, t.dtype)
        self.count = t.numel()
        self.buf = [MPI.buffer.fromaddress(t.data_ptr(), nb), self.count, self.mtype]
        # what a mismatch report says, built now: a closure would keep the tensor alive
        self.desc = _desc(Kind.ALLREDUCE, name, t, op=_OPNAMES[op], prescale=1.0, postscale=post)()
        if tr.peer >= 0:  # two ranks: the header swap as persistent requests (see _Plan)
            self.rreq = tr.comm.Recv_init(tr.rspec, tr.peer, TAG)
            self.sreq = tr.comm.Send_init(self.hspec, tr.peer, TAG)
        else:
            self.rreq = self.sreq = None

    def __del__(self) -> None:
        try:
            if self.rreq is not None and not self.tr.MPI.Is_finalized():
                self.rreq.Free()
                self.sreq.Free()
        except Exception:  # interpreter teardown: MPI may be gone
            pass


def _mpi_type(MPI: Any, dtype: torch.dtype) -> Any:
    return {
        torch.float32: MPI.FLOAT,
        torch.float64: MPI.DOUBLE,
        torch.int64: MPI.INT64_T,
        torch.int32: MPI.INT32_T,
        torch.int16: MPI.INT16_T,
        torch.int8: MPI.INT8_T,
        torch.uint8: MPI.UINT8_T,
    }[dtype]


def _plan(
    t: torch.Tensor, name: str, op: int, pre: float, post: float, ps: ProcessSet
) -> _Plan | _BigPlan | None:
    tr = ps.mpi
    if (
        tr is None
        or t.is_cuda
        or t.dtype not in _PLAN_DTYPES
        or not t.is_contiguous()
        or pre != 1.0
        or op not in _PLAN_OPS
        or tr.size < 2
    ):
        return None
    if not t.is_floating_point() and (op == Average or post != 1.0):
        return None  # integer scaling truncates: the general path does it
    nb = t.numel() * t.element_size()
    if nb == 0:
        return None
    if nb <= tr.inline:
        return _Plan(tr, t, name, op, post)
    return _BigPlan(tr, t, name, op, post)


def _run_plan(p: _Plan, t: torch.Tensor, inplace: bool) -> torch.Tensor | None:
    CALLS[0] += 1
    p.rreq.Start()
    p.sreq.Start()
    p.rreq.Wait()
    p.sreq.Wait()
    if p.rsig.tobytes() != p.sig:  # 60 ns; memoryview != bytes: 290
        return None  # the caller settles the round the slow way
    if inplace:
        p.ufunc(p.mine, p.peer, p.mine)  # positional out: no keyword parsing
        if p.scale != 1.0:
            np.multiply(p.mine, p.scale, p.mine)
        return t
    res = p.ufunc(p.mine, p.peer)
    if p.scale != 1.0:
        np.multiply(res, p.scale, out=res)
    return torch.from_numpy(res).view(p.shape)


def _run_big(p: _BigPlan, t: torch.Tensor, inplace: bool) -> torch.Tensor | None:
    if p.rreq is not None:  # two ranks: swap headers; a peer's inline message fits rbuf too
        # the same swap as _run_plan's, written out again on purpose: a shared helper is
        # one more Python call per allreduce, ~1 % of a 4 KB one, where the margin is thin
        CALLS[0] += 1
        p.rreq.Start()
        p.sreq.Start()
        p.rreq.Wait()
        p.sreq.Wait()
        if p.rsig.tobytes() != p.sig:  # 60 ns; memoryview != bytes: 290
            peer = p.tr.rbuf[:HDR_BYTES].tobytes()
            _LAST[0] = [p.hdr, peer] if p.tr.rank == 0 else [peer, p.hdr]
            return None
        blocking = p.rblock.tobytes() == _BLOCKING
    else:  # the transport's own all-headers exchange
        hdrs = p.tr.exchange(p.hdr)
        if any(h[:SIG_BYTES] != p.sig for h in hdrs):
            _LAST[0] = hdrs
            return None
        blocking = all(h[_BLOCKING_AT : _BLOCKING_AT + 8] == _BLOCKING for h in hdrs)
    # MPI never matches a blocking collective with a nonblocking one, and Horovod lets
    # another rank use allreduce_async for this tensor (the general path, which always
    # goes nonblocking and says so in its header): block only when every rank can
    if inplace:
        src, out = p.in_place, t
        dst = p.buf
    else:
        src, out = p.buf, torch.empty_like(t)
        dst = [p.tr.MPI.buffer.fromaddress(out.data_ptr(), p.buf[0].nbytes), p.count, p.mtype]
    if blocking:
        p.comm.Allreduce(src, dst, p.mop)
    else:
        p.comm.Iallreduce(src, dst, p.mop).Wait()
    if p.div:
        out.div_(p.div)
    elif p.scale != 1.0:
        out.mul_(p.scale)
    return out


def _fast(
    t: torch.Tensor,
    inplace: bool,
    name: str | None,
    op: int | None,
    pre: float,
    post: float,
    ps: ProcessSet,
) -> torch.Tensor | None:
    """A planned path, or None when this call needs the general one."""
    if _lst.LISTENERS or name is None or t.requires_grad or ps.mpi.pending:  # type: ignore
        return None
    op = Average if op is None else op
    key = (name, t.data_ptr(), t.dtype, t.shape, op, pre, post, ps)
    p = STATE.plans.get(key, _NO_PLAN)
    if p is _NO_PLAN:
        if len(STATE.plans) >= 256:
            STATE.plans.clear()
        p = STATE.plans[key] = _plan(t, name, op, pre, post, ps)
    if p is None:
        return None
    if type(p) is _Plan:
        r = _run_plan(p, t, inplace)
        if r is None:
            peer = p.tr.rbuf[:HDR_BYTES].tobytes()
            _LAST[0] = [p.hdr, peer] if p.tr.rank == 0 else [peer, p.hdr]
    else:
        r = _run_big(p, t, inplace)  # type: ignore[arg-type]
    if r is None:  # headers differed: a mistake, a queued async op or a joined peer
        hdrs, _LAST[0] = _LAST[0], None
        tr, o, _ = _allreduce_op(t, inplace, name, op, pre, post, ps, tr=p.tr)
        return after_exchange(tr, hdrs, o).wait()  # type: ignore[no-any-return]
    return r


class _AllreduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        t: torch.Tensor,
        name: str | None,
        op: int,
        pre: float,
        post: float,
        ps: ProcessSet,
    ) -> torch.Tensor:
        ctx.args = (op, pre, post, ps)
        return _allreduce_launch(t, False, name, op, pre, post, ps).wait()  # type: ignore

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        g = _allreduce_launch(grad.contiguous(), False, None, op, pre, post, ps).wait()
        return g, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks of the process set and return the result.

    SPMD contract: every rank of ``process_set`` calls it with the same ``name``, shape,
    dtype, op and scale factors; it blocks until all ranks arrive. Ranks that disagree
    raise ``CollectiveMismatchError`` on every rank. Differentiable.

    Parameters
    ----------
    tensor : CPU or CUDA tensor of any supported dtype (half types are summed in float32)
    average : deprecated (Horovod's): True means ``op=Average``, False ``op=Sum``
    name : key that matches the call across ranks (auto-numbered when None)
    compression : ``Compression.none`` or ``Compression.fp16`` (wire format)
    op : ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``;
        Average on integer tensors truncates toward zero, as Horovod does
    prescale_factor, postscale_factor : multiply before / after the reduction
    process_set : the ranks taking part (default: all)

    Returns
    -------
    torch.Tensor
        A new tensor with the reduced values, same shape and dtype.
    """
    op = _op(op, average)
    if compression is not None:
        comp, ctx = compression.compress(tensor)
        if comp is not tensor:
            out = allreduce(
                comp,
                name=name,
                op=op,
                prescale_factor=prescale_factor,
                postscale_factor=postscale_factor,
                process_set=process_set,
            )
            return compression.decompress(out, ctx)  # type: ignore[no-any-return]
    if process_set.mpi is not None:
        r = _fast(tensor, False, name, op, prescale_factor, postscale_factor, process_set)
        if r is not None:
            return r
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllreduceGrad.apply(
            tensor,
            name,
            op,
            prescale_factor,  # type: ignore
            postscale_factor,
            process_set,
        )
    return _allreduce_launch(
        tensor, False, name, op, prescale_factor, postscale_factor, process_set
    ).wait()  # type: ignore[no-any-return]


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """In-place ``allreduce``: ``tensor`` holds the result. Same SPMD contract."""
    op = _op(op, average)
    if process_set.mpi is not None:
        r = _fast(tensor, True, name, op, prescale_factor, postscale_factor, process_set)
        if r is not None:
            return r
    return _allreduce_launch(
        tensor, True, name, op, prescale_factor, postscale_factor, process_set
    ).wait()  # type: ignore[no-any-return]


def _allreduce_async(
    tensor: torch.Tensor,
    inplace: bool,
    average: bool | None,
    name: str | None,
    op: int | None,
    pre: float,
    post: float,
    ps: ProcessSet,
) -> int:
    tr, o, _ = _allreduce_op(tensor, inplace, name, _op(op, average), pre, post, ps)
    return _async(tr, o)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Queue an ``allreduce``; returns a handle for ``poll`` / ``synchronize``.

    Same SPMD contract as ``allreduce``, except that ranks may submit async ops in a
    different order (they are matched by name, as in Horovod). Nothing is sent until the
    next collective or ``synchronize`` on the process set; a second op with the same name
    while the first is queued raises ValueError. Do not modify ``tensor`` before
    ``synchronize``.
    """
    return _allreduce_async(
        tensor, False, average, name, op, prescale_factor, postscale_factor, process_set
    )


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """In-place ``allreduce_async``: after ``synchronize`` the tensor holds the result."""
    return _allreduce_async(
        tensor, True, average, name, op, prescale_factor, postscale_factor, process_set
    )
