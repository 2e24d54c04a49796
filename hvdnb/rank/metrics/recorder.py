"""Engine side of the live panel: queue points in the step, write them into a preallocated
ring once per message, flush them in batches.

Owns: ``log`` (loss and any scalar per step), ``phase`` (time a block: data / compute /
comm), the allreduce listener that ``hvdnb.torch.DistributedOptimizer`` feeds through
``hvdnb.torch.add_comm_listener``, ``ddp_comm_hook`` for plain DDP users, memory sampling
(psutil RSS; torch.cuda allocated/reserved and NVML used when there is a GPU), and
sending one sequence-numbered ``metrics`` message per flush interval over the side channel
(``hvdnb.rank.channel.get()``): from ``log`` itself while a loop logs (no GIL hand-over to
another thread), else from the flusher thread.

Step attribution: ``log(step=s)`` records step ``s`` and says "step s is done", so the
step in progress becomes ``s + 1``; ``knobs.step(s)`` (start of a step) says "step s is in
progress". Allreduce timings and ``phase`` blocks are recorded against the step in
progress. While a loop logs, the allreduce listener is registered for one step in ``k``
only (``Recorder.comm_every``: timed steps ``comm_interval`` seconds apart, 8 ms by
default, for the loop's first ``warm`` seconds, then ``comm_interval_steady`` apart, 50 ms
by default; every step when steps are longer; ``k`` a power of two, so that ranks in
lockstep time the same steps): reporting a timed collective costs the training thread
~7-9 us (cold caches, 2-rank loop of 1.4 ms steps), and its rows are drained, packed and
sent with the step's. Messages go out on a grid of steps too (the first step of a cell of
~1/16 interval once one is due), so ranks in lockstep pack on the same step and neither
waits for the other's in turn. Ints and CPU tensors become floats in ``log``
(``.item()`` on a CPU tensor never waits); other objects (a CUDA loss, an NCCL timing)
are kept as references and turned into floats on the flusher thread, so the training
thread never waits for the device.

Never: block the step, issue a collective, call ``cuda.synchronize``, import torch
(it is used only when the training code already imported it), or raise into the training
loop because the panel is absent: without an hvdnb cluster (``get()`` is None) ``log``
writes into the ring and nothing else happens.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import threading
import time
from array import array
from collections import deque
from collections.abc import Iterator
from operator import itemgetter
from typing import Any

from hvdnb.protocol import kinds
from hvdnb.rank import nvtx as _nvtx

__all__ = ["Recorder", "ddp_comm_hook", "get_recorder", "log", "phase", "set_enabled"]

#: rows the ring holds between two flushes before the oldest are overwritten (and counted)
CAPACITY = 1 << 16
#: the training loop counts as idle (knob changes then apply at once) after this long
IDLE_AFTER = 1.0
#: the longest sampling period of collective timings (steps): see Recorder.comm_every
COMM_EVERY_MAX = 64

_NUMBER = (int, float)
_NEVER = 1 << 62  # a step no loop reaches
#: kinds of the training thread's queued entries (see Recorder._drain)
_LOG, _COMM, _RECORD = 0, 1, 2
_KIND = itemgetter(0)
_METRICS = itemgetter(4)
_NOT_LOG = re.compile(rb"[^\x00]")  # entries other than log() in the drained kinds
#: more log entries than this in one drain are written with numpy (Recorder._drain_run)
_RUN_MIN = 8
_PLAIN = {int, float, bool}
#: rows from which a message's columns are grouped with numpy (see _columns)
_GROUP_NP = 256
_NP: Any = None


def _numpy() -> Any:
    global _NP
    if _NP is None:
        import numpy

        _NP = numpy
    return _NP


def _segments(logs: list[tuple[Any, ...]]) -> list[list[tuple[Any, ...]]]:
    """``logs[1:]`` cut where the number of keywords changes (a loop that logs an accuracy
    every 100 steps): runs of alike entries for ``Recorder._drain_run``."""
    if len(logs) <= _RUN_MIN + 1:
        return [logs[1:]]
    np = _numpy()
    lens = np.fromiter(map(len, map(_METRICS, logs)), np.int64, len(logs))
    cuts = (np.flatnonzero(lens[2:] != lens[1:-1]) + 2).tolist()
    return [logs[a:b] for a, b in zip([1] + cuts, cuts + [len(logs)])]


def _pow2(x: float) -> int:
    """The power of two nearest to ``x`` on a log scale (at least 1): ranks whose
    estimates differ a little still agree, and when they do not, one's grid holds the
    other's."""
    return 1 << round(math.log2(x)) if x > 1.0 else 1


