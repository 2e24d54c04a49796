"""Horovod's collectives on tensors: allreduce, allgather, broadcast, alltoall, reducescatter.

Owns: the semantics (ops, Average on integers, pre/post scaling, dtype conversions where a
transport refuses a type, names and auto names, async handles) and the cross-rank check of
every collective: each rank sends a header (kind, name, dtype, shape, op, root, scales)
before its data and every rank compares all headers, so ranks that disagree raise
``CollectiveMismatchError`` on every rank instead of hanging. Never: reduce half types in
half precision (they are summed in float32), call ``cuda.synchronize``, or skip the header.

Transport per tensor: CUDA tensors go through torch.distributed (NCCL); CPU tensors through
MPI when the job was started by mpiexec, otherwise gloo.
"""

from __future__ import annotations

import itertools
import time
import warnings
import zlib
from typing import Any, Callable, Sequence

import numpy as np
import torch

from . import listeners as _lst
from .process_sets import STATE, ProcessSet, global_process_set
from .transport import CALLS, HDR, HDR_BYTES, SIG_BYTES, TAG, Kind, MPITransport

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "CollectiveMismatchError",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "allgather", "allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "barrier", "join", "poll", "synchronize",
]

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OPNAMES = {0: "Average", 1: "Sum", 2: "Adasum", 3: "Min", 4: "Max", 5: "Product"}
_DTYPES = (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool,
)
_DCODE = {d: i + 1 for i, d in enumerate(_DTYPES)}
_HALF = (torch.float16, torch.bfloat16)
_NAMEHASH: dict[str, int] = {}


class CollectiveMismatchError(RuntimeError):
    """Ranks called a collective with different arguments; raised on every rank."""


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
            f"{', '.join(str(d) for d in _DTYPES)}"
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


def _check(tr: Any, hdrs: list[bytes], desc: Callable[[], dict[str, Any]]) -> None:
    """Raise on every rank if any header's signature differs (all ranks see all headers)."""
    mine = hdrs[0][:SIG_BYTES]
    for h in hdrs:
        if h[:SIG_BYTES] != mine:
            _mismatch(tr, desc())


def _mismatch(tr: Any, mine: dict[str, Any]) -> None:
    descs = tr.gather_objects(mine)
    diffs = []
    for key in mine:
        vals = [d.get(key) for d in descs]
        if any(v != vals[0] for v in vals):
            per = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(vals))
            diffs.append(f"{key} differs ({per})")
    what = "; ".join(diffs) or "headers differ"
    raise CollectiveMismatchError(
        f"hvdnb {mine['collective']} '{mine['name']}': ranks disagree: {what}. Every rank must "
        "call the same collectives in the same order with the same name, dtype, shape, op and "
        "root; look for rank-dependent branches or data-dependent shapes before this call."
    )


def _desc(kind: int, name: str, t: torch.Tensor, **kw: Any) -> Callable[[], dict[str, Any]]:
    def build() -> dict[str, Any]:
        d = {"collective": Kind.NAMES[kind], "name": name, "dtype": str(t.dtype),
             "shape": tuple(t.shape), "device": t.device.type}
        d.update(kw)
        return d

    return build


def _scale(t: torch.Tensor, f: float, inplace: bool) -> torch.Tensor:
    if t.is_floating_point():
        return t.mul_(f) if inplace else t * f
    # Horovod scales integers in double precision and truncates
    s = (t.double() * f).to(t.dtype)
    return t.copy_(s) if inplace else s


def _sync_done(name: str, nbytes: int, t0: float, backend: str) -> None:
    if t0:
        _lst.notify(name, nbytes, time.perf_counter() - t0, backend)


# -- handles ------------------------------------------------------------------------------
class _Handle:
    __slots__ = ("work", "finish", "result", "meta")

    def __init__(self, work: Any, finish: Callable[[], Any] | None, result: Any, meta: Any):
        self.work, self.finish, self.result, self.meta = work, finish, result, meta

    def test(self) -> bool:
        w = self.work
        if w is None:
            return True
        return bool(w.Test()) if hasattr(w, "Test") else bool(w.is_completed())

    def wait(self) -> Any:
        if self.work is not None:
            self.work.wait() if hasattr(self.work, "is_completed") else self.work.Wait()
            self.work = None
        if self.finish is not None:
            self.result, self.finish = self.finish(), None
        if self.meta is not None:
            _sync_done(*self.meta)
            self.meta = None
        return self.result


