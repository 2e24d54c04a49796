"""Planned fast path of repeated allreduces over torch.distributed (rank side).

Owns: ``TorchPlan``, the plan of a call site whose tensor travels over torch.distributed
(CUDA tensors over NCCL; CPU tensors over gloo in a job started without mpiexec), and its
two runs: ``run_blocking`` (``hvd.allreduce`` / ``allreduce_``) and ``run_launch`` (a
DistributedOptimizer bucket: started now, waited in ``synchronize``). A plan builds the
header once, so a call is the very header exchange the general path (``reduce.py``) makes,
then one ``dist.all_reduce``: no Op, no closures, no description. With one rank there is no
exchange at all. When the headers differ (a mistake, a joined rank, a queued async op
elsewhere) every rank's headers go back to the general path, which settles the round and
raises Horovod's error on every rank. Never: hold the tensor (the key has its address),
plan a call that needs a wire dtype, pre-scaling, an integer average or a post-scale
(the general path owns those rules), or call ``cuda.synchronize``.
"""

from __future__ import annotations

import torch

from hvdnb.torch.rounds import Handle, wire_dtype
from hvdnb.torch.spec import DCODE, Average, Max, Min, Product, Sum, allreduce_header
from hvdnb.torch.transport import CALLS, SIG_BYTES, TorchTransport

__all__ = ["TorchPlan", "make_torch_plan", "run_blocking", "run_launch"]

_OPS = (Average, Sum, Min, Max, Product)


class TorchPlan:
    """One call site's allreduce over torch.distributed: header, reduce op, divisor."""

    __slots__ = ("all_reduce", "div", "group", "hdr", "rop", "sig", "size", "tr")

    def __init__(self, tr: TorchTransport, hdr: bytes, op: int, floating: bool) -> None:
        self.tr = tr
        self.size = tr.size
        self.hdr = hdr
        self.sig = hdr[:SIG_BYTES]
        self.rop = tr.ops[op]
        self.group = tr.group
        self.all_reduce = tr.dist.all_reduce
        # Average divides (correctly rounded, as the general path does); one rank: x / 1 = x
        self.div = tr.size if op == Average and floating and tr.size > 1 else 0


def make_torch_plan(
    tr: TorchTransport,
    t: torch.Tensor,
    name: str,
    op: int,
    pre: float,
    post: float,
    shape_key: int | None = None,
) -> TorchPlan | None:
    """The plan of this call, or None where the general path must run it."""
    dtype = t.dtype
    if (
        op not in _OPS
        or pre != 1.0
        or post != 1.0
        or dtype not in DCODE
        or wire_dtype(dtype, tr.backend, t.is_cuda) != dtype
        or not t.is_contiguous()
        or t.numel() == 0
        or (op == Average and not t.is_floating_point())
    ):
        return None
    hdr = allreduce_header(
        name,
        DCODE[dtype],
        op,
        hash(t.shape) if shape_key is None else shape_key,
        t.numel(),
        1.0,
        1.0,
        t.numel() * t.element_size(),
    )
    return TorchPlan(tr, hdr, op, t.is_floating_point())


def _agree(p: TorchPlan) -> list[bytes] | None:
    """None when every rank sent this header, else every rank's header (the same exchange
    the general path makes, so ranks on either path still meet)."""
    if p.size == 1:
        CALLS[0] += 1
        return None
    hdrs = p.tr.exchange(p.hdr)
    sig = p.sig
    for h in hdrs:
        if h[:SIG_BYTES] != sig:
            return hdrs
    return None


def run_blocking(p: TorchPlan, t: torch.Tensor, inplace: bool) -> torch.Tensor | list[bytes]:
    """``allreduce(_)`` of ``t``: the result, or every rank's header when they differ."""
    hdrs = _agree(p)
    if hdrs is not None:
        return hdrs
    out = t if inplace else t.clone()
    p.all_reduce(out, op=p.rop, group=p.group)
    if p.div:
        out.div_(p.div)
    return out


def run_launch(p: TorchPlan, t: torch.Tensor) -> Handle | list[bytes]:
    """Start an in-place allreduce of ``t`` (a bucket): its Handle, or every rank's header."""
    hdrs = _agree(p)
    if hdrs is not None:
        return hdrs
    work = p.all_reduce(t, op=p.rop, group=p.group, async_op=True)
    if p.div:
        div = p.div
        return Handle(work, lambda: t.div_(div), None)
    return Handle(work, None, t)
