"""NVTX ranges for Nsight Systems, only when this process uses CUDA.

``%%distributed`` cells (``cell N``), ``hvdnb.phase`` blocks (``data``, ``compute``,
``comm``) and ``DistributedOptimizer`` buckets (``allreduce bucket.K``, from launch to
the end of ``synchronize``'s wait: a start/end range, since buckets overlap the
backward pass and do not nest) open a range, so a
``nsys profile`` of a rank shows them on its timeline next to the CUDA kernels (Horovod's
advice: the timeline plus Nsight Systems). Without CUDA in use (CPU ranks, or torch not
imported) every call returns after one dictionary lookup and one attribute read: no torch
import, no CUDA initialisation.

Owns: deciding whether ranges are emitted. Never: initialise CUDA, synchronise, or raise.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["active", "end", "pop", "push", "start"]


def active() -> bool:
    """Whether this process has initialised CUDA (then ranges are worth emitting)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:
        return False


def push(name: str) -> bool:
    """Open a range named ``name``; returns whether one was opened (pass it to ``pop``)."""
    if not active():
        return False
    try:
        sys.modules["torch"].cuda.nvtx.range_push(name)
        return True
    except Exception:
        return False


def pop(opened: Any) -> None:
    """Close the range ``push`` opened (nothing when it did not)."""
    if opened:
        try:
            sys.modules["torch"].cuda.nvtx.range_pop()
        except Exception:
            pass


def start(name: str) -> Any:
    """Open a range that need not nest (``range_start``); returns its id, or None."""
    if not active():
        return None
    try:
        return sys.modules["torch"].cuda.nvtx.range_start(name)
    except Exception:
        return None


def end(range_id: Any) -> None:
    """Close a range ``start`` opened (nothing when it did not)."""
    if range_id is not None:
        try:
            sys.modules["torch"].cuda.nvtx.range_end(range_id)
        except Exception:
            pass