_perf_counter = time.perf_counter
_get_ident = threading.get_ident


class Recorder:
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

    # what log() reads and writes on every step sits in slots, at fixed offsets in the
    # object (one or two cache lines); the other ~50 attributes are in its __dict__, too
    # many for CPython's compact instance layout, which a cold lookup pays for
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
        self._side: deque[tuple[int, float, str, float]] = deque()
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
        self._mem = _MemorySampler()
        self.comm_backend = ""
        #: set by the engine while a %%distributed cell runs (None: not under an engine)
        self.cell_running: bool | None = None
        self.pid = os.getpid()
        self._last_sent = 0.0
        self._last_sent_pc = 0.0
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
        self._on_comm = self.on_comm  # one bound method: registered and removed by identity

    @property
    def comm_every(self) -> int:
        """The collectives of step s are timed when s % comm_every == 0 (set by _drain
        from the step time; setting it takes effect at the next ``log``)."""
        return self._comm_every

    @comm_every.setter
    def comm_every(self, k: int) -> None:
        self._comm_every = int(k)
        self._next_event = -1

    # ------------------------------------------------------------------ hot path
    def _nid(self, name: str) -> int:
        i = self._name_ids.get(name)
        if i is None:
            i = self._name_ids[name] = len(self._name_list)
            self._name_list.append(name)
        return i

    def _keep(self, w: int, v: Any) -> float:
        """Row ``w``'s value ``v`` is not a float (``_scalar`` could not make it one without
        waiting): keep it to be read at the next pack; the row holds NaN until then."""
        self._objq.append((w, v))  # before the row is published (the flusher reads < _w)
        self._objects = True
        return math.nan

    def record(self, step: int, name: str, value: Any, t: float | None = None) -> None:
        """Store one point (training thread: the queue ``_drain`` writes into the ring; any
        other thread: a side queue)."""
        if t is None:
            t = time.time()
        if threading.get_ident() != self._owner:
            self._side.append((step, t, name, value))
            return
        q = self._pend
        q.append((_RECORD, t, step, name, value))
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
            loss = _scalar(loss)
        if metrics:  # tensors in it are read now too
            for v in metrics.values():
                if type(v) is not float and type(v) is not int:
                    for k, v in metrics.items():
                        metrics[k] = _scalar(v)
                    break
        self._pend.append((_LOG, now, step, loss, metrics))
        self.cur_step = step + 1
        self.last_activity = now
        if step >= self._next_event or now >= self._due:
            self._events(step, now)

    def _events(self, step: int, now: float) -> None:
        """What ``log(step)`` does on some steps only: register or remove the allreduce
        listener for the next step (timed steps: ``s % comm_every == 0``), advance the
        knobs (a planned change applies at its step), send a message when one is due; then
        set the step of the next such event. ``_drain``, ``_time_comm`` and a knob plan
        arriving set ``_next_event`` to -1 (an event at the next log)."""
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
        self._next_event = ne  # before the knobs' pending plans are read (see on_plan)
        knobs = _KNOBSET.CURRENT if _KNOBSET is not None else _knobs_mod().CURRENT
        if knobs is not None:
            knobs._advance(nxt)
            if knobs.pending:  # a change planned for a later step: look at every step
                self._next_event = nxt
        if now >= self._due:
            g = self._grid
            if g > 1 and now < self._due_late:
                cell = step // g
                if self._due_cell is None:
                    self._due_cell = cell
                if cell == self._due_cell:  # send at the first step of the next cell
                    return
            self._flush_from_loop(now)

    def _drain(self) -> None:
        """Write what the training thread queued into the ring (caller holds ``_lock``).

        Log entries become ``time/step`` (seconds per step since the previous log), the
        loss and the keyword rows; the step-time estimate and the loop start follow them.
        A value that is not a number (a tensor) is read here: a CPU tensor with
        ``.item()``; a CUDA tensor (or an NCCL timing) is kept for the flusher thread.
        A run of log entries alike (the same keywords, plain numbers, steps going up) is
        written by ``_drain_run`` with numpy; the rest one entry at a time.
        """
        q = self._pend
        if not q:
            return
        if _get_ident() == self._owner:  # nothing appends while we take the queue
            self._pend = deque()
            entries = list(q)
        else:  # the loop may append meanwhile: what it adds stays for the next drain
            pop = q.popleft
            entries = [pop() for _ in range(len(q))]
        steps, times, names, vals = self._steps, self._times, self._names, self._vals
        mask = self._mask
        w = self._w
        keep = self._keep

        def put(step: int, t: float, nid: int, v: Any) -> None:
            nonlocal w
            if type(v) is not float:
                v = _scalar(v)
                if type(v) is not float:
                    v = keep(w, v)
            i = w & mask
            steps[i] = step
            times[i] = t
            names[i] = nid
            vals[i] = v
            w += 1

        off = time.time() - _perf_counter()  # perf_counter -> wall clock, for log entries
        id_step, id_loss, ids = self._id_step, self._id_loss, self._metric_ids
        prev, last = self._prev_step, self.last_log
        st = self.step_time
        first: tuple[float, int] | None = None  # (time, step) of the first log drained

        def one(e: tuple[Any, ...]) -> None:
            nonlocal prev, last, st
            kind = e[0]
            if kind == _LOG:
                _, now, step, loss, metrics = e
                t = now + off
                if last and step > prev:
                    per = (now - last) / (step - prev)
                    put(step, t, id_step, per)
                    st = per if not st else 0.8 * st + 0.2 * per
                if now - last > IDLE_AFTER:  # a loop starts (or goes on after a pause)
                    self._loop_t0 = now
                prev, last = step, now
                if loss is not None:
                    put(step, t, id_loss, loss)
                for k, v in metrics.items():
                    nid = ids.get(k)
                    if nid is None:
                        if k == "total_steps":
                            self.meta["total_steps"] = int(v)
                            continue
                        nid = ids[k] = self._nid(_PHASE_ALIASES.get(k, k))
                    put(step, t, nid, v)
            elif kind == _COMM:
                _, t, step, name, nbytes, seconds, backend, exposed = e
                self.comm_backend = backend
                cids = self._comm_names.get(name)
                if cids is None:
                    short = name.replace("DistributedOptimizer.", "")
                    cids = (
                        self._nid(f"comm/{short}/time"),
                        self._nid(f"comm/{short}/exposed"),
                        self._nid(f"comm/{short}/bytes"),
                    )
                    if len(self._comm_names) < 4096:  # unnamed allreduces: a new name each
                        self._comm_names[name] = cids  # call, not cached
                put(step, t, cids[0], seconds)
                put(step, t, cids[1], exposed)
                put(step, t, cids[2], nbytes)
            else:  # _RECORD
                _, t, step, name, value = e
                nid = self._name_ids.get(name)
                put(step, t, nid if nid is not None else self._nid(name), value)

        # log entries first, then the rest (collectives, phases): each name's rows stay in
        # order, and the log entries of a loop, alike, are written in one go with numpy
        kinds = bytes(map(_KIND, entries))
        if kinds.count(0) == len(kinds):
            logs, rest = entries, []
        else:
            cut = [m.start() for m in _NOT_LOG.finditer(kinds)]
            rest = [entries[i] for i in cut]
            logs, a = [], 0
            for i in cut:
                logs += entries[a:i]
                a = i + 1
            logs += entries[a:]
        if logs:
            one(logs[0])  # it may start a loop (no step time before it)
            first = (last, prev)
            for seg in _segments(logs):
                got = self._drain_run(seg, w, off, prev, last, st) if len(seg) > _RUN_MIN else None
                if got is not None:
                    w, prev, last, st = got
                else:
                    for e in seg:
                        one(e)
        for e in rest:
            one(e)
        self._prev_step, self.last_log, self.step_time = prev, last, st
        # the step time over this drain's span (every rank in lockstep sees the same), for
        # the two step grids below: the sampled collectives and the sending step
        if first is not None and prev > first[1] and last > first[0]:
            per = (last - first[0]) / (prev - first[1])
        else:
            per = st
        if per > 0.0 and self.comm_interval > 0.0:
            ci = self.comm_interval
            t0 = self._loop_t0
            if t0 and last - t0 >= self.warm:  # past the loop's first seconds: sparser
                ci = max(ci, self.comm_interval_steady)
            self.comm_every = min(COMM_EVERY_MAX, _pow2(ci / per))
        else:
            self.comm_every = 1
        self._grid = _pow2(self.interval(last) / (16 * per)) if per > 0.0 else 1
        self._next_event = -1  # comm_every may have changed, or a new loop begun
        self._w = w  # published last: a pack reads rows below _w only

    def _drain_run(
        self, run: list[tuple[Any, ...]], w: int, off: float, prev: int, last: float, st: float
    ) -> tuple[int, int, float, float] | None:
        """Write log entries that follow a drained one (``prev``/``last``: its step and
        time) with numpy. None when they are not alike (other keywords, a value that is not
        a plain number, a step that does not go up, a pause that starts a loop): the
        caller writes them one by one."""
        np = _numpy()
        _, nows, steps, losses, mets = zip(*run)
        keys = list(mets[0])
        # the same keys everywhere: as many in each dict, and each key in every one (below)
        if len(set(map(len, mets))) != 1:
            return None
        ltypes = set(map(type, losses))
        has_loss = ltypes == {float}
        if not has_loss and ltypes != {type(None)}:
            return None
        cols: list[tuple[int, Any]] = []
        ids = self._metric_ids
        total = None
        for k in keys:
            try:
                col = list(map(itemgetter(k), mets))
            except KeyError:
                return None
            if not set(map(type, col)) <= _PLAIN:
                return None
            if k == "total_steps":
                total = int(col[-1])
                continue
            nid = ids.get(k)
            if nid is None:
                nid = ids[k] = self._nid(_PHASE_ALIASES.get(k, k))
            cols.append((nid, col))
        try:
            S = np.array(steps, dtype=np.int64)
        except OverflowError:  # a step beyond int64
            return None
        N = np.array(nows, dtype=np.float64)
        dS = np.diff(S, prepend=prev)
        dN = np.diff(N, prepend=last)
        n, p = len(S), 1 + has_loss + len(cols)  # rows per entry: time/step, loss, keywords
        i0 = w & self._mask
        if (dS <= 0).any() or (dN > IDLE_AFTER).any() or i0 + n * p > self.capacity:
            return None  # (the last: the rows would wrap around the ring's end)
        per = dN / dS
        if not st:
            st = float(per[0])
            tail = per[1:]
        else:
            tail = per
        m = len(tail)
        if m:  # st <- 0.8 st + 0.2 per, m times
            st = float(0.8**m * st + 0.2 * np.dot(0.8 ** np.arange(m - 1, -1, -1), tail))
        if self._npv is None:
            self._npv = (
                np.frombuffer(self._steps, np.int64),
                np.frombuffer(self._times),
                np.frombuffer(self._names, np.intc),
                np.frombuffer(self._vals),
            )
        # the block of the ring these rows fill, as (n, p) views: row k * p + j of it is
        # entry k's j-th name
        sb, tb, nb, vb = (a[i0 : i0 + n * p].reshape(n, p) for a in self._npv)
        try:
            sb[:, :] = S[:, None]
            tb[:, :] = (N + off)[:, None]
            nb[:, :] = np.array(
                [self._id_step] + [self._id_loss] * has_loss + [c[0] for c in cols], dtype=np.intc
            )
            vb[:, 0] = per
            if has_loss:
                vb[:, 1] = losses
            for j, (_, col) in enumerate(cols, 1 + has_loss):
                vb[:, j] = col
        except (OverflowError, ValueError, TypeError):  # an int too large for a float
            return None  # nothing published: the caller writes the same rows one by one
        if total is not None:
            self.meta["total_steps"] = total
        return w + n * p, int(S[-1]), float(N[-1]), st

    def _time_comm(self, on: bool) -> None:
        """Register (``on``) or remove this recorder's allreduce listener."""
        lst = self._comm_list
        if lst is None:
            return
        fn = self._on_comm
        if on:
            if fn not in lst:
                lst.append(fn)
        else:
            try:
                lst.remove(fn)
            except ValueError:
                pass
        self._comm_on = on
        self._next_event = -1

    def _try_drain(self) -> None:
        """Drain on the training thread unless a pack holds the lock: that pack drains the
        queue itself, and it may be reading a CUDA value (waiting for the device), which
        the step must never wait for."""
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def logged_step(self) -> int:
        """The last step given to ``log`` (-1: none in this loop), drained or not."""
        try:
            for e in reversed(self._pend):
                if e[0] == _LOG:
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
            self.record(step, _PHASE_ALIASES.get(k, k), v, t)
        self.mark(step + 1, now)
        knobs = _knobs_mod().CURRENT
        if knobs is not None:
            knobs._advance(step + 1)
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

    def on_comm(
        self, name: str, nbytes: int, seconds: Any, backend: str, exposed: float = math.nan
    ) -> None:
        """``hvdnb.torch`` comm listener: one collective (or fused bucket) just completed.

        Records ``comm/<name>/time`` (the collective's own duration; a CUDA-event span is
        kept as an object and read on the flusher thread), ``comm/<name>/exposed`` (what
        the training thread waited for it) and ``comm/<name>/bytes``.
        """
        if not self.enabled:
            return
        t = time.time()
        if threading.get_ident() == self._owner:
            q = self._pend
            q.append((_COMM, t, self.cur_step, name, nbytes, seconds, backend, exposed))
            if len(q) > self.capacity:  # no log() drains it (allreduces alone, no channel)
                self._try_drain()
            return
        self.comm_backend = backend
        step = self.cur_step
        short = name.replace("DistributedOptimizer.", "")
        for n_, v_ in (
            (f"comm/{short}/time", seconds),
            (f"comm/{short}/exposed", exposed),
            (f"comm/{short}/bytes", nbytes),
        ):
            self._side.append((step, t, n_, v_))

    # ------------------------------------------------------------------ flushing
    def _ensure_flusher(self) -> None:
        if self._thread is None and self.channel is not None:
            self._thread = threading.Thread(
                target=self._run, name="hvdnb-metrics-flush", daemon=True
            )
            self._thread.start()

    def _flush_from_loop(self, now: float) -> None:
        """log() found a message due: send it from here, the training thread.

        Packing costs ~0.1 ms per interval; on the flusher thread the same work took the
        GIL from the training thread, and on a loaded machine each hand-over of the GIL
        costs the training thread a wake-up (ms). The flusher thread then only covers a
        loop that stopped logging (see ``_run``)."""
        self._try_drain()  # also without a channel: the queue stays one interval long
        first = not self._due  # the first message goes out one interval after the first log
        every = self.interval(now)
        self._due = now + every
        self._due_late = self._due + 0.25 * every
        self._due_cell = None
        if self.channel is None:
            return
        if self._thread is None:
            self._ensure_flusher()
        if first or not self.flush_in_loop:
            return
        if self._objects:  # a value to read (a CUDA tensor must wait for its device):
            self._kick.set()  # not in the step; the flusher thread sends this one
            return
        if not self._send_lock.acquire(blocking=False):
            return  # the flusher thread is sending right now: that message carries the rows
        try:
            self._send()
        except Exception as exc:  # the panel must never break training
            print(f"hvdnb: metrics flush failed: {exc!r}", file=sys.stderr)
        finally:
            self._send_lock.release()

    def interval(self, now: float | None = None) -> float:
        """Seconds between two messages now: ``flush_interval`` while no loop runs and for
        the first ``warm`` seconds of one (quick first points, knob effects seen at once),
        ``steady_interval`` after that (fewer messages: each costs the ranks CPU)."""
        t0 = self._loop_t0
        if not t0 or self.idle():
            return self.flush_interval
        now = time.perf_counter() if now is None else now
        return self.steady_interval if now - t0 >= self.warm else self.flush_interval

    def _run(self) -> None:
        wait = self.flush_interval
        while True:
            kicked = self._kick.wait(wait)
            if self._stop.is_set():
                return
            if kicked:
                self._kick.clear()
            wait = self.flush_interval
            if not kicked and self.flush_in_loop and not self.idle():
                # a loop is logging and sends from log(); wake rarely, and only take over
                # when it has not sent for a while (a slow step: its phase and allreduce
                # rows, recorded between two log() calls, still go out)
                every = self.interval()
                since = time.perf_counter() - self._last_sent_pc
                if since < 2 * every:
                    wait = max(every, 4 * every - since)
                    continue
            try:
                self.flush()
            except Exception as exc:  # the panel must never break training
                print(f"hvdnb: metrics flush failed: {exc!r}", file=sys.stderr)

    def idle(self) -> bool:
        """No loop is running: no cell runs on this engine, or no step boundary for a
        while (slow steps are not idle)."""
        if self.cell_running is False:
            return True
        if not self.last_activity:
            return True
        quiet = time.perf_counter() - self.last_activity
        return quiet > max(IDLE_AFTER, 3 * self.step_time)

    def pack(self) -> dict[str, Any] | None:
        """Take every unflushed row and build one message (None when there is nothing new
        and the last message is recent)."""
        with self._lock:
            self._drain()
            # cleared before w is read: an object stored after this is flagged again; the
            # queue itself, not the flag, says which rows below w hold objects to read
            self._objects = False
            w = self._w
            r = self._r
            lost = 0
            if w - r > self.capacity:  # the ring was lapped: the oldest rows are gone
                lost = w - r - self.capacity
                r = w - self.capacity
            # copy the rows out with slices (C speed) while the writer goes on above w
            a, b = r & self._mask, w & self._mask
            if w - r == 0:
                cols: dict[str, list[Any]] = {}
            else:
                parts = []
                for col in (self._steps, self._times, self._names, self._vals):
                    # wrapped around the end of the ring (or exactly full): two slices
                    parts.append(col[a:b] if a < b else col[a:] + col[:b])
                steps, times, nids, vals = parts
                if self._objq:
                    self._read_objects(vals, r, w)
                cols = _columns(steps, times, nids, vals, self._name_list)
            q = self._objq  # rows overwritten by a lap: their objects are dropped unread
            while q and q[0][0] < w:
                q.popleft()
            # a flush racing the writer may have read a row being overwritten: only the
            # lapped case can do that, and then it is counted as lost
            self._r = w
            while self._side:
                step, t, name, value = self._side.popleft()
                c = cols.setdefault(name, [[], [], []])
                c[0].append(step)
                c[1].append(t)
                c[2].append(_as_float(value))
            self.overwritten += lost
            now = time.time()
            for name, value in self._mem.sample().items():
                cols[name] = [[self.cur_step], [now], [value]]
            self.seq += 1
            msg: dict[str, Any] = {
                "seq": self.seq,
                "pid": self.pid,
                "t": now,
                "cols": cols,
                "lost": self.overwritten,
                "step": self.cur_step,
                "step_time": self.step_time,
                "backend": self.comm_backend or _dist_backend(),
                "idle": self.idle(),
            }
            if self.meta:
                msg["meta"] = dict(self.meta)
            return msg

    def _read_objects(self, vals: array, r: int, w: int) -> None:
        """Fill the NaN placeholders of rows ``r``..``w`` with their objects' values."""
        q = self._objq
        while q and q[0][0] < w:
            row, obj = q.popleft()
            if row >= r:
                vals[row - r] = _as_float(obj)

    def flush(self) -> None:
        """Send what was recorded since the last flush (also called at the end of a loop)."""
        if self.channel is None:
            return
        if self._w == self._r and not self._pend and not self._side and self.idle():
            # nothing new: a heartbeat every 4 intervals keeps memory readings fresh
            if self.seq and time.time() - self._last_sent < 4 * self.flush_interval:
                return
        with self._send_lock:
            self._send()

    def _send(self) -> None:  # under _send_lock
        msg = self.pack()
        if msg is None:
            return
        self._last_sent = msg["t"]
        self._last_sent_pc = time.perf_counter()
        self.channel.send(kinds.METRICS, **msg)

    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(2)
            self._thread = None
        self.flush()


