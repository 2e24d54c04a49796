"""Horovod's other collectives: allgather, broadcast, alltoall, reducescatter, their grouped
and async forms, sparse allreduce, barrier and join.

Owns: their semantics (shapes, splits, which ranks get which rows, gradients) on top of the
negotiation in ``rounds.py``, the call helpers in ``spec.py`` and the general allreduce in
``reduce.py`` (reducescatter, and the gradients that average). Every blocking call
negotiates its header (so ranks that disagree raise on every rank); every ``*_async`` call
queues its op and returns a handle (``handles.py``). Never: move data before the round
agreed, or raise a local argument error after the header went out (arguments are checked
first, identically on every rank that passes the same arguments).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import hvdnb.torch.listeners as _lst
from hvdnb.torch.basics import rank
from hvdnb.torch.handles import Group, register, submit, synchronize
from hvdnb.torch.process_sets import ProcessSet, global_process_set
from hvdnb.torch.reduce import allreduce_launch, allreduce_op
from hvdnb.torch.rounds import Handle, Op, blocking, join_round
from hvdnb.torch.spec import (
    Adasum,
    Average,
    Sum,
    auto_name,
    describe,
    dtype_code,
    grouped_names,
    name_hash,
    transport_for,
)
from hvdnb.torch.transport import HDR, Kind

__all__ = [
    "allgather",
    "allgather_async",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "reducescatter",
    "reducescatter_async",
    "sparse_allreduce_async",
]


def _done(name: str, nbytes: int, t0: float, backend: str) -> None:
    """Report a collective that ran inside one blocking call started at ``t0``."""
    if t0:
        dt = time.perf_counter() - t0
        _lst.notify(name, nbytes, dt, backend, dt)


# -- allgather ------------------------------------------------------------------------------
def _allgather_op(tensor: torch.Tensor, name: str | None, ps: ProcessSet) -> tuple[Any, Op]:
    tr = transport_for(ps, tensor)
    if name is None:
        name = auto_name(ps, Kind.ALLGATHER)
    x = tensor.contiguous()
    if x.dim() == 0:
        x = x.reshape(1)
    trailing = tuple(x.shape[1:])
    rowbytes = torch.Size(trailing).numel() * x.element_size()
    hdr = HDR.pack(
        Kind.ALLGATHER,
        name_hash(name),
        dtype_code(x),
        0,
        0,
        hash(trailing),
        len(trailing),
        0,
        0,
        0,
        0,
        0,
        x.shape[0],
        0,
        0,
        0,
    )

    def start(hdrs: list[bytes]) -> Handle:
        dims = [HDR.unpack(h)[12] for h in hdrs]
        out = torch.empty((sum(dims), *trailing), dtype=x.dtype, device=x.device)
        if out.numel():
            tr.allgatherv(x, out, [d * rowbytes for d in dims])
        return Handle(None, None, out)

    return tr, Op(name, hdr, describe(Kind.ALLGATHER, name, tensor, trailing_shape=trailing), start)


def _allgather(tensor: torch.Tensor, name: str | None, ps: ProcessSet) -> torch.Tensor:
    t0 = time.perf_counter() if _lst.LISTENERS else 0.0
    tr, o = _allgather_op(tensor, name, ps)
    out: torch.Tensor = blocking(tr, o).wait()
    _done(o.name, tensor.numel() * tensor.element_size(), t0, tr.backend)
    return out


class _AllgatherGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, name: str | None, ps: ProcessSet) -> torch.Tensor:
        ctx.ps, ctx.dim0 = ps, t.shape[0] if t.dim() else 1
        return _allgather(t, name, ps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # Horovod averages the incoming gradients (each rank holds the whole output)
        g = allreduce_launch(grad.contiguous(), False, None, Average, 1.0, 1.0, ctx.ps).wait()
        dims = [int(d) for d in _allgather(torch.tensor([ctx.dim0]), None, ctx.ps)]
        r = ctx.ps.rank()
        start = sum(dims[:r])
        return g[start : start + dims[r]], None, None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order.

    SPMD contract: same name, dtype and trailing shape (``shape[1:]``) on every rank; the
    first dimension may differ per rank, as in Horovod. Blocks until all ranks arrive.
    Differentiable.
    """
    if tensor.requires_grad and torch.is_grad_enabled():
        # torch.autograd.Function.apply is unannotated
        out: torch.Tensor = _AllgatherGrad.apply(  # type: ignore[no-untyped-call]
            tensor, name, process_set
        )
        return out
    return _allgather(tensor, name, process_set)


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Queue an ``allgather``; ``synchronize`` returns the gathered tensor.

    SPMD contract: as ``allgather`` (every rank, the same name, shapes and dtypes),
    except that ranks may queue async ops in their own order: they are matched by
    name. Every rank must reach ``synchronize`` (or another collective) on the
    process set, which blocks until all ranks have arrived.
    """
    tr, o = _allgather_op(tensor, name, process_set)
    return submit(tr, o)


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """``allgather`` of each tensor of a list, as one group. Differentiable.

    SPMD contract: the same number of tensors, dtypes and trailing shapes on every rank.
    """
    names = grouped_names(process_set, name, Kind.ALLGATHER, len(tensors))
    return [allgather(t, nm, process_set) for t, nm in zip(tensors, names)]


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Queue a ``grouped_allgather``; ``synchronize`` returns the list.

    SPMD contract: as ``grouped_allgather`` (every rank, the same name, shapes and dtypes),
    except that ranks may queue async ops in their own order: they are matched by
    name. Every rank must reach ``synchronize`` (or another collective) on the
    process set, which blocks until all ranks have arrived.
    """
    names = grouped_names(process_set, name, Kind.ALLGATHER, len(tensors))
    return register(Group([allgather_async(t, nm, process_set) for t, nm in zip(tensors, names)]))