_HANDLES: dict[int, _Handle] = {}
_IDS = itertools.count(1)


def _register(h: _Handle) -> int:
    hid = next(_IDS)
    _HANDLES[hid] = h
    return hid


def poll(handle: int) -> bool:
    """Whether the async op behind ``handle`` has completed (never blocks)."""
    h = _HANDLES.get(handle)
    if h is None:
        raise ValueError(f"unknown or already synchronized handle {handle}")
    return h.test()


def synchronize(handle: int) -> Any:
    """Wait for the async op behind ``handle`` and return its result (once per handle)."""
    h = _HANDLES.pop(handle, None)
    if h is None:
        raise ValueError(f"unknown or already synchronized handle {handle}")
    return h.wait()


# -- allreduce ----------------------------------------------------------------------------
def _allreduce_start(
    tensor: torch.Tensor, inplace: bool, name: str | None, op: int | None, pre: float,
    post: float, ps: ProcessSet, nonblocking: bool, shape_key: int | None = None,
) -> _Handle:
    """Negotiate and launch one allreduce; the handle's wait() finishes it."""
    t0 = time.perf_counter() if _lst.LISTENERS else 0.0
    op = Average if op is None else op
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError(
            f"op {_OPNAMES.get(op, op)} is not supported; use hvd.Average, Sum, Min, Max or Product"
        )
    tr = _transport(ps, tensor)
    if name is None:
        name = _auto_name(ps, Kind.ALLREDUCE)
    dtype = tensor.dtype
    dcode = _dcode(tensor)
    x = tensor if tensor.is_contiguous() else tensor.contiguous()
    wire = x
    if dtype in _HALF and not x.is_cuda:
        wire = x.float()  # summed in float32, like NCCL's accumulators
    elif dtype == torch.int16 and tr.backend == "gloo":
        wire = x.int()  # gloo refuses int16
    elif dtype == torch.bool:
        wire = x.to(torch.uint8)
    if pre != 1.0:
        wire = _scale(wire, pre, inplace=wire is not tensor)
    nbytes = x.numel() * x.element_size()
    hdr = HDR.pack(
        Kind.ALLREDUCE, _nh(name), dcode, op, 0,
        hash(x.shape) if shape_key is None else shape_key, x.numel(), hash(pre), hash(post),
        0, 0, 0, 0, nbytes, 0, 0,
    )
    n = tr.size
    direct = inplace and wire is tensor
    work = None
    nbw = nbytes if wire is x else wire.numel() * wire.element_size()
    if type(tr) is MPITransport and nbw <= tr.inline:
        if not tr.exchange_inline(hdr, wire, nbw):
            _mismatch(tr, _desc(Kind.ALLREDUCE, name, tensor, op=_OPNAMES[op], prescale=pre,
                                postscale=post)())
        peer = tr.peer_view(wire.dtype, wire.shape)
        out = wire if direct else None
        if op <= Sum:
            res = torch.add(wire, peer, out=out)
        elif op == Min:
            res = torch.minimum(wire, peer, out=out)
        elif op == Max:
            res = torch.maximum(wire, peer, out=out)
        else:
            res = torch.mul(wire, peer, out=out)
    else:
        hdrs = tr.exchange(hdr)
        _check(tr, hdrs, _desc(Kind.ALLREDUCE, name, tensor, op=_OPNAMES[op], prescale=pre,
                               postscale=post))
        res = wire if direct else torch.empty_like(wire)
        work = tr.allreduce(wire, res, op, nonblocking)

    def finish() -> torch.Tensor:
        r = res
        post_eff = post
        if op == Average:
            if r.is_floating_point():
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

    meta = (name, nbytes, t0, tr.backend) if t0 else None
    if work is None:
        return _Handle(None, None, finish(), meta)
    return _Handle(work, finish, None, meta)