_KNOBSET: Any = None


def _knobs_mod() -> Any:
    global _KNOBSET
    if _KNOBSET is None:
        import importlib

        _KNOBSET = importlib.import_module(__package__ + ".knobs")
    return _KNOBSET


_PHASE_ALIASES = {
    "data_time": "time/data",
    "compute_time": "time/compute",
    "comm_time": "time/comm",
}


def _scalar(v: Any) -> Any:
    """``v`` as a float when that is cheap and never waits for a device: an int, or a CPU
    tensor of one element (~0.2 us warm, ~2.5 us in a loop); anything else as it is, read
    by ``_as_float`` at the next pack, on whichever thread sends (a CUDA tensor must not be
    read in the step)."""
    try:
        if getattr(v, "is_cpu", False):  # ``tolist`` reads a 0-d tensor ~20 % quicker
            return float(v.tolist() if v.ndim == 0 else v.item())  # than ``item`` (in a loop)
        if isinstance(v, _NUMBER):  # int, bool, numpy's float64
            return float(v)
        if type(v).__module__ == "numpy":  # numpy's other scalars
            return float(v)
    except Exception:  # an int too large for a float, a tensor of many elements: NaN later
        pass
    return v


def _as_float(v: Any) -> float:
    if type(v) is float:
        return v
    try:
        item = getattr(v, "item", None)  # a tensor: read here, on the flusher thread
        return float(item() if item is not None else v)
    except Exception:
        return math.nan


