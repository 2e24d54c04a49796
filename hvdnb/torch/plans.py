"""Planned fast paths of repeated allreduces (rank side).

Owns: the per-call-site plans (cached in ``process_sets.STATE.plans``, bounded, cleared
when transports go away): a small two-rank allreduce as one persistent exchange of header
and data plus a numpy reduction (``_Plan``), a small one among more ranks as one butterfly
round of data and check word (``_TreePlan``: no header round, Horovod's response cache
without its bit-vector collective), a larger one as a header (or check word) round then
MPI's (I)allreduce (``_BigPlan``); over torch.distributed (CUDA tensors over NCCL, CPU
tensors without mpiexec) a ``torchplans.TorchPlan``; ``planned_allreduce``, the entry
point the public allreduce tries first, and ``planned_launch``, DistributedOptimizer's
for a bucket over torch.distributed. A plan sends the very header (or its check word)
the general path (``reduce.py``) would, so ranks on either path still match; when they
differ it hands every rank's header to the general path. A planned call holds
``rounds.SERIAL`` like every other call (one thread negotiates at a time). Never: run
while async ops are queued or listeners are registered, keep a large tensor alive, or add
a Python call to the planned hot path.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

import hvdnb.torch.listeners as _lst
from hvdnb.torch.butterfly import CHECK, DATA, free_all, signature
from hvdnb.torch.process_sets import STATE, ProcessSet
from hvdnb.torch.reduce import allreduce_op
from hvdnb.torch.rounds import SERIAL, Handle, after_exchange
from hvdnb.torch.spec import (
    DCODE,
    OPNAMES,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allreduce_header,
    describe,
)
from hvdnb.torch.torchplans import TorchPlan, make_torch_plan, run_blocking, run_launch
from hvdnb.torch.transport import CALLS, HDR_BYTES, SIG_BYTES, TAG, Kind, MPITransport

__all__ = ["planned_allreduce", "planned_launch"]

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
    return allreduce_header(
        name, DCODE[t.dtype], op, hash(t.shape), t.numel(), 1.0, post, nbytes, blocking
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
        "mine_nd",
        "nb",
        "peer",
        "peer_nd",
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
        self.shape = tuple(t.shape)
        self.mine_nd, self.peer_nd = self.mine.reshape(self.shape), self.peer.reshape(self.shape)
        self.ufunc = _UFUNCS[op]
        self.scale = post / 2 if op == Average else post
        self.ptr = t.data_ptr()
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
        "csig",
        "desc",
        "div",
        "gloo",
        "hdr",
        "hspec",
        "in_place",
        "mop",
        "mtype",
        "op",
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
        self.csig = signature(hdr, CHECK)
        self.mop = tr.ops[op]
        self.op = op
        # a set across hosts: the data over gloo from this size (the general path's rule)
        self.gloo = tr.via_gloo(nb, t.dtype)
        self.scale = post / tr.size if op == Average else post
        # Average alone divides (correctly rounded, as the general path does)
        self.div = tr.size if op == Average and post == 1.0 else 0
        self.mtype = _mpi_type(MPI, t.dtype)
        self.count = t.numel()
        self.buf = [MPI.buffer.fromaddress(t.data_ptr(), nb), self.count, self.mtype]
        # what a mismatch report says, built now: a closure would keep the tensor alive
        self.desc = describe(
            Kind.ALLREDUCE, name, t, op=OPNAMES[op], prescale=1.0, postscale=post
        )()
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


class _TreePlan:
    """A small allreduce among more than two ranks: one butterfly round (``butterfly.py``)
    carrying the data and its signature's check word, no header round.

    Holds a numpy view of the tensor (small tensors only, bounded cache, like ``_Plan``)
    and its own persistent sends of the transport's staging buffer.
    """

    __slots__ = (
        "bf",
        "div",
        "hdr",
        "mine",
        "rv",
        "scale",
        "sends",
        "shape",
        "sig",
        "tr",
        "ufunc",
        "w",
    )

    def __init__(self, tr: MPITransport, t: torch.Tensor, name: str, op: int, post: float):
        bf = tr.bfly
        assert bf is not None
        self.tr, self.bf = tr, bf
        nb = t.numel() * t.element_size()
        self.hdr = _header(t, name, op, post, nb)
        self.sig = signature(self.hdr, DATA)
        self.mine = t.numpy().reshape(-1)
        self.shape = tuple(t.shape)
        self.w, self.rv = bf.views(self.mine.dtype, self.mine.size)
        self.ufunc = _UFUNCS[op]
        # Average alone divides (correctly rounded, as the general path does)
        self.div = tr.size if op == Average and post == 1.0 else 0
        self.scale = post / tr.size if op == Average else post
        self.sends = bf.make_sends(nb)

    def __del__(self) -> None:
        free_all(self.sends)


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
) -> _Plan | _TreePlan | _BigPlan | TorchPlan | None:
    if t.is_cuda or ps.mpi is None:  # over torch.distributed (torchplans.py)
        return None if ps.torch is None else make_torch_plan(ps.torch, t, name, op, pre, post)
    tr = ps.mpi
    if (
        t.dtype not in _PLAN_DTYPES
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
        return _Plan(tr, t, name, op, post) if tr.size == 2 else _TreePlan(tr, t, name, op, post)
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
    # the result in its own shape (torch.from_numpy(res) then needs no view, 1.5 us), made
    # by the ufunc itself: 0.24 us less than np.empty then out=
    res = p.ufunc(p.mine_nd, p.peer_nd)
    if not p.shape:  # a 0-d reduction gives a numpy scalar
        res = np.asarray(res)
    if p.scale != 1.0:
        np.multiply(res, p.scale, res)
    return torch.from_numpy(res)


def _run_tree(p: _TreePlan, t: torch.Tensor, inplace: bool) -> torch.Tensor | None:
    CALLS[0] += 1
    if inplace:
        res = out = p.mine
    else:  # the result's own shape: torch.from_numpy(res) then needs no view (1.5 us)
        res = np.empty(p.shape, p.mine.dtype)
        out = res if len(p.shape) == 1 else res.reshape(-1)
    if not p.bf.reduce(p.sig, p.mine, out, p.ufunc, p.sends, p.w, p.rv):
        _LAST[0] = p.bf.fallback(p.hdr)
        return None  # the caller settles the round the slow way
    if p.div:
        np.divide(out, p.div, out=out)
    elif p.scale != 1.0:
        np.multiply(out, p.scale, out=out)
    return t if inplace else torch.from_numpy(res)


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
    else:  # more ranks: a butterfly of check words alone (every rank planned: blocking)
        CALLS[0] += 1
        bf = p.tr.bfly
        assert bf is not None
        blocking = bf.check(p.csig)
        if not blocking:  # another rank sent something else: every rank's header
            hdrs = bf.fallback(p.hdr)
            if any(h[:SIG_BYTES] != p.sig for h in hdrs):
                _LAST[0] = hdrs
                return None
            blocking = all(h[_BLOCKING_AT : _BLOCKING_AT + 8] == _BLOCKING for h in hdrs)
    # MPI never matches a blocking collective with a nonblocking one, and Horovod lets
    # another rank use allreduce_async for this tensor (the general path, which always
    # goes nonblocking and says so in its header): block only when every rank can
    if p.gloo:  # a set across hosts, a large tensor: gloo moves it (MPITransport.allreduce)
        out = t if inplace else t.clone()
        p.tr.allreduce(out, out, p.op, False)
    else:
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


def planned_allreduce(
    t: torch.Tensor,
    inplace: bool,
    name: str | None,
    op: int | None,
    pre: float,
    post: float,
    ps: ProcessSet,
) -> torch.Tensor | None:
    """A planned path, or None when this call needs the general one."""
    with SERIAL:
        if _lst.LISTENERS or name is None or t.requires_grad:
            return None
        mpi = ps.mpi
        if mpi is not None:
            if mpi.pending:
                return None
        elif ps.torch is None or ps.torch.pending:
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
        r: torch.Tensor | None
        if type(p) is _Plan:  # the most frequent: small, two ranks
            r = _run_plan(p, t, inplace)
            if r is None:
                peer = p.tr.rbuf[:HDR_BYTES].tobytes()
                _LAST[0] = [p.hdr, peer] if p.tr.rank == 0 else [peer, p.hdr]
        elif type(p) is TorchPlan:
            got = run_blocking(p, t, inplace)
            if isinstance(got, list):
                _LAST[0], r = got, None
            else:
                r = got
        elif type(p) is _TreePlan:
            r = _run_tree(p, t, inplace)
        else:
            r = _run_big(p, t, inplace)
        if r is None:  # headers differed: a mistake, a queued async op or a joined peer
            hdrs, _LAST[0] = _LAST[0], None
            tr, o = allreduce_op(t, inplace, name, op, pre, post, ps, tr=p.tr)
            res: torch.Tensor = after_exchange(tr, hdrs, o).wait()
            return res
        return r


def planned_launch(
    t: torch.Tensor, name: str, op: int, pre: float, post: float, ps: ProcessSet, shape_key: int
) -> Handle | None:
    """Start a DistributedOptimizer bucket's in-place allreduce on a plan, or None.

    Only where the bucket travels over torch.distributed (CUDA buckets; CPU buckets in a
    job without mpiexec): MPI buckets keep the general path's nonblocking round.
    """
    with SERIAL:
        if _lst.LISTENERS or not (t.is_cuda or ps.mpi is None):
            return None
        tr = ps.torch
        if tr is None or tr.pending:
            return None
        key = (name, t.data_ptr(), t.dtype, shape_key, op, pre, post, ps, "launch")
        p = STATE.plans.get(key, _NO_PLAN)
        if p is _NO_PLAN:
            if len(STATE.plans) >= 256:
                STATE.plans.clear()
            p = STATE.plans[key] = make_torch_plan(tr, t, name, op, pre, post, shape_key)
        if p is None:
            return None
        h = run_launch(p, t)
        if isinstance(h, list):  # headers differed: settle the round the slow way
            _, o = allreduce_op(t, True, name, op, pre, post, ps, shape_key, tr=tr)
            return after_exchange(tr, h, o)
        return h