# -- fast paths: repeated allreduces over MPI, planned once per call site ------------------
# A call site that reduces the same tensor under the same name again and again (the common
# case) gets a plan: its header, signature and MPI arguments are built once, so a call is
# the header check and the reduction with next to no Python between them. Measured: the
# general path's ~25 small steps cost 10-25 us per call after a large reduction has
# flushed the caches, more than the header exchange itself.
_PLAN_OPS = (Average, Sum, Min, Max, Product)
_PLAN_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
                torch.uint8)
_NO_PLAN = object()
# numpy reductions of the inline path (half the cost of MPI's Reduce_local from Python);
# sums that overflow to inf are silent, as they are in MPI, NCCL and Horovod
_UFUNCS = {Average: np.add, Sum: np.add, Min: np.minimum, Max: np.maximum, Product: np.multiply}
warnings.filterwarnings("ignore", r"overflow encountered", RuntimeWarning, __name__)


def _header(t: torch.Tensor, name: str, op: int, post: float, nbytes: int,
            blocking: int = 0) -> bytes:
    """The header the general path sends for this call: ranks on either path still match.

    ``blocking`` (outside the signature) is 1 when this rank may use a blocking
    MPI_Allreduce; only when every rank says so do they all use it (see ``_run_big``).
    """
    return HDR.pack(Kind.ALLREDUCE, _nh(name), _DCODE[t.dtype], op, 0, hash(t.shape),
                    t.numel(), hash(1.0), hash(post), 0, 0, 0, 0, nbytes, blocking, 0)


_BLOCKING_AT = 14 * 8  # byte offset of the header's ``blocking`` field
_BLOCKING = (1).to_bytes(8, "little")


class _Plan:
    """A small allreduce between two ranks: one Sendrecv (header + data) and one reduction.

    Holds a numpy view of the tensor (keeping it alive while cached; the cache is bounded
    and only small tensors are planned this way).
    """

    __slots__ = ("tr", "spec", "nb", "hdr", "mine", "peer", "ufunc", "scale", "ptr", "shape",
                 "hbuf", "dt", "sig", "rsig", "rreq", "sreq")

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

    __slots__ = ("comm", "peer", "rspec", "rsig", "hdr", "hspec", "sig", "mop", "scale",
                 "buf", "mtype", "count", "desc", "tr", "in_place", "rreq", "sreq", "rblock")

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
        self.mtype = _mpi_type(MPI, t.dtype)
        self.count = t.numel()
        self.buf = [MPI.buffer.fromaddress(t.data_ptr(), nb), self.count, self.mtype]
        # what a mismatch report says, built now: a closure would keep the tensor alive
        self.desc = _desc(Kind.ALLREDUCE, name, t, op=_OPNAMES[op], prescale=1.0,
                          postscale=post)()
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
    return {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int64: MPI.INT64_T,
            torch.int32: MPI.INT32_T, torch.int16: MPI.INT16_T, torch.int8: MPI.INT8_T,
            torch.uint8: MPI.UINT8_T}[dtype]


def _plan(t: torch.Tensor, name: str, op: int, pre: float, post: float,
          ps: ProcessSet) -> _Plan | _BigPlan | None:
    tr = ps.mpi
    if (tr is None or t.is_cuda or t.dtype not in _PLAN_DTYPES or not t.is_contiguous()
            or pre != 1.0 or op not in _PLAN_OPS or tr.size < 2):
        return None
    if not t.is_floating_point() and (op == Average or post != 1.0):
        return None  # integer scaling truncates: the general path does it
    nb = t.numel() * t.element_size()
    if nb == 0:
        return None
    if nb <= tr.inline:
        return _Plan(tr, t, name, op, post)
    return _BigPlan(tr, t, name, op, post)


def _run_plan(p: _Plan, t: torch.Tensor, inplace: bool, name: str, op: int) -> torch.Tensor:
    CALLS[0] += 1
    p.rreq.Start()
    p.sreq.Start()
    p.rreq.Wait()
    p.sreq.Wait()
    if p.rsig.tobytes() != p.sig:  # 60 ns; memoryview != bytes: 290
        tr = p.tr
        _mismatch(tr, _desc(Kind.ALLREDUCE, name, t, op=_OPNAMES[op], prescale=1.0,
                            postscale=p.scale * (2 if op == Average else 1))())
    if inplace:
        p.ufunc(p.mine, p.peer, p.mine)  # positional out: no keyword parsing
        if p.scale != 1.0:
            np.multiply(p.mine, p.scale, p.mine)
        return t
    res = p.ufunc(p.mine, p.peer)
    if p.scale != 1.0:
        np.multiply(res, p.scale, out=res)
    return torch.from_numpy(res).view(p.shape)


