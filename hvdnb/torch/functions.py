"""Model-level helpers: broadcast_parameters, broadcast_optimizer_state, broadcast_object,
allgather_object.

Owns: making every rank start from rank ``root_rank``'s weights and optimizer state, and
moving picklable Python objects. Never: change a model's structure, or pickle tensors
element by element (objects travel as one byte tensor).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hvdnb.torch.basics import rank
from hvdnb.torch.collectives import allgather, broadcast_
from hvdnb.torch.process_sets import ProcessSet, global_process_set

__all__ = [
    "allgather_object",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
]


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    root_rank: int = 0,
    process_set: ProcessSet = global_process_set,
) -> None:
    """Copy ``root_rank``'s tensors into every rank's tensors, in place.

    SPMD contract: every rank passes the same names in the same order (a ``state_dict()``
    or ``named_parameters()``) with the same shapes and dtypes.

    Parameters
    ----------
    params : ``model.state_dict()`` or ``model.named_parameters()``
    root_rank : rank whose values win
    """
    items = sorted(params.items()) if isinstance(params, Mapping) else list(params)
    with torch.no_grad():
        for name, p in items:
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"broadcast_parameters: {name} is a {type(p).__name__}, "
                    "not a tensor; pass state_dict() or named_parameters()"
                )
            broadcast_(
                p.data if p.requires_grad else p,
                root_rank,
                name=f"broadcast.param.{name}",
                process_set=process_set,
            )


def _to_bytes(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _from_bytes(t: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(t.numpy().tobytes()), weights_only=False)


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (pickled with ``torch.save``).

    SPMD contract: every rank calls it with the same ``name`` and ``root_rank``; the
    object of non-root ranks is ignored (pass None).
    """
    name = name or "broadcast_object"
    data = _to_bytes(obj) if rank() == root_rank else torch.empty(0, dtype=torch.uint8)
    n = broadcast_(
        torch.tensor([data.numel()], dtype=torch.int64),
        root_rank,
        name=f"{name}.len",
        process_set=process_set,
    )
    if rank() != root_rank:
        data = torch.empty(int(n.item()), dtype=torch.uint8)
    broadcast_(data, root_rank, name=f"{name}.data", process_set=process_set)
    return obj if rank() == root_rank else _from_bytes(data)


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Return the list of every rank's ``obj``, in rank order. Same name on every rank."""
    name = name or "allgather_object"
    data = _to_bytes(obj)
    sizes = allgather(
        torch.tensor([data.numel()], dtype=torch.int64), name=f"{name}.len", process_set=process_set
    ).tolist()
    flat = allgather(data, name=f"{name}.data", process_set=process_set)
    out, pos = [], 0
    for s in sizes:
        out.append(_from_bytes(flat[pos : pos + s]))
        pos += s
    return out


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int = 0,
    process_set: ProcessSet = global_process_set,
) -> None:
    """Make every rank's optimizer state (and hyper-parameters) equal to ``root_rank``'s.

    SPMD contract: the same optimizer class over the same parameters on every rank.
    ``root_rank`` is a global rank. As in Horovod, parameters that require a gradient get
    a zero ``.grad`` when the optimizer has no state yet (Horovod creates the state so).
    """
    if not optimizer.state_dict()["state"]:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
                    if isinstance(optimizer, torch.optim.SparseAdam):
                        p.grad = p.grad.to_sparse()
    state = broadcast_object(
        optimizer.state_dict() if rank() == root_rank else None,
        root_rank,
        name="broadcast_optimizer_state",
        process_set=process_set,
    )
    if rank() != root_rank:
        optimizer.load_state_dict(state)