def _period(nids: list[int]) -> int:
    """The length p of the repeating pattern of names when every step records the same
    names in the same order (row k has the name of row k % p), else 0."""
    n = len(nids)
    first = nids[0]
    try:
        p = nids.index(first, 1)
    except ValueError:
        p = n
    head = nids[:p]
    if len(set(head)) != p:
        return 0
    for k in range(p):
        col = nids[k::p]
        if col.count(head[k]) != len(col):
            return 0
    return p


def _columns(
    steps: array, times: array, nids: array, vals: array, names: list[str]
) -> dict[str, list[Any]]:
    """Group rows (in order) into ``{name: [steps, times, values]}`` (typed arrays)."""
    cols: dict[str, list[Any]] = {}
    p = _period(nids)
    if p:  # the usual loop: strided slices, no per-row Python work
        for k in range(p):
            cols[names[nids[k]]] = [steps[k::p], times[k::p], vals[k::p]]
        return cols
    if len(nids) >= _GROUP_NP:  # a loop's rows with timed collectives among them
        np = _numpy()
        nv = np.frombuffer(nids, np.intc)
        order = np.argsort(nv, kind="stable")  # row order kept within a name
        ids, starts = np.unique(nv[order], return_index=True)
        ends = list(starts[1:]) + [len(nv)]
        sv, tv, vv = (np.frombuffer(steps, np.int64), np.frombuffer(times), np.frombuffer(vals))
        groups = sorted(zip(order[starts].tolist(), ids.tolist(), starts.tolist(), ends))
        for _, i, a, b in groups:  # names in the order they first appear, as below
            ix = order[a:b]
            cols[names[i]] = [
                array("q", sv[ix].tobytes()),
                array("d", tv[ix].tobytes()),
                array("d", vv[ix].tobytes()),
            ]
        return cols
    rows: dict[int, list[int]] = {}
    for k, i in enumerate(nids):
        ix = rows.get(i)
        if ix is None:
            rows[i] = [k]
        else:
            ix.append(k)
    for i, ix in rows.items():
        if len(ix) == 1:
            k = ix[0]
            cols[names[i]] = [
                array("q", (steps[k],)),
                array("d", (times[k],)),
                array("d", (vals[k],)),
            ]
        else:
            get = itemgetter(*ix)
            cols[names[i]] = [array("q", get(steps)), array("d", get(times)), array("d", get(vals))]
    return cols


