"""The ``Recorder`` object: the training thread's queue and the hot path that fills it, the
step events, and the parts it owns (see ``Recorder``); and the step hooks ``log`` calls as
a step starts (``on_step_start``).

Owns: ``Recorder``, ``on_step_start`` and its registry, the lead of a plan made for every
rank (``LEAD_SECONDS``, ``MIN_LEAD``, ``MAX_LEAD``). The process's recorder, ``log`` and
``phase`` are ``hvdnb.rank.metrics.recorder``'s. Never: block the step, issue a collective,
call ``cuda.synchronize``, import torch, or raise into the training loop because the panel
is absent (no channel: rows go into the ring and nothing else happens).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from hvdnb.rank.metrics.comm import CommTiming, pow2
from hvdnb.rank.metrics.drain import PHASE_ALIASES, Drain
from hvdnb.rank.metrics.flusher import Flusher
from hvdnb.rank.metrics.memory import MemorySampler
from hvdnb.rank.metrics.outbox import Fingerprints
from hvdnb.rank.metrics.ring import Ring, as_float, scalar
from hvdnb.rank.metrics.state import CAPACITY, COMM, IDLE_AFTER, LOG, RECORD, LoopClock
from hvdnb.rank.metrics.values import number, step_of, total_of

__all__ = ["LEAD_SECONDS", "MAX_LEAD", "MIN_LEAD", "Recorder", "on_step_start"]

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


class Recorder:
    """A per-process ring of ``(step, time, name_id, value)`` rows, the queue the training
    thread fills, and the parts that drain, sample and send it.

    Owns the hot path's fields (slots: the queue, the step in progress, the next event) and
    the cell it records; its parts each own theirs: ``ring`` (the preallocated columns),
    ``clock`` (what the logged steps say about the loop), ``drain`` (queue -> ring),
    ``comm`` (which steps' collectives are timed), ``flusher`` (sending), ``memory``
    (readings per message).

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

    # what log() reads and writes on every step sits in slots, at fixed offsets in the
    # object (one or two cache lines); the rest is in its __dict__ and in its parts
    __slots__ = (
        "__dict__",
        "__weakref__",
        "_due",
        "_next_event",
        "_owner",
        "_pend",
        "cur_step",
        "enabled",
        "last_activity",
    )

    @property
    def channel(self) -> Any:
        """Where messages go (None: nowhere); the flusher's, so that setting it later (an
        exported script's metrics file, ``hvdnb.rank.script``) reaches the sender."""
        return self.flusher.channel

    @channel.setter
    def channel(self, channel: Any) -> None:
        self.flusher.channel = channel

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
        self.rank = rank
        self.pid = os.getpid()
        self.ring = Ring(capacity)
        steady = flush_interval if steady_interval is None else steady_interval
        self.clock = LoopClock(flush_interval, steady, warm)
        self.meta: dict[str, Any] = {}
        self.drain = Drain(self.ring, self.clock, self.meta)
        steady_comm = comm_interval if comm_interval_steady is None else comm_interval_steady
        # one bound method: registered and removed by identity
        self.comm = CommTiming(self.on_comm, comm_interval, steady_comm)
        self.flusher = Flusher(self, channel, flush_interval)
        self.memory = MemorySampler()
        # what the training thread recorded since the last drain, as it was given: log,
        # on_comm and record append one tuple each and do nothing else (see Drain.run)
        self._pend: deque[tuple[Any, ...]] = deque()
        #: entries the queue may hold before ``log`` sends at once (``_relieve``): as many
        #: as half the ring takes (set by each drain from the rows an entry made), so that
        #: a loop logging faster than the interval drains never laps the ring
        self._pend_max = max(1, capacity // 8)
        # rows from other threads (DDP hook futures, gloo callbacks): deque.append is atomic
        self._side: deque[tuple[int, float, str, Any]] = deque()
        self.fingerprints = Fingerprints()  # sent as ``fp`` (hvdnb.rank.metrics.fingerprint)
        self._owner = threading.get_ident()
        self._lock = threading.Lock()  # serialises drains and packs (flusher vs loop)
        self.enabled = True
        self.cur_step = 0  # the step in progress
        self.last_activity = 0.0  # perf_counter of the last log() or knobs.step()
        #: perf_counter time at which log() sends the next message itself (see Flusher)
        self._due = 0.0
        #: the step at which log() next calls _events (-1: at the next log)
        self._next_event = -1
        self.seq = 0  # messages packed
        self.comm_backend = ""  # the backend of the last collective recorded
        #: set by the engine while a %%distributed cell runs (None: not under an engine)
        self.cell_running: bool | None = None
        #: the number of the cell whose loop logs (None: not under an engine); each message
        #: says it, so the notebook watches a late message of a finished cell's loop no more
        self.cell: int | None = None

    @property
    def capacity(self) -> int:
        return self.ring.capacity

    @property
    def step_time(self) -> float:
        """Seconds per step (an average of the latest steps; 0.0: none yet)."""
        return self.clock.step_time

    @property
    def comm_every(self) -> int:
        """The collectives of step s are timed when s % comm_every == 0 (set at each drain
        from the step time; setting it takes effect at the next ``log``)."""
        return self.comm.every

    @comm_every.setter
    def comm_every(self, k: int) -> None:
        self.comm.every = int(k)
        self._next_event = -1

    @property
    def comm_interval(self) -> float:
        """See the class's ``comm_interval`` (takes effect at the next drain)."""
        return self.comm.interval

    @comm_interval.setter
    def comm_interval(self, seconds: float) -> None:
        self.comm.interval = float(seconds)

    # ------------------------------------------------------------------ hot path
    def record(self, step: int, name: str, value: Any, t: float | None = None) -> None:
        """Store one point (training thread: the queue the drain writes into the ring; any
        other thread: a side queue)."""
        if t is None:
            t = time.time()
        if threading.get_ident() != self._owner:
            self._side.append((step, t, name, value))
            return
        q = self._pend
        q.append((RECORD, t, step, name, value))
        if len(q) >= self._pend_max:  # no log() drains it (phases alone)
            self._relieve()

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
        # step) or ``_due`` (a time) and is done by ``_events``; rows are written by the
        # drain, once per message, on warm caches.
        if not self.enabled:
            return
        now = _perf_counter()
        if _get_ident() != self._owner:
            self._log_elsewhere(step_of(step), loss, metrics, now, time.time())
            return
        if type(step) is not int:
            step = step_of(step)  # refuses what is not a whole number (``values``)
        if type(loss) is not float and loss is not None:
            # a CPU tensor is read now: read later it could have changed in place, and
            # keeping it would keep its autograd graph alive until the drain
            loss = scalar(loss)
            if type(loss) is not float:  # a device tensor, or a value that is no number
                loss = number("loss", loss, read=False)
        if metrics:  # tensors in it are read now too
            for v in metrics.values():
                if type(v) is not float and type(v) is not int:
                    _numbers(metrics)
                    break
        self._pend.append((LOG, now, step, loss, metrics))
        self.cur_step = step + 1
        self.last_activity = now
        if step >= self._next_event or now >= self._due:
            self._events(step, now)

    def _events(self, step: int, now: float) -> None:
        """What ``log(step)`` does on some steps only: register or remove the allreduce
        listener for the next step (``comm.plan``: timed steps ``s % comm_every == 0``),
        tell the step hook (``on_step_start``: the knobs, whose planned change applies at
        its step), send a message when one is due (``flusher.hold``: on the grid's step);
        then set the step of the next such event. The drain, ``comm_every`` and
        ``events_at_next_log`` (a knob plan arriving) set ``_next_event`` to -1 (an event
        at the next log)."""
        nxt = step + 1
        # before the hook reads pending plans (see events_at_next_log)
        self._next_event = self.comm.plan(nxt)
        hook = _STEP_HOOK
        if hook is not None and hook(nxt):  # planned for a later step: look at every step
            self._next_event = nxt
        if now >= self._due and not self.flusher.hold(step, now):
            if not self.comm.noticed:  # torch imported after the loop's first log
                self.notice_torch()
            self._flush_from_loop(now)
        room = self._pend_max - len(self._pend)
        if room <= 0:  # logging faster than messages go: send now, before the ring laps
            self._relieve(now)
            room = self._pend_max
        if self._next_event > step + room:  # look again before the queue is full
            self._next_event = step + room

    def _relieve(self, now: float | None = None) -> None:
        """The queue holds as many entries as half the ring takes: send them now, from the
        training thread, waiting for a send in progress elsewhere (backpressure: the step
        waits for one message rather than the ring lapping and losing points). Without a
        channel nothing takes the ring: the drain keeps the latest rows and counts the
        rest in ``lost``."""
        if self.channel is None:
            self._try_drain()
            return
        self.flusher.flush_now()
        if self._due:  # the message just sent was the one due next: the grid starts anew
            self._due = self.flusher.schedule(_perf_counter() if now is None else now)

    def _flush_from_loop(self, now: float) -> None:
        """A message is due at ``log``: drain (also without a channel: the queue stays one
        interval long), set the next due time, and have the flusher send from here."""
        self._try_drain()
        first = not self._due  # the first message goes out one interval after the first log
        self._due = self.flusher.schedule(now)
        self.flusher.from_loop(first, self.ring.has_objects)

    def on_comm(
        self, name: str, nbytes: int, seconds: Any, backend: str, exposed: float = math.nan
    ) -> None:
        """Comm listener (``hvdnb.rank.hooks``): one collective (or fused bucket) just
        completed.

        Records ``comm/<name>/time`` (the collective's own duration; a CUDA-event span is
        kept as an object and read at the pack), ``comm/<name>/exposed`` (what the
        training thread waited for it) and ``comm/<name>/bytes``.
        """
        if not self.enabled:
            return
        t = time.time()
        if threading.get_ident() == self._owner:
            q = self._pend
            q.append((COMM, t, self.cur_step, name, nbytes, seconds, backend, exposed))
            if len(q) >= self._pend_max:  # no log() drains it (allreduces alone)
                self._relieve()
            return
        short = name.replace("DistributedOptimizer.", "")
        self.record_comm(self.cur_step, t, short, seconds, exposed, nbytes, backend)

    def record_comm(
        self,
        step: int,
        t: float,
        short: str,
        seconds: Any,
        exposed: Any,
        nbytes: float,
        backend: str,
    ) -> None:
        """Record one collective timed elsewhere (any thread; the DDP hook): its rows
        ``comm/<short>/time``, ``/exposed`` and ``/bytes`` go through the side queue, read at
        the next pack (``seconds`` may be an object read then, e.g. NCCL's own timing)."""
        side = self._side
        side.append((step, t, f"comm/{short}/time", seconds))
        side.append((step, t, f"comm/{short}/exposed", exposed))
        side.append((step, t, f"comm/{short}/bytes", nbytes))
        self.comm_backend = backend

    def _log_elsewhere(
        self, step: int, loss: Any, metrics: dict[str, Any], now: float, t: float
    ) -> None:
        """log() from a thread other than the recorder's: rows go through the side queue."""
        if type(loss) is not float and loss is not None:
            loss = number("loss", loss)
        per = self.clock.logged(step, now)
        if per is not None:
            self.record(step, "time/step", per, t)
        if loss is not None:
            self.record(step, "loss", loss, t)
        if metrics:
            _numbers(metrics)
        for k, v in metrics.items():
            if k == "total_steps":
                self.meta["total_steps"] = v
                continue
            self.record(step, PHASE_ALIASES.get(k, k), v, t)
        self.mark(step + 1, now)
        hook = _STEP_HOOK
        if hook is not None:
            hook(step + 1)
        if now >= self._due:
            self._flush_from_loop(now)

    # ------------------------------------------------------------------ the loop
    def logged_step(self) -> int:
        """The last step given to ``log`` (-1: none in this loop), drained or not."""
        try:
            for e in reversed(self._pend):
                if e[0] == LOG:
                    return int(e[2])
        except RuntimeError:  # the deque changed while we looked: the training thread runs
            pass
        return self.clock.prev_step

    def mark(self, step: int, now: float | None = None) -> None:
        """Step ``step`` is now in progress (updates the step-time estimate)."""
        now = time.perf_counter() if now is None else now
        self.clock.mark(step, self.cur_step, now)
        self.cur_step = step
        self.last_activity = now

    def new_loop(self) -> None:
        """Forget the step in progress (the engine calls it when a cell starts): step
        numbers start over in each loop, and a collective before the first ``log`` or
        ``knobs.step`` belongs to step 0, not to the previous cell's last step."""
        with self._lock:
            self._drain()  # the previous loop's rows, against the previous loop's steps
        self.cur_step = 0
        self.clock.reset()
        self.comm.every = 1
        self.comm.switch(True)  # collectives outside a logging loop: every one is timed
        self._next_event = -1
        self.notice_torch()

    def step_ahead(self, floor: int = 0) -> int:
        """A step every rank can still apply a plan at: the step in progress (or ``floor``,
        a later one the caller knows of) plus a lead that covers the plan's round trip
        through the notebook: ``ceil(LEAD_SECONDS / step time)`` steps, at least
        ``MIN_LEAD`` (rank 0 plans knob changes and stops with it)."""
        st = self.clock.step_time or 0.05
        lead = min(MAX_LEAD, max(MIN_LEAD, math.ceil(LEAD_SECONDS / max(st, 1e-6))))
        return max(self.cur_step, floor) + lead

    def events_at_next_log(self) -> None:
        """Make the next ``log`` run its step events (``_events``): something was planned
        for a step between two of them (a knob plan the I/O thread heard)."""
        self._next_event = -1

    def idle(self) -> bool:
        """No loop is running: no cell runs on this engine, or no step boundary for a
        while (slow steps are not idle)."""
        if self.cell_running is False:
            return True
        if not self.last_activity:
            return True
        quiet = time.perf_counter() - self.last_activity
        return quiet > max(IDLE_AFTER, 3 * self.clock.step_time)

    def interval(self, now: float | None = None) -> float:
        """Seconds between two messages now (``LoopClock.interval``)."""
        return self.clock.interval(now, self.idle())

    # ------------------------------------------------------------------ collective layer
    def attach_comm_listener(self) -> None:
        """Time collectives (``CommTiming.attach``: once torch is loaded)."""
        self.comm.attach()
        self._next_event = -1

    def notice_torch(self) -> None:
        """Attach if torch was loaded after this recorder was made; cheap once seen."""
        if self.enabled:
            self.comm.notice()
            self._next_event = -1

    def set_enabled(self, on: bool) -> None:
        """See the module's ``set_enabled``."""
        was = self.enabled
        self.enabled = bool(on)
        now = _perf_counter()
        if on:
            self._due = self.flusher.resume(now, self._due) if not was else self._due
            self.attach_comm_listener()
        else:
            if was:
                self.flusher.pause(now, self._due)
            self.comm.detach()
            self._next_event = -1

    # ------------------------------------------------------------------ drain and pack
    def _drain(self) -> None:
        """Write what the training thread queued into the ring (caller holds ``_lock``),
        then set the sampling of collectives and the sending grid from the step time."""
        q = self._pend
        if not q:
            return
        if _get_ident() == self._owner:  # nothing appends while we take the queue
            self._pend = deque()
            entries = list(q)
        else:  # the loop may append meanwhile: what it adds stays for the next drain
            pop = q.popleft
            entries = [pop() for _ in range(len(q))]
        w0 = self.ring.w
        first, backend = self.drain.run(entries)
        if backend:
            self.comm_backend = backend
        # rows per entry, rounded up, plus one (a loop's first entry has no step time): the
        # queue's bound keeps a drain within half the ring, and the rows of a drain that did
        # not send (the loop's first) plus the next drain's within the whole ring
        per_entry = 1 - (-(self.ring.w - w0) // len(entries))
        self._pend_max = max(1, self.ring.capacity // (2 * per_entry))
        clock = self.clock
        prev, last = clock.prev_step, clock.last_log
        # the step time over this drain's span (every rank in lockstep sees the same), for
        # the two step grids: the sampled collectives and the sending step
        if first is not None and prev > first[1] and last > first[0]:
            per = (last - first[0]) / (prev - first[1])
        else:
            per = clock.step_time
        self.comm.resample(per, last, clock.loop_t0, clock.warm)
        self.flusher.grid = pow2(self.interval(last) / (16 * per)) if per > 0.0 else 1
        self._next_event = -1  # comm_every may have changed, or a new loop begun

    def _try_drain(self) -> None:
        """Drain on the training thread unless a pack holds the lock: that pack drains the
        queue itself, and it may be reading a CUDA value (waiting for the device), which
        the step must never wait for."""
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def has_news(self) -> bool:
        """Rows, queued entries or fingerprints not sent yet (the flusher's heartbeat)."""
        r = self.ring
        return bool(r.w != r.r or self._pend or self._side or self.fingerprints)

    def pack(self) -> dict[str, Any] | None:
        """Take every unflushed row and build one message."""
        with self._lock:
            self._drain()
            cols = self.ring.take()
            while self._side:
                step, t, name, value = self._side.popleft()
                c = cols.setdefault(name, [[], [], []])
                c[0].append(step)
                c[1].append(t)
                c[2].append(as_float(value))
            now = time.time()
            for name, value in self.memory.sample().items():
                cols[name] = [[self.cur_step], [now], [value]]
            self.seq += 1
            msg: dict[str, Any] = {
                "seq": self.seq,
                "pid": self.pid,
                "t": now,
                "cols": cols,
                "lost": self.ring.lost,
                "step": self.cur_step,
                "step_time": self.clock.step_time,
                "backend": self.comm_backend or _dist_backend(),
                "idle": self.idle(),
            }
            if self.meta:
                msg["meta"] = dict(self.meta)
            if self.cell is not None:
                msg["cell"] = self.cell
            if self.fingerprints:
                msg["fp"] = self.fingerprints.take()
            return msg

    def add_fingerprint(self, entry: dict[str, Any], on_device: bool = False) -> None:
        """Queue a parameter fingerprint for the next message (any thread; ``Fingerprints``);
        ``on_device``: it must wait for a device, so the message goes out from the flusher
        thread."""
        self.fingerprints.add(entry)
        if on_device:
            self.ring.has_objects = True  # the next message waits for a device

    def flush(self) -> None:
        """Send what was recorded since the last flush (``Flusher.flush``)."""
        self.flusher.flush()

    def close(self) -> None:
        """Stop the flusher thread and send what is left."""
        self.flusher.close()


def _numbers(metrics: dict[str, Any]) -> None:
    """``log``'s keywords as the ring keeps them, in place: numbers read (``values.number``),
    a None dropped (no value this step), ``total_steps`` an int or None (unknown). Raises
    ``values.InputError`` for a value that is no number."""
    for k, v in list(metrics.items()):
        if k == "total_steps":
            metrics[k] = total_of(v)
        elif v is None:
            del metrics[k]
        elif type(v) is not float:
            metrics[k] = number(k, v)


def _dist_backend() -> str:
    mod = sys.modules.get("torch.distributed")
    try:
        if mod is not None and mod.is_initialized():
            return str(mod.get_backend())
    except Exception:
        pass
    return ""


# ---------------------------------------------------------------------- process singleton


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
