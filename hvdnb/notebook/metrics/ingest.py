"""Ingesting the ranks' ``metrics`` and ``rank_info`` messages from the side channel.

Owns: turning one ``metrics`` message into appends to the store's typed columns (handlers
run on the channel's I/O thread: an append under a lock, nothing more), sequence checks per
rank (a gap is counted in ``lost_messages``, rows a rank's ring overwrote in ``lost_rows``:
never hidden), each new column handed to the watchers (``alarms``: numpy checks, no more),
what each rank says of itself (``rank_info``: its host once, its loop's step, step time,
backend with every message), and ``wait_for``: a cell's last points, which can trail its
reply on another socket.

Never: block the channel thread, raise on a malformed message (it is dropped), or invent a
value: a reading a rank did not send is NaN, not 0.
"""

from __future__ import annotations

import math
import threading
import time
from array import array
from typing import Any

from hvdnb.notebook.metrics.alarms import AlarmsMixin
from hvdnb.notebook.metrics.points import Series

__all__ = ["IngestMixin"]


def _typed_columns(col: Any) -> tuple[array[int], array[float], array[float]]:
    """``[steps, times, values]`` as int64 / float64 arrays (as they come off the wire, or
    built from lists: None becomes NaN); raises when they are not that."""
    steps, times, values = col
    if type(steps) is not array or steps.typecode != "q":
        try:
            steps = array("q", steps)
        except TypeError:  # 3.0 is step 3; 2.5 is no step
            steps = array("q", map(_step_int, steps))
    if type(times) is not array or times.typecode != "d":
        times = array("d", times)
    if type(values) is not array or values.typecode != "d":
        values = array("d", (math.nan if v is None else v for v in values))
    if not len(steps) == len(times) == len(values):
        raise ValueError("columns of different lengths")
    return steps, times, values


def _step_int(x: Any) -> int:
    i = int(x)
    if i != x:
        raise ValueError(f"step {x!r} is not a whole number")
    return i


def _run_trigger(name: str) -> bool:
    """A point that shows a loop is logging (memory heartbeats and knob records do not)."""
    return not name.startswith(("mem/", "knob/"))


class IngestMixin(AlarmsMixin):
    """The I/O-thread half of a ``MetricsStore``: messages in."""

    def __init__(self) -> None:
        super().__init__()
        self._arrived = threading.Condition(self._lock)  # a rank's message came in
        self.messages = 0
        self.lost_messages = 0  # sequence gaps
        self.lost_rows = 0  # rows a rank's ring overwrote before it could flush
        self._seq: dict[int, tuple[Any, int]] = {}  # rank -> (pid, last seq)
        self._lost_by_rank: dict[int, int] = {}
        #: (time a row was logged on its rank, time it reached this store), for latency
        self.arrivals: list[tuple[float, float]] = []
        self.keep_arrivals = False

    def ingest(self, msg: dict[str, Any]) -> None:
        """Add one ``metrics`` message."""
        rank = msg.get("rank")
        cols = msg.get("cols")
        if not isinstance(rank, int) or not isinstance(cols, dict):
            return
        now = time.time()
        with self._lock:
            seq, pid = msg.get("seq"), msg.get("pid")
            last = self._seq.get(rank)
            if isinstance(seq, int):
                if last is not None and last[0] == pid and seq > last[1] + 1:
                    self.lost_messages += seq - last[1] - 1
                elif last is None and seq > 1:
                    self.lost_messages += seq - 1  # the first messages never arrived
                self._seq[rank] = (pid, seq)
                self._arrived.notify_all()
            lost = msg.get("lost")
            if isinstance(lost, int):
                prev = self._lost_by_rank.get(rank, 0)
                if lost > prev:
                    self.lost_rows += lost - prev
                self._lost_by_rank[rank] = lost
            n = 0
            if (self._want_run or not self.runs) and any(_run_trigger(k) for k in cols):
                self._start_run(now)
            rid = self.run_id
            # the watchers judge the running cell's loop: a late message of a finished
            # cell's loop (its last one can trail the cell's end) is stored, not watched
            cell = msg.get("cell")
            watch = cell is None or self._cell_no is None or cell == self._cell_no
            for name, col in cols.items():
                try:
                    steps, times, values = _typed_columns(col)
                except (TypeError, ValueError, OverflowError):
                    continue  # not three columns of numbers of one length: dropped
                s = self._series.get((rank, name))
                if s is None:
                    s = self._series[(rank, name)] = Series()
                    self._names_of.setdefault(rank, []).append(name)
                if not s.runs or s.runs[-1][0] != rid:
                    s.runs.append((rid, len(s.steps)))
                s.steps.extend(steps)
                s.times.extend(times)
                s.values.extend(values)
                n += len(steps)
                if self.keep_arrivals and name == "loss":
                    self.arrivals.extend((t, now) for t in times)
                if watch:
                    self._watch_column(rank, name, steps, values)  # nan, spike (alarms.py)
            if watch and "fp" in msg:
                self._watch_fingerprints(rank, msg["fp"])  # replica drift
            info = self.rank_info.setdefault(rank, {})
            info.update(
                step=msg.get("step"),
                step_time=msg.get("step_time"),
                backend=msg.get("backend"),
                idle=msg.get("idle"),
                seen=now,
                pid=pid,
            )
            if isinstance(msg.get("meta"), dict):
                info.update(msg["meta"])
            self.points += n
            self.messages += 1
            self.version += 1

    def on_rank_info(self, msg: dict[str, Any]) -> None:
        """A rank says where it runs (sent once when its channel connects)."""
        rank = msg.get("rank")
        if not isinstance(rank, int):
            return
        with self._lock:
            info = self.rank_info.setdefault(rank, {})
            for k in ("host", "local_rank", "pid"):
                if msg.get(k) is not None:
                    info[k] = msg[k]
            self.version += 1

    def wait_for(self, marks: dict[int, tuple[int, int]], timeout: float) -> bool:
        """Wait until every rank's message ``seq`` from process ``pid`` (``marks``: rank ->
        (pid, seq), what the rank had sent when its cell ended) is here.

        The side channel and the cell's reply travel on different sockets, so a cell's
        last points can arrive just after the reply; the cell waits for them (bounded)
        so that its final panel and ``hvdnb.metrics()`` after it are complete.
        """
        deadline = time.monotonic() + timeout

        def arrived() -> bool:  # a rank sends its messages in sequence order
            for rank, (pid, seq) in marks.items():
                last = self._seq.get(rank)
                if last is None or last[0] != pid or last[1] < seq:
                    return False
            return True

        with self._arrived:
            while not arrived():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._arrived.wait(left)
        return True