# -- broadcast -------------------------------------------------------------------------------
def _broadcast_op(
    tensor: torch.Tensor, root_rank: int, name: str | None, ps: ProcessSet, inplace: bool
) -> tuple[Any, Op]:
    tr = transport_for(ps, tensor)
    if name is None:
        name = auto_name(ps, Kind.BROADCAST)
    hdr = HDR.pack(
        Kind.BROADCAST,
        name_hash(name),
        dtype_code(tensor),
        0,
        int(root_rank),
        hash(tensor.shape),
        tensor.numel(),
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
    )

    ranks = ps.ranks if ps.ranks is not None else list(range(tr.size))

    def start(hdrs: list[bytes]) -> Handle:
        if root_rank not in ranks:  # Horovod's root_rank is a global rank, also in a set
            raise ValueError(f"root_rank {root_rank} is outside the process set {ranks}")
        root = ranks.index(root_rank)
        if inplace and tensor.is_contiguous():
            out = tensor
        else:
            out = tensor.contiguous().clone() if not inplace else tensor.contiguous()
        if out.numel():
            tr.bcast(out, root)
        if inplace and out is not tensor:
            tensor.copy_(out)
            out = tensor
        return Handle(None, None, out)

    return tr, Op(name, hdr, describe(Kind.BROADCAST, name, tensor, root_rank=root_rank), start)


def _broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None, ps: ProcessSet, inplace: bool
) -> torch.Tensor:
    t0 = time.perf_counter() if _lst.LISTENERS else 0.0
    tr, o = _broadcast_op(tensor, root_rank, name, ps, inplace)
    out: torch.Tensor = blocking(tr, o).wait()
    _done(o.name, tensor.numel() * tensor.element_size(), t0, tr.backend)
    return out


