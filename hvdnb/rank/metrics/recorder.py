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

The parts of a ``Recorder``: ``state`` (its fields), ``ring`` (the ring and the drain,
once per message), ``comm`` (collective timing, sampled one step in ``comm_every``),
``flusher`` (sending, from ``log`` while a loop logs, else from a thread), ``memory``
(readings per message); ``ddp`` is the DDP communication hook, ``knobs`` the values a loop
reads (it registers with ``on_step_start``; this module never imports it).

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
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from hvdnb.rank import nvtx as _nvtx
from hvdnb.rank.metrics.comm import CommTiming
from hvdnb.rank.metrics.flusher import Flusher
from hvdnb.rank.metrics.ring import PHASE_ALIASES, scalar
from hvdnb.rank.metrics.state import CAPACITY, IDLE_AFTER, LOG, RECORD

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

_NEVER = 1 << 62  # a step no loop reaches
_perf_counter = time.perf_counter
_get_ident = threading.get_ident

#: called with the step that starts when ``log`` looks at its step events; True: look
#: again at the next step (something is planned for a later one). See ``on_step_start``:
#: the functions registered there (by name), called in turn.
_STEP_HOOK: Callable[[int], bool] | None = None
_STEP_HOOKS: dict[str, Callable[[int], bool]] = {}

#: the plan of a change every rank makes at one step (a knob change, a stop) must reach
#: every rank before that step: rank 0 plans this many seconds of steps ahead
LEAD_SECONDS = 0.5
MIN_LEAD = 3
MAX_LEAD = 10_000

#: the number of the ``%%distributed`` cell running (or last run) on this engine; None
#: outside an engine (see ``begin_cell``)
_CELL: int | None = None