def _run_big(p: _BigPlan, t: torch.Tensor, inplace: bool) -> torch.Tensor:
    if p.rreq is not None:  # two ranks: swap headers; a peer's inline message fits rbuf too
        # the same swap as _run_plan's, written out again on purpose: a shared helper is
        # one more Python call per allreduce, ~1 % of a 4 KB one, where the margin is thin
        CALLS[0] += 1
        p.rreq.Start()
        p.sreq.Start()
        p.rreq.Wait()
        p.sreq.Wait()
        if p.rsig.tobytes() != p.sig:  # 60 ns; memoryview != bytes: 290
            _mismatch(p.tr, p.desc)
        blocking = p.rblock.tobytes() == _BLOCKING
    else:  # the transport's own all-headers exchange
        hdrs = p.tr.exchange(p.hdr)
        if any(h[:SIG_BYTES] != p.sig for h in hdrs):
            _mismatch(p.tr, p.desc)
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
    if p.scale != 1.0:
        out.mul_(p.scale)
    return out


def _fast(t: torch.Tensor, inplace: bool, name: str | None, op: int | None, pre: float,
          post: float, ps: ProcessSet) -> torch.Tensor | None:
    """A planned path, or None when this call needs the general one."""
    if _lst.LISTENERS or name is None or t.requires_grad:
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
        return _run_plan(p, t, inplace, name, op)
    return _run_big(p, t, inplace)  # type: ignore[arg-type]


class _AllreduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, name: str | None, op: int, pre: float, post: float,
                ps: ProcessSet) -> torch.Tensor:
        ctx.args = (op, pre, post, ps)
        return _allreduce_start(t, False, name, op, pre, post, ps, False).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        g = _allreduce_start(grad.contiguous(), False, None, op, pre, post, ps, False).wait()
        return g, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor, name: str | None = None, compression: Any = None,
    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks of the process set and return the result.

    SPMD contract: every rank of ``process_set`` calls it in the same order with the same
    ``name``, shape, dtype, op and scale factors; it blocks until all ranks arrive. Ranks
    that disagree raise ``CollectiveMismatchError`` on every rank. Differentiable.

    Parameters
    ----------
    tensor : CPU or CUDA tensor of any supported dtype (half types are summed in float32)
    name : key that matches the call across ranks (auto-numbered when None)
    compression : ``Compression.none`` or ``Compression.fp16`` (wire format)
    op : ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``; Average on
        integer tensors truncates toward zero, as Horovod does
    prescale_factor, postscale_factor : multiply before / after the reduction
    process_set : the ranks taking part (default: all)

    Returns
    -------
    torch.Tensor
        A new tensor with the reduced values, same shape and dtype.
    """
    if compression is not None:
        comp, ctx = compression.compress(tensor)
        if comp is not tensor:
            out = _allreduce_start(comp, False, name, op, prescale_factor, postscale_factor,
                                   process_set, False).wait()
            return compression.decompress(out, ctx)  # type: ignore[no-any-return]
    if process_set.mpi is not None and compression is None:
        r = _fast(tensor, False, name, op, prescale_factor, postscale_factor, process_set)
        if r is not None:
            return r
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllreduceGrad.apply(tensor, name, Average if op is None else op,  # type: ignore
                                    prescale_factor, postscale_factor, process_set)
    h = _allreduce_start(tensor, False, name, op, prescale_factor, postscale_factor,
                         process_set, False)
    return h.wait()  # type: ignore[no-any-return]


def allreduce_(
    tensor: torch.Tensor, name: str | None = None, op: int | None = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """In-place ``allreduce``: ``tensor`` holds the result. Same SPMD contract."""
    if process_set.mpi is not None:
        r = _fast(tensor, True, name, op, prescale_factor, postscale_factor, process_set)
        if r is not None:
            return r
    h = _allreduce_start(tensor, True, name, op, prescale_factor, postscale_factor,
                         process_set, False)
    return h.wait()  # type: ignore[no-any-return]


def allreduce_async(
    tensor: torch.Tensor, name: str | None = None, op: int | None = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start an ``allreduce``; returns a handle for ``poll`` / ``synchronize``.

    Same SPMD contract as ``allreduce``; the header exchange happens now (so mismatches
    raise here), the data moves in the background (MPI nonblocking or NCCL/gloo async).
    Do not modify ``tensor`` before ``synchronize``.
    """
    return _register(_allreduce_start(tensor, False, name, op, prescale_factor,
                                      postscale_factor, process_set, True))


