"""Horovod's allreduce family: allreduce, allreduce_, their async and grouped forms.

Owns: the public allreduce API (arguments, the deprecated ``average=``, compression,
autograd), Horovod's exception names, and the choice of path per call: a planned fast
path (``plans.py``) where one applies, else the general allreduce (``reduce.py``). Every
collective is negotiated as ``rounds.py`` describes: each rank sends a header (kind, name,
dtype, shape, op, root, scales) before its data, or with it, or (more than two ranks, small
allreduces over MPI) a check word of it in the data's round, and every rank compares, so
ranks that disagree raise ``CollectiveMismatchError`` on every rank instead of hanging.
Re-exports the op constants (``spec.py``) and ``poll`` / ``synchronize``
(``handles.py``) under Horovod's names. Never: reduce half types in half precision (they
are summed in float32), call ``cuda.synchronize``, or skip the check of the header. The
other collectives live in ``collectives.py``.

Transport per tensor: CUDA tensors go through torch.distributed (NCCL); CPU tensors through
MPI when the job was started by mpiexec, otherwise gloo.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from hvdnb.rank.elastic import HorovodInternalError, HostsUpdatedInterrupt
from hvdnb.torch.handles import Group, poll, register, submit, synchronize
from hvdnb.torch.plans import planned_allreduce
from hvdnb.torch.process_sets import ProcessSet, global_process_set
from hvdnb.torch.reduce import allreduce_launch, allreduce_op
from hvdnb.torch.rounds import CollectiveMismatchError
from hvdnb.torch.spec import Adasum, Average, Max, Min, Product, Sum, grouped_names
from hvdnb.torch.transport import Kind

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
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "poll",
    "synchronize",
]


def resolve_op(op: int | None, average: bool | None) -> int:
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
        out: torch.Tensor = allreduce_launch(t, False, name, op, pre, post, ps).wait()
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        g = allreduce_launch(grad.contiguous(), False, None, op, pre, post, ps).wait()
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
    op = (Average if op is None else int(op)) if average is None else resolve_op(op, average)
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
            dec: torch.Tensor = compression.decompress(out, ctx)
            return dec
    r = planned_allreduce(tensor, False, name, op, prescale_factor, postscale_factor, process_set)
    if r is not None:
        return r
    if tensor.requires_grad and torch.is_grad_enabled():
        # torch.autograd.Function.apply is unannotated
        grad: torch.Tensor = _AllreduceGrad.apply(  # type: ignore[no-untyped-call]
            tensor, name, op, prescale_factor, postscale_factor, process_set
        )
        return grad
    res: torch.Tensor = allreduce_launch(
        tensor, False, name, op, prescale_factor, postscale_factor, process_set
    ).wait()
    return res


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
    # resolve_op inline for the common call (no average=): one Python call less per call
    op = (Average if op is None else int(op)) if average is None else resolve_op(op, average)
    r = planned_allreduce(tensor, True, name, op, prescale_factor, postscale_factor, process_set)
    if r is not None:
        return r
    res: torch.Tensor = allreduce_launch(
        tensor, True, name, op, prescale_factor, postscale_factor, process_set
    ).wait()
    return res


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
    tr, o = allreduce_op(tensor, inplace, name, resolve_op(op, average), pre, post, ps)
    return submit(tr, o)


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
    """In-place ``allreduce_async``: after ``synchronize`` the tensor holds the result.

    SPMD contract: as ``allreduce`` (every rank, the same name, shapes and dtypes),
    except that ranks may queue async ops in their own order: they are matched by
    name. Every rank must reach ``synchronize`` (or another collective) on the
    process set, which blocks until all ranks have arrived.
    """
    return _allreduce_async(
        tensor, True, average, name, op, prescale_factor, postscale_factor, process_set
    )


# -- grouped allreduce --------------------------------------------------------------------
def _grouped(
    tensors: Sequence[torch.Tensor],
    inplace: bool,
    average: bool | None,
    name: str | None,
    op: int | None,
    pre: float,
    post: float,
    ps: ProcessSet,
    is_async: bool,
) -> Any:
    op = resolve_op(op, average)
    tensors = list(tensors)
    if len({t.device for t in tensors}) > 1:
        raise RuntimeError(  # Horovod raises RuntimeError here (a fatal op error)
            "grouped_allreduce: every tensor of a group must be on one device; reduce CPU "
            "and GPU tensors in separate groups"
        )
    names = grouped_names(ps, name, Kind.ALLREDUCE, len(tensors))
    if (
        not is_async
        and not inplace
        and torch.is_grad_enabled()
        and any(t.requires_grad for t in tensors)
    ):
        return [
            allreduce(t, name=nm, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps)
            for t, nm in zip(tensors, names)
        ]
    if is_async:
        ids = []
        for t, nm in zip(tensors, names):
            tr, o = allreduce_op(t, inplace, nm, op, pre, post, ps)
            ids.append(submit(tr, o))
        return register(Group(ids))
    hs = [allreduce_launch(t, inplace, nm, op, pre, post, ps) for t, nm in zip(tensors, names)]
    return [h.wait() for h in hs]


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Allreduce a list of tensors as one group; returns new tensors. Differentiable.

    SPMD contract: the same list (count, order, shapes, dtypes) and name on every rank.
    """
    if compression is not None:
        packed = [compression.compress(t) for t in tensors]
        outs = _grouped(
            [c for c, _ in packed],
            False,
            average,
            name,
            op,
            prescale_factor,
            postscale_factor,
            process_set,
            False,
        )
        return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed)]
    out: list[torch.Tensor] = _grouped(
        tensors, False, average, name, op, prescale_factor, postscale_factor, process_set, False
    )
    return out


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """In-place ``grouped_allreduce``. Same SPMD contract."""
    out: list[torch.Tensor] = _grouped(
        tensors, True, average, name, op, prescale_factor, postscale_factor, process_set, False
    )
    return out


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Queue a ``grouped_allreduce``; ``synchronize`` returns the list.

    SPMD contract: as ``grouped_allreduce`` (every rank, the same name, shapes and dtypes),
    except that ranks may queue async ops in their own order: they are matched by
    name. Every rank must reach ``synchronize`` (or another collective) on the
    process set, which blocks until all ranks have arrived.
    """
    hid: int = _grouped(
        tensors, False, average, name, op, prescale_factor, postscale_factor, process_set, True
    )
    return hid


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Queue an in-place ``grouped_allreduce``.

    SPMD contract: as ``grouped_allreduce`` (every rank, the same name, shapes and dtypes),
    except that ranks may queue async ops in their own order: they are matched by
    name. Every rank must reach ``synchronize`` (or another collective) on the
    process set, which blocks until all ranks have arrived.
    """
    hid: int = _grouped(
        tensors, True, average, name, op, prescale_factor, postscale_factor, process_set, True
    )
    return hid