def _dist_backend() -> str:
    mod = sys.modules.get("torch.distributed")
    try:
        if mod is not None and mod.is_initialized():
            return str(mod.get_backend())
    except Exception:
        pass
    return ""


class _MemorySampler:
    """Memory readings at flush time; a reading that cannot be taken is left out (the
    panel shows "n/a"), never reported as 0."""

    def __init__(self) -> None:
        self._proc: Any = None
        self._nvml: Any = None
        self._nvml_tried = False
        try:
            import psutil

            self._proc = psutil.Process()
        except Exception:
            pass

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self._proc is not None:
            try:
                out["mem/rss"] = float(self._proc.memory_info().rss)
            except Exception:
                pass
        torch = sys.modules.get("torch")
        if torch is None:
            return out
        try:
            cuda = torch.cuda
            if cuda.is_available() and cuda.is_initialized():
                dev = cuda.current_device()
                out["mem/gpu_allocated"] = float(cuda.memory_allocated(dev))
                out["mem/gpu_reserved"] = float(cuda.memory_reserved(dev))
                used = self._nvml_used(dev)
                if used is not None:
                    out["mem/gpu_nvml_used"] = used
        except Exception:
            pass
        return out

    def _nvml_used(self, dev: int) -> float | None:
        if not self._nvml_tried:
            self._nvml_tried = True
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception:
                self._nvml = None
        if self._nvml is None:
            return None
        nvml = self._nvml
        try:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            ids = [v.strip() for v in visible.split(",") if v.strip()]
            index = int(ids[dev]) if dev < len(ids) and ids[dev].isdigit() else dev
            h = nvml.nvmlDeviceGetHandleByIndex(index)
            v2 = getattr(nvml, "nvmlMemory_v2", None)
            if v2 is not None:
                try:  # "used" as nvidia-smi shows it: the driver's reserve is not in it
                    return float(nvml.nvmlDeviceGetMemoryInfo(h, version=v2).used)
                except Exception:  # an older driver: v1, whose "used" counts the reserve
                    pass
            return float(nvml.nvmlDeviceGetMemoryInfo(h).used)
        except Exception:
            return None


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
            _install_comm_listener(rec)
            _RECORDER = rec
    return _RECORDER


