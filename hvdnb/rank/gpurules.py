"""The GPU's point-to-point rules, enforced on every rank, on CPU as well.

A notebook that passes on a laptop's CPU ranks must not fail on a GPU node. Gloo on CPU
forgives two things that break there:

- **a send to self**: NCCL refuses it ("Trying to send to self without a matching recv");
  gloo on CPU fails with "Pair is not connected". It happens at world size 1, the default
  on a one-GPU node, in code that builds a ring from ``(rank + 1) % size``;
- **gloo point-to-point on CUDA tensors**: gloo's ``send``/``recv`` take CPU tensors only
  ("writev ... Bad address"); its collectives do stage CUDA tensors through the host. Ranks
  that share a GPU run gloo, so their point-to-point must stage through host memory.

The third rule, one NCCL rank per device, is checked where the group is made
(``rendezvous.init_process_group``, and the notebook's start options).

``install`` wraps ``torch.distributed``'s ``send``, ``recv``, ``isend`` and ``irecv`` (in
``torch.distributed`` and ``distributed_c10d``, so ``P2POp`` and ``batch_isend_irecv`` see
the same functions) with a check of their arguments that raises ``GPURuleError`` naming the
rule and the fix, then calls torch's own function. ``check`` is the rule itself.

Owns: the rules and their wording. Never: change what a legal call does, or issue one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["GPURuleError", "check", "install", "installed"]

#: torch.distributed's point-to-point functions, and which argument names their peer
_P2P = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}
_INSTALLED = False


class GPURuleError(RuntimeError):
    """A point-to-point call that a GPU node would refuse (raised before it is made)."""


def check(
    op: str,
    *,
    me: int,
    size: int,
    peer: int | None,
    tensor_device: str,
    cuda_backend: str | None,
) -> None:
    """Raise ``GPURuleError`` if ``op`` breaks a GPU rule; return None otherwise.

    Parameters
    ----------
    op : "send", "isend", "recv" or "irecv"
    me : this rank, in the numbering ``peer`` uses
    size : how many ranks ``peer`` is numbered among (for a recv from any source: the
        group's size)
    peer : the destination (send) or source (recv); None for a recv from any source
    tensor_device : the tensor's device type ("cpu", "cuda", ...)
    cuda_backend : the backend that carries CUDA tensors in this group ("nccl", "gloo",
        ...), or None when the group has no backend for CUDA tensors
    """
    sending = op in ("send", "isend")
    if peer is None and size == 1:
        raise GPURuleError(
            f"rank {me} receives from any source in a group of 1 rank: no other rank exists, "
            "so nothing can ever arrive and the call would wait forever. This code needs "
            "at least 2 ranks: `%dist restart -n 2` (add --oversubscribe where the host has "
            "fewer cores or GPUs)"
        )
    if peer is not None and not 0 <= peer < size:
        raise GPURuleError(
            f"rank {me} {'sends to' if sending else 'receives from'} rank {peer}, but the "
            f"group has {size} rank{'s' if size != 1 else ''} (0..{size - 1}): the call "
            f"would wait forever. Start more ranks (`%dist restart -n {peer + 1}`) or "
            "check the peer's number"
        )
    if peer is not None and peer == me:
        what = "sends to itself" if sending else "receives from itself"
        hint = (
            "at 1 rank a ring of one is the identity: skip the exchange when size == 1"
            if size == 1
            else "a rank's neighbour must be another rank"
        )
        raise GPURuleError(
            f"rank {me} {what} ({op} with {'dst' if sending else 'src'}={peer}, group of "
            f"{size} rank{'s' if size != 1 else ''}): NCCL refuses a send to self and gloo "
            f"fails with 'Pair is not connected'; {hint}"
        )
    if tensor_device == "cuda" and cuda_backend != "nccl":
        backend = cuda_backend or "gloo"
        raise GPURuleError(
            f"rank {me}: {op} of a CUDA tensor over {backend}: {backend}'s point-to-point "
            "takes CPU tensors only (ranks that share a GPU run gloo). Stage through host "
            "memory (send t.cpu(), recv into a CPU buffer and copy it to the GPU), or use a "
            "collective (all_reduce, broadcast, all_gather), which stages for you"
        )


def _cuda_backend(dist: Any, group: Any) -> str | None:
    """The backend that carries CUDA tensors in ``group`` (None: the default group's)."""
    try:
        config = str(dist.get_backend_config(group))
    except Exception:
        config = ""
    for part in config.split(","):  # "cpu:gloo,cuda:nccl", or one name for every device
        device, _, name = part.strip().partition(":")
        if name and device == "cuda":
            return name
        if not name and device:
            return device
    try:
        return str(dist.get_backend(group))
    except Exception:
        return None


def _guard(dist: Any, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    peer_name = _P2P[op]
    group_peer_name = "group_" + peer_name

    @functools.wraps(fn)
    def guarded(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        peer = args[0] if args else kwargs.get(peer_name)
        group = args[1] if len(args) > 1 else kwargs.get("group")
        group_peer = kwargs.get(group_peer_name)
        try:
            if group_peer is not None:  # numbered within the group
                me, peer, size = dist.get_rank(group), group_peer, dist.get_world_size(group)
            elif peer is None:  # any source: who can send is the group's business
                me, size = dist.get_rank(), dist.get_world_size(group)
            else:  # numbered globally, whatever the group
                me, size = dist.get_rank(), dist.get_world_size()
            cuda = bool(tensor.is_cuda)
        except Exception:  # no group yet, or not a tensor: torch says what is wrong
            return fn(tensor, *args, **kwargs)
        check(
            op,
            me=me,
            size=size,
            peer=peer,
            tensor_device="cuda" if cuda else "cpu",
            cuda_backend=_cuda_backend(dist, group) if cuda else None,
        )
        return fn(tensor, *args, **kwargs)

    guarded.__hvdnb_guarded__ = True  # type: ignore[attr-defined]
    return guarded


def install() -> None:
    """Wrap torch.distributed's point-to-point functions with ``check`` (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used
    import torch.distributed.distributed_c10d as c10d  # noqa: PLC0415  torch is heavy: loaded when first used

    for op in _P2P:
        fn = getattr(c10d, op)
        if getattr(fn, "__hvdnb_guarded__", False):
            continue
        guarded = _guard(dist, op, fn)
        setattr(c10d, op, guarded)  # P2POp's check and batch_isend_irecv look here
        setattr(dist, op, guarded)
    _INSTALLED = True


def installed() -> bool:
    """Are the point-to-point functions guarded in this process?"""
    return _INSTALLED
