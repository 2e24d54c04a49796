"""Rank side of the live panel, its hot path: ``log`` queues a step's points, ``phase``
times a block, and the process's ``Recorder`` is made here.

Step attribution: ``log(step=s)`` records step ``s`` and says "step s is done", so the
step in progress becomes ``s + 1``; ``knobs.step(s)`` (start of a step) says "step s is in
progress". Allreduce timings and ``phase`` blocks are recorded against the step in
progress. ``log`` appends one tuple to the training thread's queue and returns; what
happens on some steps only (registering the allreduce listener on the sampled steps, a
step that something registered with ``on_step_start`` waits for, sending the next
message) waits for a step (``_next_event``) or a time (``_due``) and is done by
``_events``. Ints and CPU tensors become floats in ``log`` (``.item()`` on a CPU tensor
never waits); other objects (a CUDA loss) are read on the flusher thread.

The ``Recorder`` (``core``) owns the queue and the hot path, and its parts, each an object
that owns its fields: ``ring`` (the preallocated columns), ``clock`` (``state.LoopClock``:
what the logged steps say about the loop), ``drain`` (queue -> ring, once per message),
``comm`` (collective timing, sampled one step in ``comm_every``), ``flusher`` (sending,
from ``log`` while a loop logs, else from a thread), ``memory`` (readings per message) and
``fingerprints`` (``outbox``). ``ddp`` is the DDP communication hook, ``knobs`` the values
a loop reads (it registers with ``on_step_start``; this module never imports it).

``log`` raises ``TrainingStopped`` at the step a watcher's stop was planned for
(``hvdnb.rank.metrics.stop``, through ``on_step_start``); the error is re-raised from
``log`` so that the user's traceback ends at their own line.

Never: block the step, issue a collective, call ``cuda.synchronize``, import torch
(it is used only when the training code already imported it), or raise into the training
loop because the panel is absent: without an hvdnb cluster (``get()`` is None) ``log``
writes into the ring and nothing else happens.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from hvdnb.config import get_config
from hvdnb.protocol.errors import InputError, InputTypeError
from hvdnb.rank import nvtx as _nvtx
from hvdnb.rank.metrics.core import LEAD_SECONDS, MAX_LEAD, MIN_LEAD, Recorder, on_step_start

__all__ = [
    "LEAD_SECONDS",
    "MAX_LEAD",
    "MIN_LEAD",
    "Recorder",
    "TrainingStopped",
    "begin_cell",
    "cell_no",
    "current",
    "end_cell",
    "flush_for_cell_end",
    "get_recorder",
    "log",
    "logged_step",
    "on_step_start",
    "phase",
    "set_enabled",
]


class TrainingStopped(RuntimeError):
    """A watcher stopped the training loop (``hvdnb.watch(nan="stop")``, ...): every rank
    raises it at the same step, with the same message (see ``hvdnb.rank.metrics.stop``).
    The cluster stays usable: run the next cell."""


TrainingStopped.__module__ = "hvdnb"  # shown as hvdnb.TrainingStopped, its public name

#: the number of the ``%%distributed`` cell running (or last run) on this engine; None
#: outside an engine (see ``begin_cell``)
_CELL: int | None = None

_RECORDER: Recorder | None = None
_RLOCK = threading.Lock()


def get_recorder() -> Recorder:
    """This process's recorder, created on first use (connects the side channel and
    registers the allreduce listener when ``hvdnb.torch`` is loaded)."""
    global _RECORDER
    if _RECORDER is not None:
        return _RECORDER
    with _RLOCK:
        if _RECORDER is None:
            channel = None
            if os.environ.get("HVDNB_CHANNEL"):  # an engine: scripts never import zmq
                try:
                    from hvdnb.rank.channel import get  # noqa: PLC0415  the side channel (zmq) on an engine only: scripts never import zmq

                    channel = get()
                except Exception:
                    channel = None
            rank = int(os.environ.get("RANK", os.environ.get("PMI_RANK", "0")) or 0)
            cfg = get_config()
            rec = Recorder(
                rank,
                channel,
                cfg.flush_interval,
                steady_interval=cfg.flush_interval_steady,
                warm=cfg.flush_warm,
                comm_interval=cfg.comm_sample_interval,
                comm_interval_steady=cfg.comm_sample_interval_steady,
            )
            rec.attach_comm_listener()
            rec.cell = _CELL
            _RECORDER = rec
    return _RECORDER


def current() -> Recorder | None:
    """This process's recorder if one was made (``log``, ``phase``, ``get_recorder``),
    else None: never makes one."""
    return _RECORDER


def set_enabled(on: bool) -> None:
    """Switch recording on or off in this process.

    Off, ``log`` returns at once, ``phase`` records nothing and the allreduce listener is
    unregistered, so ``hvdnb.torch`` takes its untimed paths (no clock reads, the planned
    fast path for named allreduces): a loop runs as it would without the panel. On
    registers the listener again. Time spent off does not count toward the next message:
    the message clock stops when recording goes off and goes on where it stopped, so a
    loop that switches recording off and on sends as often per logged step as one that
    never switched (and no message goes out for points that are not there).
    """
    get_recorder().set_enabled(on)


def log(step: int, loss: Any = None, **metrics: Any) -> None:
    """Record this step's loss and other scalars for the live panel and ``hvdnb.metrics()``.

    Call it once per step, at the end of the step, on every rank. It reads a CPU
    tensor (~2.5 us of it here) and queues the values: ~6-10 us per call inside a 2-rank
    training loop of ~1.2 ms steps (caches are cold after a step; ~1.5 us when warm).
    Once per flush interval it writes the queue into a preallocated ring (numpy, for a
    loop's alike entries) and hands one message to the side channel (~1.5-2 ms for a
    second of such steps, ~2 us per step, on the same step on every rank; a CUDA loss is
    read by a background thread). The interval is ``hvdnb.config`` ``flush_interval``
    (250 ms) for the loop's first ``flush_warm`` seconds (2 s), then
    ``flush_interval_steady`` (1 s): each message costs the ranks CPU.

    Parameters
    ----------
    step : the step that just finished (whole numbers, increasing)
    loss : the loss: a Python int, float or bool, a numpy scalar, or a tensor or array of
        one element (a CUDA tensor is read later, off the loop); None: no loss this step
    **metrics : more such numbers by name (None: no value this step). Reserved names:
        ``samples`` (samples this rank processed in this step; gives samples/s),
        ``total_steps`` (for the progress bar; None: the loop's length is unknown),
        ``data_time`` / ``compute_time`` / ``comm_time`` (seconds spent in that phase this
        step, an alternative to ``hvdnb.phase``).

    Raises
    ------
    TypeError, ValueError
        A value that is not a number (a string, a dict, a tensor of several elements) or a
        step that is not a whole number: refused at this call, never recorded as NaN; what
        was logged before stays.

    Examples
    --------
    >>> for step in range(steps):                                 # doctest: +SKIP
    ...     with hvdnb.phase("data"):
    ...         x, y = next(batches)
    ...     loss = loss_fn(model(x), y); loss.backward(); opt.step()
    ...     hvdnb.log(step, loss, samples=len(x), total_steps=steps)
    """
    # one call below this frame: each frame costs ~1.5 us in a loop whose caches are cold
    __tracebackhide__ = True  # a refusal or a planned stop ends at the user's line
    rec = _RECORDER
    if rec is None:
        rec = get_recorder()
    try:  # free unless raised (Python >= 3.11)
        rec._log(step, loss, metrics)
    except (TrainingStopped, InputError) as exc:  # the user's frame, not hvdnb's inner ones
        raise exc.with_traceback(None) from None


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as phase ``name`` of the step in progress (``data``, ``compute`` or
    ``comm``; any name is recorded as ``time/<name>``).

    Step time not covered by ``data`` and ``comm`` counts as compute; when ``comm`` is not
    marked, the *exposed* communication that ``hvdnb.torch`` and ``ddp_comm_hook`` report
    is used instead: the time the training thread was blocked by collectives, not their
    duration (which overlaps backward).

    Examples
    --------
    >>> with hvdnb.phase("data"):                                 # doctest: +SKIP
    ...     x, y = next(loader)
    """
    if not isinstance(name, str) or not name:
        raise InputTypeError(
            f"hvdnb.phase: name must be a phase's name (e.g. 'data', 'compute', 'comm'), "
            f"not {type(name).__name__} ({name!r})"
        )
    rec = get_recorder()
    opened = _nvtx.push(name)  # Nsight Systems sees the phase too (CUDA only)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        dt = time.perf_counter() - t0
        _nvtx.pop(opened)
        if rec.enabled:
            rec.record(rec.cur_step, f"time/{name}", dt)


# ---------------------------------------------------------------------- the engine's cells
def begin_cell(cell: int | None = None) -> None:
    """A ``%%distributed`` cell (number ``cell``) starts (the engine): it is a new loop,
    whose first step must not be filed under the last cell's. Nothing else without a
    recorder."""
    global _CELL
    if cell is not None:
        _CELL = cell
    rec = _RECORDER
    if rec is not None:
        rec.new_loop()
        rec.cell_running = True
        rec.cell = _CELL


def end_cell() -> None:
    """No cell runs (the engine): a knob change asked for now applies at once (no loop can
    take it). Nothing without a recorder."""
    rec = _RECORDER
    if rec is not None:
        rec.cell_running = False


def flush_for_cell_end() -> tuple[int, int] | None:
    """Send what was logged since the last message (the flusher thread would send it up to
    one interval later) and say which message was the last: ``(pid, seq)``, for the
    notebook to wait for. None without a recorder, a channel or any message sent. May
    raise what the send raises."""
    rec = _RECORDER
    if rec is None or rec.channel is None:
        return None
    rec.flush()
    return (rec.pid, rec.seq) if rec.seq else None


def cell_no() -> int | None:
    """The number of the ``%%distributed`` cell running (or last run) on this engine; None
    outside one. A plan made for one cell's loop (a stop) is not applied in another's."""
    return _CELL


def logged_step() -> int | None:
    """The last step given to ``log`` (-1: none in this loop; None: no recorder), read
    from any thread without waiting for the training thread."""
    rec = _RECORDER
    return rec.logged_step() if rec is not None else None
