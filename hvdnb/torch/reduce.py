"""The general allreduce: one call turned into a negotiated ``Op`` and its data phase.

Owns: the semantics every allreduce path shares (Average on integers truncates and on
floats divides, pre/post scaling, Horovod's 16-bit scaling on CUDA, wire dtypes where a
transport refuses a type, Adasum's gather and combination, the one-message form of small
allreduces over MPI, NCCL's own timing for the listeners), ``allreduce_op`` (the
transport and Op of one call) and ``allreduce_launch`` (negotiate now, start the data).
Used by the public allreduce family (``ops.py``), the planned paths' fallback
(``plans.py``), reducescatter and the gradients of the other collectives
(``collectives.py``) and DistributedOptimizer's buckets. Never: reduce half types in half
precision, call ``cuda.synchronize``, or skip the check of the header's signature (sent
ahead of the data, with it, or as its hash in the data's round).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import hvdnb.torch.listeners as _lst
from hvdnb.torch.adasum import adasum_tree
from hvdnb.torch.process_sets import ProcessSet
from hvdnb.torch.rounds import Handle, Op, blocking, wire_dtype
from hvdnb.torch.spec import (
    OPNAMES,
    Adasum,
    Average,
    Max,
    Min,
    Sum,
    allreduce_header,
    auto_name,
    describe,
    dtype_code,
    transport_for,
)
from hvdnb.torch.timing import NcclSeconds
from hvdnb.torch.transport import HDR_BYTES, Kind, MPITransport

__all__ = ["allreduce_launch", "allreduce_op"]


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


def _meta(name: str, nbytes: int, backend: str) -> Any:
    return (name, nbytes, backend) if _lst.LISTENERS else None


def _check_op(op: int) -> None:
    if op not in OPNAMES:
        raise ValueError(
            f"op {op!r} is not an hvd op; use hvd.Average, Sum, Adasum, Min, Max or Product"
        )


def allreduce_op(
    tensor: torch.Tensor,
    inplace: bool,
    name: str | None,
    op: int,
    pre: float,
    post: float,
    ps: ProcessSet,
    shape_key: int | None = None,
    tr: Any = None,
    divide: bool = True,
) -> tuple[Any, Op]:
    """Build one allreduce: (transport, Op).

    ``divide=False`` (DistributedOptimizer's CPU buckets): an Average of floats with no
    scaling leaves the sum undivided; the caller divides by the set's size as it copies the
    result out (one pass over the data instead of two). The header still says Average.

    Small tensors over MPI: the Op gets an ``inline`` attempt that sends the data with its
    check in one round (two ranks: header and data in one message; more: the butterfly
    with a check prefix) and returns the finished Handle, or every rank's header when
    they differed (the round is then settled with the op's regular data phase).
    """
    _check_op(op)
    if tr is None:
        tr = transport_for(ps, tensor)
    if name is None:
        name = auto_name(ps, Kind.ALLREDUCE)
    dtype = tensor.dtype
    dcode = dtype_code(tensor)
    x = tensor if tensor.is_contiguous() else tensor.contiguous()
    wd = wire_dtype(dtype, tr.backend, x.is_cuda)
    wire = x if wd == dtype else x.to(wd)
    if op == Adasum:
        _check_adasum(wire, dtype, tr.size)
    if pre != 1.0:
        wire = _scale(wire, pre, inplace=wire is not tensor)
    nbytes = x.numel() * x.element_size()
    key = hash(x.shape) if shape_key is None else shape_key
    hdr = allreduce_header(name, dcode, op, key, x.numel(), pre, post, nbytes)
    n, backend = tr.size, tr.backend
    if isinstance(tr, MPITransport):  # a set across hosts moves large ones over gloo
        backend = tr.data_backend(wire.numel() * wire.element_size(), wire.dtype)
    direct = inplace and wire is tensor

    def finish(r: torch.Tensor) -> torch.Tensor:
        return _finish(r, tensor, op, post, n, divide, inplace)

    def start(hdrs: list[bytes]) -> Handle:
        if op == Adasum:
            res = _adasum(tr, wire, n)
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

    desc = describe(Kind.ALLREDUCE, name, tensor, op=OPNAMES[op], prescale=pre, postscale=post)
    o = Op(name, hdr, desc, start)
    nbw = wire.numel() * wire.element_size()

    def inline() -> Any:
        if n > 2:  # the butterfly: data and check in one round, no header round
            res = wire if direct else torch.empty_like(wire)
            hdrs = tr.reduce_inline(hdr, wire, res, op)
            if hdrs is not None:
                return hdrs
            return Handle(None, None, finish(res), _meta(name, nbytes, backend))
        if not tr.exchange_inline(hdr, wire, nbw):
            peer = tr.rbuf[:HDR_BYTES].tobytes()
            return [hdr, peer] if tr.rank == 0 else [peer, hdr]
        peer_t = tr.peer_view(wire.dtype, wire.shape)
        res = _combine(op, wire, peer_t, wire if direct else None)
        return Handle(None, None, finish(res), _meta(name, nbytes, backend))

    if type(tr) is MPITransport and nbw <= tr.inline and tr.inline and op != Adasum:
        o.inline = inline
    return tr, o


def _finish(
    r: torch.Tensor,
    tensor: torch.Tensor,
    op: int,
    post: float,
    n: int,
    divide: bool,
    inplace: bool,
) -> torch.Tensor:
    """An allreduce's result ``r`` (the sum, on the wire's dtype) as the op's answer: the
    Average's division, the postscale, and the copy into ``tensor`` (``inplace``) or the
    conversion back to its dtype."""
    dtype = tensor.dtype
    post_eff = post
    if r.dtype != dtype and r.is_floating_point() and (op == Average or post != 1.0):
        # a 16-bit float summed on a float32 wire: Horovod's sum is in the float's own
        # type, then scaled in float32; at 3 ranks the unrounded sum differed in the last
        # bit on some ranks only, and Horovod's suite (exact up to 3 ranks) left those
        # ranks' loops early, one collective out of step with the others
        r.copy_(r.to(dtype))
    if op == Average:
        if r.is_floating_point():
            if post == 1.0:
                if n > 1 and divide:  # x / 1 is x: one rank launches no kernel
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


def _combine(
    op: int, mine: torch.Tensor, peer: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor:
    """Two ranks' tensors reduced by ``op`` (the 2-rank inline path), into ``out`` if given."""
    if op <= Sum:
        return torch.add(mine, peer, out=out)
    if op == Min:
        return torch.minimum(mine, peer, out=out)
    if op == Max:
        return torch.maximum(mine, peer, out=out)
    return torch.mul(mine, peer, out=out)


def _check_adasum(wire: torch.Tensor, dtype: torch.dtype, size: int) -> None:
    """Adasum's preconditions (checked once per call, before any round)."""
    if not wire.is_floating_point():
        raise ValueError(f"Adasum needs a floating point tensor, not {dtype}")
    if size & (size - 1):
        raise NotImplementedError(
            f"Adasum needs a power-of-two number of ranks (this process set has "
            f"{size}): its pairwise combination tree, like Horovod's, has no rule "
            "for an unpaired rank"
        )


def _adasum(tr: Any, wire: torch.Tensor, n: int) -> torch.Tensor:
    """Adasum of ``wire`` over the ``n`` ranks: every rank's tensor, then the pairwise tree."""
    parts = torch.empty((n, wire.numel()), dtype=wire.dtype)
    tr.allgatherv(wire, parts, [wire.numel() * wire.element_size()] * n)
    return adasum_tree(parts).view(wire.shape)


def _nccl_timed(
    tr: Any,
    wire: torch.Tensor,
    res: torch.Tensor,
    op: int,
    finish: Callable[[torch.Tensor], Any],
    meta: Any,
) -> Handle:
    """NCCL, its own kernel time read later from the Work (never here)."""
    work = tr.allreduce(wire, res, op, True)
    h = Handle(work, lambda: finish(res), None, meta)
    h.cuda = NcclSeconds(work)
    return h


def allreduce_launch(
    tensor: torch.Tensor,
    inplace: bool,
    name: str | None,
    op: int,
    pre: float,
    post: float,
    ps: ProcessSet,
    shape_key: int | None = None,
    divide: bool = True,
) -> Handle:
    """Negotiate now and start the data phase (the caller waits on the Handle)."""
    tr, o = allreduce_op(tensor, inplace, name, op, pre, post, ps, shape_key, divide=divide)
    return blocking(tr, o)
