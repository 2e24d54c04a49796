"""The drain: the training thread's queued entries written into the ring as rows, once per
message, on warm caches (the hot path only appends tuples).

Owns: ``Drain`` (the ids of ``log``'s keywords and of the collectives' rows, the decoding of
``LOG``, ``COMM`` and ``RECORD`` entries, and the numpy write of a run of alike log entries);
it is handed the ring it writes, the loop clock it advances and the recorder's ``meta``
(``total_steps``). Never: wait (a value that is not a number yet is kept for the take),
issue a collective, import torch, or take the recorder's lock (its caller holds it).
"""

from __future__ import annotations

import re
import time
from operator import itemgetter
from typing import Any

from hvdnb.rank.metrics.ring import Ring, numpy, scalar
from hvdnb.rank.metrics.state import COMM, IDLE_AFTER, LOG, LoopClock

__all__ = ["PHASE_ALIASES", "Drain"]

_KIND = itemgetter(0)
_METRICS = itemgetter(4)
_NOT_LOG = re.compile(rb"[^\x00]")  # entries other than log() in the drained kinds
#: more log entries than this in one drain are written with numpy (Drain._run)
_RUN_MIN = 8
_PLAIN = {int, float, bool}
_perf_counter = time.perf_counter

PHASE_ALIASES = {
    "data_time": "time/data",
    "compute_time": "time/compute",
    "comm_time": "time/comm",
}


def _segments(logs: list[tuple[Any, ...]]) -> list[list[tuple[Any, ...]]]:
    """``logs[1:]`` cut where the number of keywords changes (a loop that logs an accuracy
    every 100 steps): runs of alike entries for ``Drain._run``."""
    if len(logs) <= _RUN_MIN + 1:
        return [logs[1:]]
    np = numpy()
    lens = np.fromiter(map(len, map(_METRICS, logs)), np.int64, len(logs))
    cuts = (np.flatnonzero(lens[2:] != lens[1:-1]) + 2).tolist()
    return [logs[a:b] for a, b in zip([1, *cuts], [*cuts, len(logs)])]


def _split(entries: list[tuple[Any, ...]]) -> tuple[list[Any], list[Any]]:
    """(log entries, the rest) in order: each name's rows stay in order, and the log
    entries of a loop, alike, are written in one go with numpy."""
    kinds = bytes(map(_KIND, entries))
    if kinds.count(0) == len(kinds):
        return entries, []
    cut = [m.start() for m in _NOT_LOG.finditer(kinds)]
    rest = [entries[i] for i in cut]
    logs: list[Any] = []
    a = 0
    for i in cut:
        logs += entries[a:i]
        a = i + 1
    logs += entries[a:]
    return logs, rest