class _BroadcastGrad(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, t: torch.Tensor, root: int, name: str | None, ps: ProcessSet
    ) -> torch.Tensor:
        ctx.root, ctx.ps = root, ps
        return _broadcast(t, root, name, ps, False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # every rank's output came from root: root's input gets the (Horovod: averaged)
        # incoming gradient, the others zero
        g = allreduce_launch(grad.contiguous(), False, None, Average, 1.0, 1.0, ctx.ps).wait()
        if rank() != ctx.root:
            g = g * 0
        return g, None, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Return a copy of ``root_rank``'s ``tensor`` on every rank. Differentiable.

    SPMD contract: same name, shape, dtype and ``root_rank`` on every rank; ``root_rank``
    is a global rank (as in Horovod), a member of ``process_set``. Blocks until all ranks
    arrive.
    """
    if tensor.requires_grad and torch.is_grad_enabled():
        # torch.autograd.Function.apply is unannotated
        out: torch.Tensor = _BroadcastGrad.apply(  # type: ignore[no-untyped-call]
            tensor, root_rank, name, process_set
        )
        return out
    return _broadcast(tensor, root_rank, name, process_set, False)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """In-place ``broadcast``: ``tensor`` receives root's values. Same SPMD contract."""
    return _broadcast(tensor, root_rank, name, process_set, True)


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Queue a ``broadcast``; ``synchronize`` returns root's tensor.

    SPMD contract: as ``broadcast`` (every rank, the same name, shapes and dtypes),
    except that ranks may queue async ops in their own order: they are matched by
    name. Every rank must reach ``synchronize`` (or another collective) on the
    process set, which blocks until all ranks have arrived.
    """
    tr, o = _broadcast_op(tensor, root_rank, name, process_set, False)
    return submit(tr, o)


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Queue an in-place ``broadcast``; ``tensor`` holds root's values after ``synchronize``.

    SPMD contract: as ``broadcast`` (every rank, the same name, shapes and dtypes),
    except that ranks may queue async ops in their own order: they are matched by
    name. Every rank must reach ``synchronize`` (or another collective) on the
    process set, which blocks until all ranks have arrived.
    """
    tr, o = _broadcast_op(tensor, root_rank, name, process_set, True)
    return submit(tr, o)


# -- alltoall --------------------------------------------------------------------------------
def _alltoall_op(
    tensor: torch.Tensor, splits: Any, name: str | None, ps: ProcessSet
) -> tuple[Any, Op]:
    tr = transport_for(ps, tensor)
    x = tensor.contiguous()
    if x.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    n = tr.size
    if splits is None:
        if x.shape[0] % n:
            raise ValueError(
                f"alltoall without splits needs dim 0 ({x.shape[0]}) divisible by {n}; "
                "pass splits=[rows for rank 0, rows for rank 1, ...]"
            )
        s = [x.shape[0] // n] * n
    else:
        if isinstance(splits, torch.Tensor) and (splits.is_floating_point() or splits.is_complex()):
            raise ValueError(f"alltoall splits must be integers, not {splits.dtype}")
        s = [int(v) for v in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(s) != n or sum(s) != x.shape[0] or min(s) < 0:
            raise ValueError(
                f"splits {s} must have {n} non-negative entries summing to dim 0 ({x.shape[0]})"
            )
    if name is None:
        name = auto_name(ps, Kind.ALLTOALL)
    trailing = tuple(x.shape[1:])
    hdr = HDR.pack(
        Kind.ALLTOALL,
        name_hash(name),
        dtype_code(x),
        0,
        0,
        hash(trailing),
        len(trailing),
        0,
        0,
        0,
        0,
        0,
        x.shape[0],
        0,
        0,
        0,
    )

    # received splits where the splits were (Horovod: a CUDA splits tensor gets CUDA ones)
    sdev = splits.device if isinstance(splits, torch.Tensor) else torch.device("cpu")

    def start(hdrs: list[bytes]) -> Handle:
        rs = tr.alltoall_counts(s)
        rowbytes = torch.Size(trailing).numel() * x.element_size()
        out = torch.empty((sum(rs), *trailing), dtype=x.dtype, device=x.device)
        tr.alltoallv(x, [v * rowbytes for v in s], out, [v * rowbytes for v in rs])
        return Handle(None, None, (out, torch.tensor(rs, dtype=torch.int32, device=sdev)))

    return tr, Op(name, hdr, describe(Kind.ALLTOALL, name, tensor, trailing_shape=trailing), start)


def _alltoall(
    tensor: torch.Tensor, splits: Any, name: str | None, ps: ProcessSet
) -> tuple[torch.Tensor, torch.Tensor]:
    t0 = time.perf_counter() if _lst.LISTENERS else 0.0
    tr, o = _alltoall_op(tensor, splits, name, ps)
    out: tuple[torch.Tensor, torch.Tensor] = blocking(tr, o).wait()
    _done(o.name, tensor.numel() * tensor.element_size(), t0, tr.backend)
    return out


class _AlltoallGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, splits: Any, name: str | None, ps: ProcessSet) -> Any:
        out, rs = _alltoall(t, splits, name, ps)
        ctx.rs, ctx.ps = rs, ps
        ctx.mark_non_differentiable(rs)
        return out, rs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _g: Any) -> Any:
        g, _ = _alltoall(grad.contiguous(), ctx.rs, None, ctx.ps)
        return g, None, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Scatter slices of ``tensor`` (dim 0) to every rank and gather what they send.

    SPMD contract: same name, dtype and trailing shape on every rank; ``splits[i]`` rows go
    to rank i (default: equal split). Returns the received tensor, and when ``splits`` was
    given also the received splits (as Horovod does). Differentiable.
    """
    if tensor.requires_grad and torch.is_grad_enabled():
        # torch.autograd.Function.apply is unannotated
        out, rs = _AlltoallGrad.apply(  # type: ignore[no-untyped-call]
            tensor, splits, name, process_set
        )
    else:
        out, rs = _alltoall(tensor, splits, name, process_set)
    return out if splits is None else (out, rs)


def alltoall_async(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Queue an ``alltoall``; ``synchronize`` returns what ``alltoall`` would.

    SPMD contract: as ``alltoall`` (every rank, the same name, shapes and dtypes),
    except that ranks may queue async ops in their own order: they are matched by
    name. Every rank must reach ``synchronize`` (or another collective) on the
    process set, which blocks until all ranks have arrived.
    """
    tr, o = _alltoall_op(tensor, splits, name, process_set)
    return submit(tr, o, (lambda r: r[0]) if splits is None else None)


# -- reducescatter -----------------------------------------------------------------------------
def _rows(dim0: int, n: int, r: int) -> slice:
    base, extra = divmod(dim0, n)
    start = r * base + min(r, extra)
    return slice(start, start + base + (1 if r < extra else 0))


def _reducescatter_op(
    tensor: torch.Tensor, name: str | None, op: int, pre: float, post: float, ps: ProcessSet
) -> tuple[Any, Op, Callable[[Any], Any]]:
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    if op == Adasum:
        raise NotImplementedError("reducescatter does not support Adasum (nor does Horovod)")
    tr, o = allreduce_op(
        tensor, False, name or auto_name(ps, Kind.REDUCESCATTER), op, pre, post, ps
    )
    o.hdr = Kind.REDUCESCATTER.to_bytes(8, "little") + o.hdr[8:]
    o.inline = None  # its one-message form would send the allreduce header
    rows = _rows(tensor.shape[0], tr.size, tr.rank)
    return tr, o, lambda full: full[rows].clone()


class _ReducescatterGrad(torch.autograd.Function):
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
        # Horovod's gradient: the gathered incoming gradients, times size for Sum (each
        # rank's loss is taken as the same average over ranks as Average's)
        ctx.scale = pre * post * (1 if op == Average else ps.size())
        ctx.ps = ps
        tr, o, cut = _reducescatter_op(t, name, op, pre, post, ps)
        out: torch.Tensor = cut(blocking(tr, o).wait())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        g = _allgather(grad.contiguous(), None, ctx.ps)
        return g * ctx.scale, None, None, None, None, None


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce ``tensor`` over ranks and return this rank's slice of dim 0. Differentiable.

    SPMD contract: as ``allreduce``. Rank i gets rows ``[start_i, start_i + rows_i)``, the
    first ``dim0 % size`` ranks one row more, as in Horovod. Default op: Average; Adasum is
    refused (NotImplementedError, on every rank).
    """
    if compression is not None:
        comp, ctx = compression.compress(tensor)
        if comp is not tensor:
            part = reducescatter(
                comp, name, None, op, process_set, prescale_factor, postscale_factor
            )
            dec: torch.Tensor = compression.decompress(part, ctx)
            return dec
    if tensor.requires_grad and torch.is_grad_enabled():
        # torch.autograd.Function.apply is unannotated
        grad: torch.Tensor = _ReducescatterGrad.apply(  # type: ignore[no-untyped-call]
            tensor, name, op, prescale_factor, postscale_factor, process_set
        )
        return grad
    t0 = time.perf_counter() if _lst.LISTENERS else 0.0
    tr, o, cut = _reducescatter_op(tensor, name, op, prescale_factor, postscale_factor, process_set)
    out: torch.Tensor = cut(blocking(tr, o).wait())
    _done(o.name, tensor.numel() * tensor.element_size(), t0, tr.backend)
    return out


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Queue a ``reducescatter``; ``synchronize`` returns this rank's rows.

    SPMD contract: as ``reducescatter`` (every rank, the same name, shapes and dtypes),
    except that ranks may queue async ops in their own order: they are matched by
    name. Every rank must reach ``synchronize`` (or another collective) on the
    process set, which blocks until all ranks have arrived.
    """
    tr, o, cut = _reducescatter_op(tensor, name, op, prescale_factor, postscale_factor, process_set)
    return submit(tr, o, cut)


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: Any = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """``reducescatter`` of each tensor of a list, as one group. Same SPMD contract."""
    names = grouped_names(process_set, name, Kind.REDUCESCATTER, len(tensors))
    return [
        reducescatter(t, nm, compression, op, process_set, prescale_factor, postscale_factor)
        for t, nm in zip(tensors, names)
    ]


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Queue a ``grouped_reducescatter``; ``synchronize`` returns the list.

    SPMD contract: as ``grouped_reducescatter`` (every rank, the same name, shapes and dtypes),
    except that ranks may queue async ops in their own order: they are matched by
    name. Every rank must reach ``synchronize`` (or another collective) on the
    process set, which blocks until all ranks have arrived.
    """
    names = grouped_names(process_set, name, Kind.REDUCESCATTER, len(tensors))
    return register(
        Group(
            [
                reducescatter_async(t, nm, op, process_set, prescale_factor, postscale_factor)
                for t, nm in zip(tensors, names)
            ]
        )
    )


# -- sparse ------------------------------------------------------------------------------------
def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: int, process_set: ProcessSet = global_process_set
) -> Callable[[], Any]:
    """Allreduce a sparse COO tensor by gathering every rank's indices and values.

    Returns a function (Horovod's contract): calling it waits and returns the sparse sum
    (or average, ``op=Average``) with the dense shape of ``tensor``. Average and Sum only.
    """
    if op not in (Average, Sum):
        raise ValueError("sparse_allreduce_async supports op=hvd.Average or hvd.Sum")
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    idx = allgather_async(t.indices().t().contiguous(), f"{name}.indices", process_set)
    val = allgather_async(t.values().contiguous(), f"{name}.values", process_set)

    def wait() -> torch.Tensor:
        values = synchronize(val)
        indices = synchronize(idx)
        if op == Average:
            values = values / process_set.size()
        return torch.sparse_coo_tensor(indices.t(), values, t.shape)

    return wait


# -- barrier / join ---------------------------------------------------------------------------
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of the process set calls ``barrier``."""
    tr = transport_for(process_set, torch.empty(0))
    hdr = HDR.pack(Kind.BARRIER, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    blocking(
        tr,
        Op(
            "barrier",
            hdr,
            lambda: {"collective": "barrier", "name": "barrier"},
            lambda hdrs: Handle(None, None, None),
        ),
    ).wait()


def join(device: int = -1, process_set: ProcessSet = global_process_set) -> int:
    """Wait until every rank has joined; return the (global) rank that joined last.

    Until then this rank serves the others' collectives as Horovod does: it contributes
    zeros to their allreduces (Average still divides by the full size), and any other
    collective raises on the ranks that called it. The same value on every rank; ties
    (ranks that joined in the same round) go to the highest rank. ``device`` is accepted
    for Horovod compatibility.
    """
    tr = transport_for(process_set, torch.empty(0))
    served = 0
    while True:
        last = join_round(tr, served)
        if last is not None:
            ranks = process_set.ranks if process_set.ranks is not None else list(range(tr.size))
            return int(ranks[last])
        served += 1