def allreduce_async_(
    tensor: torch.Tensor, name: str | None = None, op: int | None = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """In-place ``allreduce_async``: after ``synchronize`` the tensor holds the result."""
    return _register(_allreduce_start(tensor, True, name, op, prescale_factor,
                                      postscale_factor, process_set, True))


# -- grouped allreduce ------------------------------------------------------------------------
def _grouped(tensors: Sequence[torch.Tensor], inplace: bool, name: str | None, op: int | None,
             pre: float, post: float, ps: ProcessSet) -> Callable[[], list[torch.Tensor]]:
    if name is None:
        name = _auto_name(ps, Kind.ALLREDUCE)
    tensors = list(tensors)
    buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        buckets.setdefault((t.dtype, t.device), []).append(i)
    started = []
    for j, idx in enumerate(buckets.values()):
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        key = hash(tuple(tuple(tensors[i].shape) for i in idx))
        h = _allreduce_start(flat, True, f"{name}.{j}", op, pre, post, ps, True, shape_key=key)
        started.append((idx, h))

    def finish() -> list[torch.Tensor]:
        out: list[Any] = [None] * len(tensors)
        for idx, h in started:
            flat = h.wait()
            for i, part in zip(idx, flat.split([tensors[i].numel() for i in idx])):
                if inplace:
                    tensors[i].copy_(part.view(tensors[i].shape))
                    out[i] = tensors[i]
                else:
                    out[i] = part.view(tensors[i].shape)
        return out

    return finish


def grouped_allreduce(tensors: Sequence[torch.Tensor], name: str | None = None,
                      op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce a list of tensors as one fused operation; returns new tensors.

    SPMD contract: the same list (count, order, shapes, dtypes) on every rank.
    """
    return _grouped(tensors, False, name, op, prescale_factor, postscale_factor, process_set)()


def grouped_allreduce_(tensors: Sequence[torch.Tensor], name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place ``grouped_allreduce``. Same SPMD contract."""
    return _grouped(tensors, True, name, op, prescale_factor, postscale_factor, process_set)()


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Async ``grouped_allreduce``; ``synchronize`` returns the list."""
    fin = _grouped(tensors, False, name, op, prescale_factor, postscale_factor, process_set)
    return _register(_Handle(None, fin, None, None))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """Async in-place ``grouped_allreduce``."""
    fin = _grouped(tensors, True, name, op, prescale_factor, postscale_factor, process_set)
    return _register(_Handle(None, fin, None, None))


# -- allgather ------------------------------------------------------------------------------
def _allgather(tensor: torch.Tensor, name: str | None, ps: ProcessSet) -> torch.Tensor:
    t0 = time.perf_counter() if _lst.LISTENERS else 0.0
    tr = _transport(ps, tensor)
    if name is None:
        name = _auto_name(ps, Kind.ALLGATHER)
    x = tensor.contiguous()
    if x.dim() == 0:
        x = x.reshape(1)
    trailing = tuple(x.shape[1:])
    rowbytes = x[0:1].numel() * x.element_size() if x.shape[0] else (
        torch.Size(trailing).numel() * x.element_size())
    hdr = HDR.pack(Kind.ALLGATHER, _nh(name), _dcode(x), 0, 0, hash(trailing), len(trailing),
                   0, 0, 0, 0, 0, x.shape[0], 0, 0, 0)
    hdrs = tr.exchange(hdr)
    _check(tr, hdrs, _desc(Kind.ALLGATHER, name, tensor, trailing_shape=trailing))
    dims = [HDR.unpack(h)[12] for h in hdrs]
    out = torch.empty((sum(dims), *trailing), dtype=x.dtype, device=x.device)
    if out.numel():
        tr.allgatherv(x, out, [d * rowbytes for d in dims])
    _sync_done(name, x.numel() * x.element_size(), t0, tr.backend)
    return out


class _AllgatherGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, name: str | None, ps: ProcessSet) -> torch.Tensor:
        ctx.ps, ctx.dim0 = ps, t.shape[0] if t.dim() else 1
        return _allgather(t, name, ps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        g = _allreduce_start(grad.contiguous(), False, None, Sum, 1.0, 1.0, ctx.ps, False).wait()
        dims = [int(d) for d in _allgather(torch.tensor([ctx.dim0]), None, ctx.ps)]
        r = ctx.ps.rank()
        start = sum(dims[:r])
        return g[start : start + dims[r]], None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order.

    SPMD contract: same name, dtype and trailing shape (``shape[1:]``) on every rank; the
    first dimension may differ per rank, as in Horovod. Blocks until all ranks arrive.
    Differentiable.
    """
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllgatherGrad.apply(tensor, name, process_set)  # type: ignore[no-any-return]
    return _allgather(tensor, name, process_set)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """``allgather`` returning a handle (completes eagerly; ``synchronize`` returns it)."""
    return _register(_Handle(None, None, _allgather(tensor, name, process_set), None))


# -- broadcast -------------------------------------------------------------------------------
def _broadcast(tensor: torch.Tensor, root_rank: int, name: str | None, ps: ProcessSet,
               inplace: bool) -> torch.Tensor:
    t0 = time.perf_counter() if _lst.LISTENERS else 0.0
    tr = _transport(ps, tensor)
    if name is None:
        name = _auto_name(ps, Kind.BROADCAST)
    hdr = HDR.pack(Kind.BROADCAST, _nh(name), _dcode(tensor), 0, int(root_rank),
                   hash(tensor.shape), tensor.numel(), 0, 0, 0, 0, 0, 0, 0, 0, 0)
    hdrs = tr.exchange(hdr)
    _check(tr, hdrs, _desc(Kind.BROADCAST, name, tensor, root_rank=root_rank))
    if not 0 <= root_rank < tr.size:
        raise ValueError(f"root_rank {root_rank} is outside the process set (size {tr.size})")
    if inplace and tensor.is_contiguous():
        out = tensor
    else:
        out = tensor.contiguous().clone() if not inplace else tensor.contiguous()
    if out.numel():
        tr.bcast(out, root_rank)
    if inplace and out is not tensor:
        tensor.copy_(out)
        out = tensor
    _sync_done(name, tensor.numel() * tensor.element_size(), t0, tr.backend)
    return out


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return a copy of ``root_rank``'s ``tensor`` on every rank.

    SPMD contract: same name, shape, dtype and ``root_rank`` (a rank within the process
    set) on every rank; blocks until all ranks arrive.
    """
    return _broadcast(tensor, root_rank, name, process_set, False)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place ``broadcast``: ``tensor`` receives root's values. Same SPMD contract."""
    return _broadcast(tensor, root_rank, name, process_set, True)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """``broadcast`` returning a handle (completes eagerly)."""
    return _register(_Handle(None, None, _broadcast(tensor, root_rank, name, process_set,
                                                    False), None))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place ``broadcast`` returning a handle (completes eagerly)."""
    return _register(_Handle(None, None, _broadcast(tensor, root_rank, name, process_set,
                                                    True), None))


# -- alltoall --------------------------------------------------------------------------------
def _alltoall(tensor: torch.Tensor, splits: Any, name: str | None,
              ps: ProcessSet) -> tuple[torch.Tensor, torch.Tensor]:
    t0 = time.perf_counter() if _lst.LISTENERS else 0.0
    tr = _transport(ps, tensor)
    if name is None:
        name = _auto_name(ps, Kind.ALLTOALL)
    x = tensor.contiguous()
    if x.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    trailing = tuple(x.shape[1:])
    hdr = HDR.pack(Kind.ALLTOALL, _nh(name), _dcode(x), 0, 0, hash(trailing), len(trailing),
                   0, 0, 0, 0, 0, x.shape[0], 0, 0, 0)
    _check(tr, tr.exchange(hdr), _desc(Kind.ALLTOALL, name, tensor, trailing_shape=trailing))
    n = tr.size
    if splits is None:
        if x.shape[0] % n:
            raise ValueError(
                f"alltoall without splits needs dim 0 ({x.shape[0]}) divisible by {n}; "
                "pass splits=[rows for rank 0, rows for rank 1, ...]"
            )
        s = [x.shape[0] // n] * n
    else:
        s = [int(v) for v in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(s) != n or sum(s) != x.shape[0] or min(s) < 0:
            raise ValueError(
                f"splits {s} must have {n} non-negative entries summing to dim 0 ({x.shape[0]})"
            )
    rs = tr.alltoall_counts(s)
    rowbytes = torch.Size(trailing).numel() * x.element_size()
    out = torch.empty((sum(rs), *trailing), dtype=x.dtype, device=x.device)
    tr.alltoallv(x, [v * rowbytes for v in s], out, [v * rowbytes for v in rs])
    _sync_done(name, x.numel() * x.element_size(), t0, tr.backend)
    return out, torch.tensor(rs, dtype=torch.int32)


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Scatter slices of ``tensor`` (dim 0) to every rank and gather what they send.

    SPMD contract: same name, dtype and trailing shape on every rank; ``splits[i]`` rows go
    to rank i (default: equal split). Returns the received tensor, and when ``splits`` was
    given also the received splits (as Horovod does).
    """
    out, rs = _alltoall(tensor, splits, name, process_set)
    return out if splits is None else (out, rs)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """``alltoall`` returning a handle (completes eagerly)."""
    out, rs = _alltoall(tensor, splits, name, process_set)
    return _register(_Handle(None, None, out if splits is None else (out, rs), None))


# -- reducescatter -----------------------------------------------------------------------------
def reducescatter(tensor: torch.Tensor, name: str | None = None, op: int | None = None,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over ranks and return this rank's slice of dim 0.

    SPMD contract: as ``allreduce``. Rank i gets rows ``[start_i, start_i + rows_i)``, the
    first ``dim0 % size`` ranks one row more, as in Horovod. Default op: Average.
    """
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    full = _allreduce_start(tensor, False, name if name else _auto_name(
        process_set, Kind.REDUCESCATTER), op, prescale_factor, postscale_factor, process_set,
        False).wait()
    n, r = process_set.size(), process_set.rank()
    base, extra = divmod(tensor.shape[0], n)
    start = r * base + min(r, extra)
    return full[start : start + base + (1 if r < extra else 0)].clone()


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int | None = None,
                        process_set: ProcessSet = global_process_set) -> int:
    """``reducescatter`` returning a handle (completes eagerly)."""
    return _register(_Handle(None, None, reducescatter(tensor, name, op, process_set), None))


# -- barrier / join ---------------------------------------------------------------------------
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of the process set calls ``barrier``."""
    tr = _transport(process_set, torch.empty(0))
    hdr = HDR.pack(Kind.BARRIER, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    _check(tr, tr.exchange(hdr), lambda: {"collective": "barrier", "name": "barrier",
                                          "call": "barrier"})


def join(device: int = -1, process_set: ProcessSet = global_process_set) -> int:
    """Block until every rank has called ``join``; return the rank that joined last.

    Unlike Horovod, ranks that joined early do not serve other ranks' collectives with
    zeros: call ``join`` once every rank has finished its collectives.
    """
    tr = _transport(process_set, torch.empty(0))
    hdr = HDR.pack(Kind.JOIN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, time.time_ns() // 1000, 0, 0, 0)
    hdrs = tr.exchange(hdr)
    _check(tr, hdrs, lambda: {"collective": "join", "name": "join", "call": "join"})
    stamps = [HDR.unpack(h)[12] for h in hdrs]
    return stamps.index(max(stamps))
