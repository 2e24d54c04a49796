"""Timing hook for collectives: a registry of listeners called after each one completes.

Owns: ``add_comm_listener`` / ``remove_comm_listener`` and ``notify``. The hot path checks
one module-level list (``LISTENERS``) and does nothing else when it is empty. Never: issue a
collective, call ``cuda.synchronize``, or let a listener's exception break training.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

__all__ = ["CommListener", "add_comm_listener", "remove_comm_listener"]

#: fn(name, nbytes, seconds, backend, exposed); see ``add_comm_listener``
CommListener = Callable[[str, int, Any, str, Any], None]

LISTENERS: list[CommListener] = []


def add_comm_listener(fn: CommListener) -> CommListener:
    """Call ``fn(name, nbytes, seconds, backend, exposed)`` once after every collective.

    Parameters
    ----------
    fn : callable
        Called once per collective (a fused DistributedOptimizer bucket counts as one),
        after it completed, with:

        name : str
            The op's name (``"allreduce.noname.3"``, ``"DistributedOptimizer.bucket.0"``).
        nbytes : int
            This rank's payload in bytes.
        seconds : float or object with ``.item()``
            The collective's own duration, not the time since it was queued. MPI: the time
            spent inside the blocking MPI calls and inside the ``Wait`` of its nonblocking
            request (MPICH on CPU makes no progress outside them). Gloo: the work's own
            execution time, from max(its enqueue, completion of the previous gloo work of
            the same process group) to its completion, so queueing behind earlier buckets
            is not counted. NCCL: an object whose ``.item()`` returns NCCL's own kernel time
            (the CUDA events ProcessGroupNCCL records around it on its stream) and whose
            ``.ready()`` says, without waiting, whether the GPU has finished it; ``.item()``
            waits for the GPU: call it off the training thread, later. ``float('nan')``
            when it cannot be measured.
        backend : str
            ``"mpi"``, ``"gloo"``, ``"nccl"`` or ``"local"``.
        exposed : float, or on NCCL an object with ``.item()`` and ``.ready()``
            NCCL: how long the GPU's compute stream waited for the collective (CUDA events
            just before and after it was made to wait; the host does not wait). Otherwise
            seconds the calling (training) thread was blocked by this collective: the time
            inside a blocking call; for an async handle the time ``synchronize`` waited
            for it (0.0 if it was already done); for a DistributedOptimizer bucket the
            blocking part inside the gradient hook (a small bucket's one-message exchange,
            the header swap) plus the time ``synchronize()`` / ``step()`` waited for it.

        Usually called on the training thread; may be called from a gloo worker thread.
        Keep it to an append into a buffer. A listener that raises is removed (and the
        error printed); training goes on.

    Returns
    -------
    fn, so it can be used as a decorator.

    Examples
    --------
    >>> seen = []
    >>> hvd.add_comm_listener(lambda *a: seen.append(a))     # doctest: +SKIP
    >>> hvd.allreduce(torch.ones(4), name="x")                # doctest: +SKIP
    >>> seen[-1][:2], seen[-1][3]                             # doctest: +SKIP
    (('x', 16), 'mpi')
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


def notify(name: str, nbytes: int, seconds: Any, backend: str, exposed: float) -> None:
    for fn in tuple(LISTENERS):
        try:
            fn(name, nbytes, seconds, backend, exposed)
        except Exception as exc:  # a broken panel must never break a training step
            print(f"hvdnb: comm listener {fn!r} failed and was removed: {exc!r}", file=sys.stderr)
            remove_comm_listener(fn)