class Drain:
    """Writes queued entries into ``ring`` and advances ``clock`` (see ``run``)."""

    def __init__(self, ring: Ring, clock: LoopClock, meta: dict[str, Any]) -> None:
        self.ring = ring
        self.clock = clock
        self.meta = meta
        self.metric_ids: dict[str, int] = {}  # log()'s keyword -> name id (aliases applied)
        self.comm_ids: dict[str, tuple[int, int, int]] = {}  # collective -> its 3 row ids
        self.id_step = ring.nid("time/step")
        self.id_loss = ring.nid("loss")

    def _keyword_id(self, k: str) -> int:
        nid = self.metric_ids[k] = self.ring.nid(PHASE_ALIASES.get(k, k))
        return nid

    def _comm(self, name: str) -> tuple[int, int, int]:
        short = name.replace("DistributedOptimizer.", "")
        nid = self.ring.nid
        cids = (nid(f"comm/{short}/time"), nid(f"comm/{short}/exposed"), nid(f"comm/{short}/bytes"))
        if len(self.comm_ids) < 4096:  # unnamed allreduces: a new name each call, not cached
            self.comm_ids[name] = cids
        return cids

    def run(self, entries: list[tuple[Any, ...]]) -> tuple[tuple[float, int] | None, str]:
        """Write ``entries`` into the ring; returns ((time, step) of the first log entry, or
        None; the backend of the last collective drained, or "").

        Log entries become ``time/step`` (seconds per step since the previous log), the
        loss and the keyword rows; the step-time estimate and the loop start follow them.
        A value that is not a number (a tensor) is read here: a CPU tensor with
        ``.item()``; a CUDA tensor (or an NCCL timing) is kept for the take. A run of log
        entries alike (the same keywords, plain numbers, steps going up) is written by
        ``_run`` with numpy; the rest one entry at a time.
        """
        ring, clock = self.ring, self.clock
        steps, times, names, vals = ring.steps, ring.times, ring.names, ring.vals
        mask = ring.mask
        w = ring.w
        keep = ring.keep

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
        id_step, id_loss, ids = self.id_step, self.id_loss, self.metric_ids
        prev, last, st = clock.prev_step, clock.last_log, clock.step_time
        backend = ""

        def one(e: tuple[Any, ...]) -> None:
            nonlocal prev, last, st, backend
            kind = e[0]
            if kind == LOG:
                _, now, step, loss, metrics = e
                t = now + off
                if last and step > prev:
                    per = (now - last) / (step - prev)
                    put(step, t, id_step, per)
                    st = per if not st else 0.8 * st + 0.2 * per
                if now - last > IDLE_AFTER:  # a loop starts (or goes on after a pause)
                    clock.loop_t0 = now
                prev, last = step, now
                if loss is not None:
                    put(step, t, id_loss, loss)
                for k, v in metrics.items():
                    nid = ids.get(k)
                    if nid is None:
                        if k == "total_steps":  # None: the loop's length is unknown
                            self.meta["total_steps"] = None if v is None else int(v)
                            continue
                        nid = self._keyword_id(k)
                    put(step, t, nid, v)
            elif kind == COMM:
                _, t, step, name, nbytes, seconds, backend, exposed = e
                cids = self.comm_ids.get(name) or self._comm(name)
                put(step, t, cids[0], seconds)
                put(step, t, cids[1], exposed)
                put(step, t, cids[2], nbytes)
            else:  # RECORD
                _, t, step, name, value = e
                nid = ring.name_ids.get(name)
                put(step, t, nid if nid is not None else ring.nid(name), value)

        logs, rest = _split(entries)
        first: tuple[float, int] | None = None
        if logs:
            one(logs[0])  # it may start a loop (no step time before it)
            first = (last, prev)
            for seg in _segments(logs):
                got = self._run(seg, w, off, prev, last, st) if len(seg) > _RUN_MIN else None
                if got is not None:
                    w, prev, last, st = got
                else:
                    for e in seg:
                        one(e)
        for e in rest:
            one(e)
        clock.prev_step, clock.last_log, clock.step_time = prev, last, st
        ring.w = w  # published last: a take reads rows below w only
        return first, backend

    def _run(
        self, run: list[tuple[Any, ...]], w: int, off: float, prev: int, last: float, st: float
    ) -> tuple[int, int, float, float] | None:
        """Write log entries that follow a drained one (``prev``/``last``: its step and
        time) with numpy. None when they are not alike (other keywords, a value that is not
        a plain number, a step that does not go up, a pause that starts a loop): the
        caller writes them one by one."""
        np = numpy()
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
        ids = self.metric_ids
        total: tuple[int | None] | None = None  # (the last total_steps,) when logged
        for k in keys:
            try:
                col = list(map(itemgetter(k), mets))
            except KeyError:
                return None
            if k == "total_steps":  # an int, or None: the loop's length is unknown
                last_total = col[-1]
                total = (None if last_total is None else int(last_total),)
                continue
            if not set(map(type, col)) <= _PLAIN:
                return None
            nid = ids.get(k)
            if nid is None:
                nid = self._keyword_id(k)
            cols.append((nid, col))
        try:
            S = np.array(steps, dtype=np.int64)
        except OverflowError:  # a step beyond int64
            return None
        N = np.array(nows, dtype=np.float64)
        dS = np.diff(S, prepend=prev)
        dN = np.diff(N, prepend=last)
        n, p = len(S), 1 + has_loss + len(cols)  # rows per entry: time/step, loss, keywords
        ring = self.ring
        i0 = w & ring.mask
        if (dS <= 0).any() or (dN > IDLE_AFTER).any() or i0 + n * p > ring.capacity:
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
        # the block of the ring these rows fill, as (n, p) views: row k * p + j of it is
        # entry k's j-th name
        sb, tb, nb, vb = (a[i0 : i0 + n * p].reshape(n, p) for a in ring.views())
        try:
            sb[:, :] = S[:, None]
            tb[:, :] = (N + off)[:, None]
            nb[:, :] = np.array(
                [self.id_step] + [self.id_loss] * has_loss + [c[0] for c in cols], dtype=np.intc
            )
            vb[:, 0] = per
            if has_loss:
                vb[:, 1] = losses
            for j, (_, col) in enumerate(cols, 1 + has_loss):
                vb[:, j] = col
        except (OverflowError, ValueError, TypeError):  # an int too large for a float
            return None  # nothing published: the caller writes the same rows one by one
        if total is not None:
            self.meta["total_steps"] = total[0]
        return w + n * p, int(S[-1]), float(N[-1]), st
