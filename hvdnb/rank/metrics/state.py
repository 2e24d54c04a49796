"""The recorder's fields, in one place: what the hot path (``recorder``), the ring
(``ring``), collective timing (``comm``) and the flusher (``flusher``) share, and the loop
state read from them (``idle``, ``interval``, ``comm_every``).

Owns: ``RecorderState`` (the base of ``hvdnb.rank.metrics.recorder.Recorder``: its slots,
its ``__init__``, the name table), the format of the training thread's queue (``LOG``,
``COMM``, ``RECORD`` entries) and the recorder's sizes and thresholds. Never: do work
(no threads, no I/O, no drain), import torch, or import another part of the recorder but
the memory sampler.
"""

from __future__ import annotations

import os
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable
from typing import Any

from hvdnb.rank.metrics.memory import MemorySampler

__all__ = ["CAPACITY", "COMM", "COMM_EVERY_MAX", "IDLE_AFTER", "LOG", "RECORD", "RecorderState"]

#: rows the ring holds between two flushes before the oldest are overwritten (and counted)
CAPACITY = 1 << 16
#: the training loop counts as idle (knob changes then apply at once) after this long
IDLE_AFTER = 1.0
#: the longest sampling period of collective timings (steps): see Recorder.comm_every
COMM_EVERY_MAX = 64
#: kinds of the training thread's queued entries (see Ring._drain): ``log`` appends
#: ``(LOG, now, step, loss, metrics)``, ``on_comm`` ``(COMM, t, step, name, nbytes,
#: seconds, backend, exposed)``, ``record`` ``(RECORD, t, step, name, value)``
LOG, COMM, RECORD = 0, 1, 2