def _install_comm_listener(rec: Recorder) -> None:
    # only when hvdnb.torch is already imported: never import torch for the panel's sake
    if "hvdnb.torch" in sys.modules or "torch" in sys.modules:
        try:
            from hvdnb.torch import listeners

            rec._comm_list = listeners.LISTENERS
            rec._time_comm(True)
        except Exception:
            pass


def set_enabled(on: bool) -> None:
    """Switch recording on or off in this process.

    Off, ``log`` returns at once, ``phase`` records nothing and the allreduce listener is
    unregistered, so ``hvdnb.torch`` takes its untimed paths (no clock reads, the planned
    fast path for named allreduces): a loop runs as it would without the panel. On
    registers the listener again.
    """
    rec = get_recorder()
    rec.enabled = bool(on)
    if on:
        _install_comm_listener(rec)
    else:
        rec._time_comm(False)
        rec._comm_list = None


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
    rec._log(step, loss, metrics)


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


def ddp_comm_hook(model: Any, state: Any = None) -> Any:
    """Register a DDP communication hook that records each bucket's allreduce timings.

    For plain ``torch.nn.parallel.DistributedDataParallel`` users (hvdnb.torch's
    DistributedOptimizer reports by itself). The hook is torch's ``allreduce_hook``; per
    bucket and step it records, never waiting for the device (no ``cuda.synchronize``):

    - ``comm/ddp.bucket.<i>/time``, the collective's own duration: from when it could
      start (its launch, or the previous bucket's completion when the backend was still
      busy with that one: Gloo runs a group's collectives in order) to its completion;
      on CUDA (NCCL) the host cannot see the stream, so this is "n/a" (NaN). A rank
      that starts a bucket before its peers also counts waiting for them (the store
      takes the smallest reading over the ranks as the collective's time), and the
      completion is seen when Gloo's thread gets the GIL, so a bucket that completes
      while the training thread still runs Python reads late: measured on 2 CPU ranks,
      6 buckets of 257 KB read 0.4-0.9 ms where the same allreduce alone took 0.45-0.65
      ms, except the first of each step, 1.7-2.4 ms. On CUDA (NCCL) it is NCCL's own
      kernel time (``Work._get_duration()``: CUDA events ProcessGroupNCCL records on its
      stream; ``TORCH_NCCL_ENABLE_TIMING=1``, which hvdnb's rendezvous sets), read on the
      flusher thread; "n/a" (NaN) for a group made without timing;
    - ``comm/ddp.bucket.<i>/exposed``, communication the step waited for: DDP waits for
      every bucket once the last one is launched (backward compute is over), so a bucket
      completing after that instant exposes the time since the later of that instant
      and the previous completion; buckets done earlier were hidden behind backward (0).
      On CUDA "n/a" (NaN): DDP makes the stream wait inside its C++ reducer, where no
      event can be placed (hvdnb.torch's DistributedOptimizer measures it on the GPU);
    - ``comm/ddp.bucket.<i>/bytes``.

    Parameters
    ----------
    model : a DistributedDataParallel module
    state : the process group (default: the default group)

    Returns
    -------
    the model, with the hook registered
    """
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    rec = get_recorder()
    backend = str(dist.get_backend(state) if state is not None else dist.get_backend())
    # this step's clock: when the last bucket was launched (0: not yet), the previous
    # bucket's completion; the hook runs on the training thread, completions on Gloo's
    clock = {"last_launch": 0.0, "prev_done": 0.0}
    lock = threading.Lock()

    # no annotations: DDP rejects a hook whose annotations are not exactly GradBucket and
    # torch.futures.Future (this module's are strings under `from __future__ import`)
    def hook(st, bucket):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        step = rec.cur_step
        idx = bucket.index()
        is_last = bucket.is_last()
        buf = bucket.buffer()
        cuda = bool(buf.is_cuda)
        nbytes = float(buf.numel() * buf.element_size())
        if cuda:  # allreduce_hook's own steps, keeping the Work for NCCL's kernel time
            from hvdnb.torch.rounds import _NcclSeconds

            group = st if st is not None else dist.group.WORLD
            buf.div_(group.size())
            work = dist.all_reduce(buf, group=group, async_op=True)
            t = time.time()
            rec._side.append((step, t, f"comm/ddp.bucket.{idx}/time", _NcclSeconds(work)))
            rec._side.append((step, t, f"comm/ddp.bucket.{idx}/exposed", math.nan))
            rec._side.append((step, t, f"comm/ddp.bucket.{idx}/bytes", nbytes))
            rec.comm_backend = backend
            return work.get_future().then(lambda f: f.value()[0])
        if is_last:
            with lock:
                clock["last_launch"] = t0
        fut = allreduce_hook(st, bucket)

        def done(f: Any) -> Any:
            t1 = time.perf_counter()
            with lock:
                prev = clock["prev_done"]
                start = max(t0, prev)
                last = clock["last_launch"]
                exposed = max(0.0, t1 - max(last, prev)) if last else 0.0
                clock["prev_done"] = t1
                if is_last:  # every bucket of this step is done: the next step starts afresh
                    clock["last_launch"] = clock["prev_done"] = 0.0
            t = time.time()
            rec._side.append((step, t, f"comm/ddp.bucket.{idx}/time", t1 - start))
            rec._side.append((step, t, f"comm/ddp.bucket.{idx}/exposed", exposed))
            rec._side.append((step, t, f"comm/ddp.bucket.{idx}/bytes", nbytes))
            rec.comm_backend = backend
            return f.value()

        return fut.then(done)

    model.register_comm_hook(state, hook)
    return model