class Recorder(Flusher, CommTiming):
    """A per-process ring of ``(step, time, name_id, value)`` rows and its flusher.

    Parameters
    ----------
    rank : this process's rank
    channel : an object with ``send(kind, **payload)`` (``hvdnb.rank.channel``), or None
    flush_interval : seconds between two messages for the first ``warm`` seconds of a loop
    steady_interval : seconds between two messages after that (default: ``flush_interval``)
    warm : seconds of logging after which a loop sends every ``steady_interval``
    capacity : ring size in rows
    comm_interval : while a loop logs, time its collectives on one step in ``k``, with
        ``k`` the whole number of steps in ``comm_interval`` seconds (1 to
        ``COMM_EVERY_MAX``); 0 times every step
    comm_interval_steady : the same once the loop has logged for ``warm`` seconds (the
        larger of the two applies; default: ``comm_interval``)
    """

    __slots__ = ()  # the slots are RecorderState's (hvdnb.rank.metrics.state)

    def __init__(
        self,
        rank: int,
        channel: Any = None,
        flush_interval: float = 0.25,
        capacity: int = CAPACITY,
        steady_interval: float | None = None,
        warm: float = 2.0,
        comm_interval: float = 0.0,
        comm_interval_steady: float | None = None,
    ) -> None:
        super().__init__(
            rank,
            channel,
            flush_interval,
            capacity,
            steady_interval,
            warm,
            comm_interval,
            comm_interval_steady,
        )
        self._on_comm = self.on_comm  # one bound method: registered and removed by identity

    # ------------------------------------------------------------------ hot path
    def record(self, step: int, name: str, value: Any, t: float | None = None) -> None:
        """Store one point (training thread: the queue ``_drain`` writes into the ring; any
        other thread: a side queue)."""
        if t is None:
            t = time.time()
        if threading.get_ident() != self._owner:
            self._side.append((step, t, name, value))
            return
        q = self._pend
        q.append((RECORD, t, step, name, value))
        if len(q) > self.capacity:  # no log() drains it (phases alone, no channel)
            self._try_drain()

    def log(self, step: int, loss: Any = None, **metrics: Any) -> None:
        """Record step ``step``'s loss and keyword scalars (see the module's ``log``)."""
        self._log(step, loss, metrics)

    def _log(self, step: int, loss: Any, metrics: dict[str, Any]) -> None:
        # ``metrics`` is the caller's fresh ``**kwargs`` dict: tensors in it are replaced.
        # The hot path appends what it was given and returns: after forward, backward and
        # the allreduce every cache line it touches is cold, so each attribute read counts
        # (~0.1-0.3 us). Measured inside a 2-rank loop of ~1.2 ms steps: writing the rows
        # here cost ~23 us per call; this path ~3.5-5 us, ~2.5 us more for a CPU loss. What
        # happens on some steps only (registering the allreduce listener on the sampled
        # steps, a planned knob change, the next message) waits for ``_next_event`` (a
        # step) or ``_due`` (a time) and is done by ``_events``; rows are written by
        # ``_drain``, once per message, on warm caches.
        if not self.enabled:
            return
        now = _perf_counter()
        if _get_ident() != self._owner:
            self._log_elsewhere(int(step), loss, metrics, now, time.time())
            return
        if type(step) is not int:
            step = int(step)
        if type(loss) is not float and loss is not None:
            # a CPU tensor is read now: read later it could have changed in place, and
            # keeping it would keep its autograd graph alive until the drain
            loss = scalar(loss)
        if metrics:  # tensors in it are read now too
            for v in metrics.values():
                if type(v) is not float and type(v) is not int:
                    for k, v in metrics.items():
                        metrics[k] = scalar(v)
                    break
        self._pend.append((LOG, now, step, loss, metrics))
        self.cur_step = step + 1
        self.last_activity = now
        if step >= self._next_event or now >= self._due:
            self._events(step, now)

    def _events(self, step: int, now: float) -> None:
        """What ``log(step)`` does on some steps only: register or remove the allreduce
        listener for the next step (timed steps: ``s % comm_every == 0``), tell the step
        hook (``on_step_start``: the knobs, whose planned change applies at its step), send
        a message when one is due; then set the step of the next such event. ``_drain``,
        ``_time_comm`` and ``events_at_next_log`` (a knob plan arriving) set
        ``_next_event`` to -1 (an event at the next log)."""
        nxt = step + 1
        k = self._comm_every
        if self._comm_list is None or k <= 1:
            ne = _NEVER  # not timing, or timing every step: nothing to switch
            if self._comm_list is not None and not self._comm_on:
                self._time_comm(True)
        else:
            on = nxt % k == 0
            if on is not self._comm_on:
                self._time_comm(on)
            # timed: remove the listener after it; else add it before the next timed step
            ne = nxt if on else nxt + (k - nxt % k) - 1
        self._next_event = ne  # before the hook reads pending plans (see events_at_next_log)
        hook = _STEP_HOOK
        if hook is not None and hook(nxt):  # planned for a later step: look at every step
            self._next_event = nxt
        if now >= self._due:
            g = self._grid
            if g > 1 and now < self._due_late:
                cell = step // g
                if self._due_cell is None:
                    self._due_cell = cell
                if cell == self._due_cell:  # send at the first step of the next cell
                    return
            if not self._torch_noticed:  # hvdnb.torch imported after the loop's first log
                self.notice_torch()
            self._flush_from_loop(now)

    def logged_step(self) -> int:
        """The last step given to ``log`` (-1: none in this loop), drained or not."""
        try:
            for e in reversed(self._pend):
                if e[0] == LOG:
                    return int(e[2])
        except RuntimeError:  # the deque changed while we looked: the training thread runs
            pass
        return self._prev_step

    def _log_elsewhere(
        self, step: int, loss: Any, metrics: dict[str, Any], now: float, t: float
    ) -> None:
        """log() from a thread other than the recorder's: rows go through the side queue."""
        prev = self._prev_step
        if self.last_log and step > prev:
            self.record(step, "time/step", (now - self.last_log) / (step - prev), t)
        if now - self.last_log > IDLE_AFTER:
            self._loop_t0 = now
        self._prev_step = step
        self.last_log = now
        if loss is not None:
            self.record(step, "loss", loss, t)
        for k, v in metrics.items():
            if k == "total_steps":
                self.meta["total_steps"] = int(v)
                continue
            self.record(step, PHASE_ALIASES.get(k, k), v, t)
        self.mark(step + 1, now)
        hook = _STEP_HOOK
        if hook is not None:
            hook(step + 1)
        if now >= self._due:
            self._flush_from_loop(now)

    def mark(self, step: int, now: float | None = None) -> None:
        """Step ``step`` is now in progress (updates the step-time estimate)."""
        now = time.perf_counter() if now is None else now
        if step > self.cur_step and self._last_mark:
            per = (now - self._last_mark) / (step - self.cur_step)
            self.step_time = per if not self.step_time else 0.8 * self.step_time + 0.2 * per
        if step != self.cur_step or not self._last_mark:
            self._last_mark = now
        self.cur_step = step
        self.last_activity = now

    def new_loop(self) -> None:
        """Forget the step in progress (the engine calls it when a cell starts): step
        numbers start over in each loop, and a collective before the first ``log`` or
        ``knobs.step`` belongs to step 0, not to the previous cell's last step."""
        with self._lock:
            self._drain()  # the previous loop's rows, against the previous loop's steps
        self.cur_step = 0
        self._prev_step = -1
        self.last_log = 0.0
        self._last_mark = 0.0
        self._loop_t0 = 0.0
        self.comm_every = 1
        self._time_comm(True)  # collectives outside a logging loop: every one is timed
        self.notice_torch()

    def step_ahead(self, floor: int = 0) -> int:
        """A step every rank can still apply a plan at: the step in progress (or ``floor``,
        a later one the caller knows of) plus a lead that covers the plan's round trip
        through the notebook: ``ceil(LEAD_SECONDS / step time)`` steps, at least
        ``MIN_LEAD`` (rank 0 plans knob changes and stops with it)."""
        st = self.step_time or 0.05
        lead = min(MAX_LEAD, max(MIN_LEAD, math.ceil(LEAD_SECONDS / max(st, 1e-6))))
        return max(self.cur_step, floor) + lead

    def events_at_next_log(self) -> None:
        """Make the next ``log`` run its step events (``_events``): something was planned
        for a step between two of them (a knob plan the I/O thread heard)."""
        self._next_event = -1


