"""Timing hook for collectives: a registry of listeners called after each one completes.

Owns: ``add_comm_listener`` / ``remove_comm_listener`` and ``notify``. The hot path checks
one module-level list (``LISTENERS``) and does nothing else when it is empty. Never: issue a
collective, call ``cuda.synchronize``, or let a listener's exception break training.
"""

from __future__ import annotations

import sys
from typing import Callable

__all__ = ["add_comm_listener", "remove_comm_listener", "CommListener"]

#: fn(name, nbytes, seconds, backend); seconds is host time from launch to completion seen
CommListener = Callable[[str, int, float, str], None]

LISTENERS: list[CommListener] = []


def add_comm_listener(fn: CommListener) -> CommListener:
    """Call ``fn(name, nbytes, seconds, backend)`` after every collective completes.

    ``name`` is the op's name (``"allreduce.noname.3"``, ``"DistributedOptimizer.bucket.0"``),
    ``nbytes`` the payload of this rank, ``seconds`` host time from launch until hvdnb saw
    completion (for CUDA tensors: until the NCCL work was enqueued and waited on, never a
    ``cuda.synchronize``), ``backend`` one of ``"mpi"``, ``"gloo"``, ``"nccl"``, ``"local"``.
    Listeners run on the training thread: keep them to an append into a buffer.

    Returns
    -------
    fn, so it can be used as a decorator.
    """
    if fn not in LISTENERS:
        LISTENERS.append(fn)
    return fn


def remove_comm_listener(fn: CommListener) -> bool:
    """Stop calling ``fn``; returns whether it was registered."""
    try:
        LISTENERS.remove(fn)
        return True
    except ValueError:
        return False


def notify(name: str, nbytes: int, seconds: float, backend: str) -> None:
    for fn in tuple(LISTENERS):
        try:
            fn(name, nbytes, seconds, backend)
        except Exception as exc:  # a broken panel must never break a training step
            print(f"hvdnb: comm listener {fn!r} failed and was removed: {exc!r}", file=sys.stderr)
            remove_comm_listener(fn)
