"""The recorder's ring: the training thread's queue written into preallocated typed columns
once per message (``_drain``), and a message packed from them (``pack``).

Owns: ``Ring`` (a part of ``hvdnb.rank.metrics.recorder.Recorder``: ``_drain``,
``_drain_run``, ``_try_drain``, ``pack``), the grouping of rows into a message's columns
(``_columns``, ``_period``, ``_segments``) and the reading of values (``scalar`` in the
step: never waits; ``_as_float`` at pack: may wait for a CUDA value, off the step). Never:
wait in the training thread (a pack that holds the lock is never waited for), issue a
collective, import torch, or send (the flusher sends what ``pack`` returns).
"""

from __future__ import annotations

import math
import re
import sys
import threading
import time
from array import array
from collections import deque
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

from hvdnb.rank.metrics.state import COMM, COMM_EVERY_MAX, IDLE_AFTER, LOG, RecorderState

__all__ = ["PHASE_ALIASES", "Ring", "scalar"]

_NUMBER = (int, float)
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
    return [logs[a:b] for a, b in zip([1, *cuts], [*cuts, len(logs)])]


def _pow2(x: float) -> int:
    """The power of two nearest to ``x`` on a log scale (at least 1): ranks whose
    estimates differ a little still agree, and when they do not, one's grid holds the
    other's."""
    return 1 << round(math.log2(x)) if x > 1.0 else 1


_perf_counter = time.perf_counter
_get_ident = threading.get_ident

PHASE_ALIASES = {
    "data_time": "time/data",
    "compute_time": "time/compute",
    "comm_time": "time/comm",
}


class Ring(RecorderState):
    """The ring and the queue's drain: a part of ``Recorder`` (no fields of its own)."""

    __slots__ = ()

    def _keep(self, w: int, v: Any) -> float:
        """Row ``w``'s value ``v`` is not a float (``_scalar`` could not make it one without
        waiting): keep it to be read at the next pack; the row holds NaN until then."""
        self._objq.append((w, v))  # before the row is published (the flusher reads < _w)
        self._objects = True
        return math.nan

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
                v = scalar(v)
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
            if kind == LOG:
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
                        nid = ids[k] = self._nid(PHASE_ALIASES.get(k, k))
                    put(step, t, nid, v)
            elif kind == COMM:
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
            else:  # RECORD
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
                nid = ids[k] = self._nid(PHASE_ALIASES.get(k, k))
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

    def _try_drain(self) -> None:
        """Drain on the training thread unless a pack holds the lock: that pack drains the
        queue itself, and it may be reading a CUDA value (waiting for the device), which
        the step must never wait for."""
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

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
                parts: list[array[Any]] = []
                ring: tuple[array[Any], ...] = (self._steps, self._times, self._names, self._vals)
                for col in ring:
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
            if self.cell is not None:
                msg["cell"] = self.cell
            if self._fp:
                msg["fp"] = self._take_fingerprints()
            return msg

    def add_fingerprint(self, entry: dict[str, Any], on_device: bool = False) -> None:
        """Queue a parameter fingerprint for the next message (any thread): ``entry``'s
        ``sums`` and ``scale`` are lists, or tensors read at the pack; ``on_device``: they
        must wait for a device, so the message goes out from the flusher thread."""
        self._fp.append(entry)
        if on_device:
            self._objects = True

    def _take_fingerprints(self) -> list[dict[str, Any]]:
        """The parameter fingerprints queued since the last pack, their values read now (a
        CUDA fingerprint waits for its device here, off the step: see ``_flush_from_loop``)."""
        out = []
        q = self._fp
        while q:
            e = q.popleft()
            try:
                for k in ("sums", "scale"):
                    v = e[k]
                    e[k] = [float(x) for x in (v.tolist() if hasattr(v, "tolist") else v)]
            except Exception:  # a device gone, a tensor freed: this fingerprint is lost
                continue
            out.append(e)
        return out

    def _read_objects(self, vals: array[float], r: int, w: int) -> None:
        """Fill the NaN placeholders of rows ``r``..``w`` with their objects' values."""
        q = self._objq
        while q and q[0][0] < w:
            row, obj = q.popleft()
            if row >= r:
                vals[row - r] = _as_float(obj)


def scalar(v: Any) -> Any:
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


def _period(nids: Sequence[int]) -> int:
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
    steps: array[int], times: array[float], nids: array[int], vals: array[float], names: list[str]
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
        ends = [*starts[1:], len(nv)]
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