# ---------------------------------------------------------------------- process singleton
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
            from hvdnb.config import get_config

            channel = None
            if os.environ.get("HVDNB_CHANNEL"):  # an engine: scripts never import zmq
                try:
                    from hvdnb.rank.channel import get

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
    rec = get_recorder()
    was = rec.enabled
    rec.enabled = bool(on)
    now = _perf_counter()
    if on:
        paused = rec._paused
        if not was and paused is not None and rec._due:
            rec._due, rec._due_late = now + paused[0], now + paused[1]
        rec._paused = None
        rec.attach_comm_listener()
    else:
        if was and rec._due:
            rec._paused = (rec._due - now, rec._due_late - now)
        rec.detach_comm_listener()


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
    step : the step that just finished (integers, increasing)
    loss : the loss (a float or a 0-d tensor; a CUDA tensor is read later, off the loop)
    **metrics : more scalars by name. Reserved names: ``samples`` (samples this rank
        processed in this step; gives samples/s), ``total_steps`` (for the progress bar),
        ``data_time`` / ``compute_time`` / ``comm_time`` (seconds spent in that phase this
        step, an alternative to ``hvdnb.phase``).

    Examples
    --------
    >>> for step in range(steps):                                 # doctest: +SKIP
    ...     with hvdnb.phase("data"):
    ...         x, y = next(batches)
    ...     loss = loss_fn(model(x), y); loss.backward(); opt.step()
    ...     hvdnb.log(step, loss, samples=len(x), total_steps=steps)
    """
    # one call below this frame: each frame costs ~1.5 us in a loop whose caches are cold
    rec = _RECORDER
    if rec is None:
        rec = get_recorder()
    try:  # free unless raised (Python >= 3.11)
        rec._log(step, loss, metrics)
    except TrainingStopped as exc:  # a planned stop: the user's frame, not hvdnb's inner ones
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


def on_step_start(fn: Callable[[int], bool] | None, name: str = "knobs") -> None:
    """Have ``log`` call ``fn(step)`` as step ``step`` starts, on the steps it looks at
    (see ``Recorder._events``; every step while ``fn`` returns True: something is planned
    for a later step). ``hvdnb.rank.metrics.knobs`` registers here the function that
    applies planned knob changes (``"knobs"``), ``hvdnb.rank.metrics.stop`` the one that
    stops the loop at a planned step (``"stop"``): this module imports neither. One
    function per ``name``, called in the order the names were first registered: a second
    call with a name replaces its function, None removes it."""
    global _STEP_HOOK
    if fn is None:
        _STEP_HOOKS.pop(name, None)
    else:
        _STEP_HOOKS[name] = fn
    fns = tuple(_STEP_HOOKS.values())
    if not fns:
        _STEP_HOOK = None
    elif len(fns) == 1:
        _STEP_HOOK = fns[0]  # the usual case: no loop over one function
    else:

        def every(step: int) -> bool:
            more = False
            for f in fns:
                if f(step):
                    more = True
            return more

        _STEP_HOOK = every


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