class RecorderState:
    """The fields of a ``Recorder`` (see its docstring for the parameters)."""

    # what log() reads and writes on every step sits in slots, at fixed offsets in the
    # object (one or two cache lines); the other ~50 attributes are in its __dict__, too
    # many for CPython's compact instance layout, which a cold lookup pays for. The parts
    # (Ring, CommTiming, Flusher, Recorder) add no slots: the layout is this class's.
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

    #: the comm listener registered and removed by identity (set by Recorder.__init__)
    _on_comm: Callable[..., None]

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
        self.channel = channel
        self.flush_interval = float(flush_interval)
        self.steady_interval = float(flush_interval if steady_interval is None else steady_interval)
        self.warm = float(warm)
        self._loop_t0 = 0.0  # perf_counter of the first log() of the running loop
        if capacity < 2 or capacity & (capacity - 1):
            raise ValueError(f"capacity must be a power of two, not {capacity}")
        self.capacity = capacity
        self._mask = capacity - 1
        # preallocated typed columns: the hot path only stores C numbers into them (no
        # Python objects kept alive, none freed when a slot is reused), and a message is
        # cut out of them with slices
        self._steps = array("q", bytes(8 * capacity))
        self._times = array("d", bytes(8 * capacity))
        self._names = array("i", bytes(4 * capacity))
        self._vals = array("d", bytes(8 * capacity))
        # (row, object) for values that are not numbers yet (a CUDA loss, an NCCL timing):
        # their row holds NaN until the next pack reads them (off the training thread)
        self._objq: deque[tuple[int, Any]] = deque()
        self._objects = False  # a value that is not a float was stored since the last pack
        self._w = 0  # rows written (monotonic); only the training thread writes it
        self._r = 0  # rows flushed; only the flusher writes it
        self._name_ids: dict[str, int] = {}
        self._name_list: list[str] = []
        self._sent_names = 0
        self._comm_names: dict[str, tuple[int, int, int]] = {}
        self._metric_ids: dict[str, int] = {}  # log()'s keyword -> name id (aliases applied)
        self._id_step = self._nid("time/step")
        self._id_loss = self._nid("loss")
        # events from other threads (DDP hook futures, gloo callbacks): deque.append is atomic
        self._side: deque[tuple[int, float, str, Any]] = deque()
        # what the training thread recorded since the last drain, as it was given: log,
        # on_comm and record append one tuple each and do nothing else (see _drain)
        self._pend: deque[tuple[Any, ...]] = deque()
        self.cur_step = 0  # the step in progress
        self._prev_step = -1  # the last step given to log()
        self.last_log = 0.0  # perf_counter of the last log()
        self.last_activity = 0.0  # perf_counter of the last log() or knobs.step()
        self._last_mark = 0.0
        self.step_time = 0.0  # EWMA of the time between two log() calls
        self.seq = 0
        self.overwritten = 0
        self.meta: dict[str, Any] = {}
        self.enabled = True
        self._owner = threading.get_ident()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._kick = threading.Event()  # wakes the flusher thread now (and on close)
        self._lock = threading.Lock()  # serialises flushes (thread vs explicit flush())
        # held from packing to sending: two flushes (the flusher thread, an explicit or
        # end-of-cell flush) must send their sequence numbers in order
        self._send_lock = threading.Lock()
        self._mem = MemorySampler()
        self.comm_backend = ""
        #: set by the engine while a %%distributed cell runs (None: not under an engine)
        self.cell_running: bool | None = None
        #: the number of the cell whose loop logs (None: not under an engine); each message
        #: says it, so the notebook watches a late message of a finished cell's loop no more
        self.cell: int | None = None
        self.pid = os.getpid()
        self._last_sent = 0.0
        self._last_sent_pc = 0.0
        #: the channel's ``queued`` count just after this recorder's last message
        self._sent_mark = 0
        #: perf_counter time at which log() sends the next message itself (see _run)
        self._due = 0.0
        #: once a message is due, log() sends it at the first step of the next cell of
        #: ``_grid`` steps (set by _drain: ~1/16 of an interval, a power of two), so that
        #: ranks in lockstep pack on the same step and a peer never waits for each in turn;
        #: ``_due_cell``: the cell the first log() past ``_due`` was in (None: none yet);
        #: past ``_due_late`` it sends at once
        self._grid = 1
        self._due_cell: int | None = None
        #: the step at which log() next calls _events (-1: at the next log)
        self._next_event = -1
        self._due_late = 0.0
        #: while recording is off (``set_enabled``): seconds that were left to ``_due`` and
        #: ``_due_late``, put back when it goes on again
        self._paused: tuple[float, float] | None = None
        self._npv: Any = None  # numpy views of the ring's columns (see _drain_run)
        #: send from the training thread at log() when a message is due (see _run)
        self.flush_in_loop = True
        self.comm_interval = float(comm_interval)
        self.comm_interval_steady = float(
            comm_interval if comm_interval_steady is None else comm_interval_steady
        )
        self._comm_every = 1
        # hvdnb.torch's listener list while this recorder times collectives (None: it
        # does not: hvdnb.torch is not loaded, or recording is off); _comm_on: registered
        self._comm_list: list[Any] | None = None
        self._comm_on = False
        self._torch_noticed = False  # attached to hvdnb.torch (see CommTiming.notice_torch)
        #: parameter fingerprints taken since the last pack (``hvdnb.rank.metrics.fingerprint``:
        #: dicts, appended from the training thread or DDP's hook thread), sent as ``fp``; a
        #: loop that never sends keeps only the newest
        self._fp: deque[dict[str, Any]] = deque(maxlen=256)

    @property
    def comm_every(self) -> int:
        """The collectives of step s are timed when s % comm_every == 0 (set by _drain
        from the step time; setting it takes effect at the next ``log``)."""
        return self._comm_every

    @comm_every.setter
    def comm_every(self, k: int) -> None:
        self._comm_every = int(k)
        self._next_event = -1

    def _nid(self, name: str) -> int:
        i = self._name_ids.get(name)
        if i is None:
            i = self._name_ids[name] = len(self._name_list)
            self._name_list.append(name)
        return i

    def interval(self, now: float | None = None) -> float:
        """Seconds between two messages now: ``flush_interval`` while no loop runs and for
        the first ``warm`` seconds of one (quick first points, knob effects seen at once),
        ``steady_interval`` after that (fewer messages: each costs the ranks CPU)."""
        t0 = self._loop_t0
        if not t0 or self.idle():
            return self.flush_interval
        now = time.perf_counter() if now is None else now
        return self.steady_interval if now - t0 >= self.warm else self.flush_interval

    def idle(self) -> bool:
        """No loop is running: no cell runs on this engine, or no step boundary for a
        while (slow steps are not idle)."""
        if self.cell_running is False:
            return True
        if not self.last_activity:
            return True
        quiet = time.perf_counter() - self.last_activity
        return quiet > max(IDLE_AFTER, 3 * self.step_time)
