"""The hooks the rank's metrics read, owned by the rank side: ``hvdnb.torch`` (an API over
this runtime) registers into them, and nothing under ``hvdnb.rank`` imports ``hvdnb.torch``.

Owns: the comm listeners (``COMM_LISTENERS``, ``add_comm_listener`` / ``remove_comm_listener``,
``notify`` after each collective; the recorder's collective timing registers there, and
``hvdnb.torch``'s collectives read the list), the step listeners (``STEP_LISTENERS``,
``add_step_listener`` / ``remove_step_listener``, ``after_step`` after each
``DistributedOptimizer.step()``; the replica-drift fingerprints register there), the progress
counter the stall report reads (``count_negotiated`` / ``negotiated_calls``: ``hvdnb.torch``'s
transport registers its count of negotiated calls) and ``NcclSeconds`` (NCCL's own timing of
one collective, read later: made by ``hvdnb.torch`` and by the DDP hook of
``hvdnb.rank.metrics.ddp``).

The hot paths check one module-level list and do nothing else when it is empty. Never:
import torch or ``hvdnb.torch``, issue a collective, call ``cuda.synchronize``, or let a
listener's exception break training.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = [
    "COMM_LISTENERS",
    "STEP_LISTENERS",
    "CommListener",
    "NcclSeconds",
    "StepListener",
    "add_comm_listener",
    "add_step_listener",
    "after_step",
    "count_negotiated",
    "layer_loaded",
    "negotiated_calls",
    "notify",
    "remove_comm_listener",
    "remove_step_listener",
]

#: fn(name, nbytes, seconds, backend, exposed); see ``add_comm_listener``
CommListener = Callable[[str, int, Any, str, Any], None]

COMM_LISTENERS: list[CommListener] = []


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
    if fn not in COMM_LISTENERS:
        COMM_LISTENERS.append(fn)
    return fn


def remove_comm_listener(fn: CommListener) -> bool:
    """Stop calling ``fn``; returns whether it was registered."""
    try:
        COMM_LISTENERS.remove(fn)
        return True
    except ValueError:
        return False


def notify(name: str, nbytes: int, seconds: Any, backend: str, exposed: float) -> None:
    for fn in tuple(COMM_LISTENERS):
        try:
            fn(name, nbytes, seconds, backend, exposed)
        except Exception as exc:  # a broken panel must never break a training step
            print(f"hvdnb: comm listener {fn!r} failed and was removed: {exc!r}", file=sys.stderr)
            remove_comm_listener(fn)


#: fn(step_count, named_params); see ``add_step_listener``
StepListener = Callable[[int, Sequence[tuple[str, Any]]], None]

STEP_LISTENERS: list[StepListener] = []

_T = TypeVar("_T")


def add_step_listener(fn: StepListener) -> StepListener:
    """Call ``fn(step_count, named_params)`` after every ``DistributedOptimizer.step()``.

    Parameters
    ----------
    fn : callable
        Called on the training thread right after the wrapped optimizer updated the
        parameters, with:

        step_count : int
            How many times this optimizer's ``step()`` has run (1 after the first). Every
            rank counts the same steps (the SPMD contract), so a listener that acts on
            ``step_count % k == 0`` acts on the same steps everywhere, whatever each rank's
            speed or the time it registered.
        named_params : sequence of (str, torch.Tensor)
            The parameters the optimizer averages, by the names given to
            ``named_parameters=`` (``param.<i>`` when none were), in the optimizer's order.

        Keep it cheap on most steps (it runs in every step). A listener that raises is
        removed (and the error printed); training goes on.

    Returns
    -------
    fn, so it can be used as a decorator.
    """
    if fn not in STEP_LISTENERS:
        STEP_LISTENERS.append(fn)
    return fn


def remove_step_listener(fn: StepListener) -> bool:
    """Stop calling ``fn``; returns whether it was registered."""
    try:
        STEP_LISTENERS.remove(fn)
        return True
    except ValueError:
        return False


def after_step(opt: Any, result: _T) -> _T:
    """``DistributedOptimizer.step()``'s last call: count the step and tell the step
    listeners; returns ``result`` (what the wrapped ``step()`` returned). The count is kept
    whether or not a listener is registered, so a listener registered late still sees the
    step numbers every rank sees."""
    # [steps taken, (name, parameter) pairs once a listener asked], on the optimizer itself
    # (an attribute read is ~20x cheaper than a weak-keyed lookup, in every step)
    state = opt.__dict__.get("_hvdnb_steps")
    if state is None:
        state = opt.__dict__["_hvdnb_steps"] = [0, None]
    state[0] += 1
    if STEP_LISTENERS:
        named = state[1]
        if named is None:  # names are fixed once the optimizer is wrapped
            names = getattr(opt, "_parameter_names", None) or {}
            named = state[1] = tuple((n, p) for p, n in names.items())
        for fn in tuple(STEP_LISTENERS):
            try:
                fn(state[0], named)
            except Exception as exc:  # a broken watcher must never break a training step
                print(
                    f"hvdnb: step listener {fn!r} failed and was removed: {exc!r}",
                    file=sys.stderr,
                )
                remove_step_listener(fn)
    return result


# ---------------------------------------------------------------------- progress counters
#: how many collectives this process negotiated (``hvdnb.torch``'s transport registers it)
_NEGOTIATED: Callable[[], int] | None = None


def count_negotiated(fn: Callable[[], int]) -> None:
    """Register the function that says how many collectives this process has negotiated so
    far (``hvdnb.torch.transport`` at its import; safe to call from any thread)."""
    global _NEGOTIATED
    _NEGOTIATED = fn


def layer_loaded() -> bool:
    """Has a collective layer (``hvdnb.torch``) registered here? (Its transport registers
    its counter at import.)"""
    return _NEGOTIATED is not None


def negotiated_calls() -> int | None:
    """The count of negotiated collectives (the stall report's progress counter), None when
    no collective layer registered one (``hvdnb.torch`` not imported)."""
    fn = _NEGOTIATED
    return None if fn is None else fn()


# ---------------------------------------------------------------------- NCCL timing
class NcclSeconds:
    """A collective's own GPU time as ProcessGroupNCCL measures it: CUDA events it records
    on its own stream around the kernel (``Work._get_duration`` in torch 2.11 and 2.13,
    ``get_duration`` where a torch names it so; needs ``TORCH_NCCL_ENABLE_TIMING=1``, which
    hvdnb's rendezvous sets for NCCL groups). Read later (the recorder's flusher thread,
    the timeline's flush), never in the step; read once, then kept; NaN ("n/a") when the
    group was made without timing. Seen on an H100: 7.8 us for a 4 MB one-rank allreduce."""

    __slots__ = ("value", "work")

    def __init__(self, work: Any) -> None:
        self.work = work
        self.value: float | None = None

    def ready(self) -> bool:
        """Has the GPU finished it (never waits)?"""
        w = self.work
        return w is None or self.value is not None or bool(w.is_completed())

    def item(self) -> float:
        if self.value is not None:
            return self.value
        w = self.work
        if w is None:
            return math.nan
        deadline = time.monotonic() + 60.0
        try:
            while not w.is_completed():  # polls the end event; never blocks the device
                if time.monotonic() > deadline:
                    return math.nan
                time.sleep(0.0002)
            get = getattr(w, "_get_duration", None) or w.get_duration  # torch >= 2.11: private
            v = float(get()) / 1000.0
        except Exception:  # timing off for this group, or the work failed
            v = math.nan
        self.value, self.work = v, None
        return v
