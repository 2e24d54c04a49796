"""Ingesting the ranks' ``metrics`` and ``rank_info`` messages from the side channel.

Owns (``Ingest``): turning one ``metrics`` message into appends to the point store's typed
columns (handlers run on the channel's I/O thread: an append under the lock, nothing
more), sequence checks per rank (a gap is counted in ``lost_messages``, rows a rank's ring
overwrote in ``lost_rows``: never hidden; both reset for a new cluster), the message count,
the optional arrival times, and ``wait_for``: a cell's last points, which can trail its
reply on another socket. Handed: the point store, the ``Link`` (told what each rank says
of itself: its host once, its loop's step, step time, backend with every message),
``Runs`` (which run the points belong to) and ``Alarms`` (each new column: numpy checks,
no more).

Never: block the channel thread, raise on a malformed message (it is dropped), or invent a
value: a reading a rank did not send is NaN, not 0.
"""

from __future__ import annotations

import math
import threading
import time
from array import array
from typing import Any

from hvdnb.notebook.metrics.alarms import Alarms
from hvdnb.notebook.metrics.link import Link
from hvdnb.notebook.metrics.points import PointStore
from hvdnb.notebook.metrics.runs import Runs

__all__ = ["Ingest"]


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


class Ingest:
    """The I/O-thread half of a ``MetricsStore``: messages in."""

    def __init__(self, points: PointStore, link: Link, runs: Runs, alarms: Alarms) -> None:
        self._points = points
        self._link = link
        self._runs = runs
        self._alarms = alarms
        self._arrived = threading.Condition(points.lock)  # a rank's message came in
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
        points = self._points
        with points.lock:
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
            rid = self._runs.tag(now, cols)
            # the watchers judge the running cell's loop: a late message of a finished
            # cell's loop (its last one can trail the cell's end) is stored, not watched
            cell = msg.get("cell")
            cell_no = self._runs.cell_no
            watch = cell is None or cell_no is None or cell == cell_no
            column = self._alarms.column
            for name, col in cols.items():
                try:
                    steps, times, values = _typed_columns(col)
                except (TypeError, ValueError, OverflowError):
                    continue  # not three columns of numbers of one length: dropped
                points.append(rank, name, rid, steps, times, values)
                if self.keep_arrivals and name == "loss":
                    self.arrivals.extend((t, now) for t in times)
                if watch:
                    column(rid, rank, name, steps, values)  # nan, spike
            if watch and "fp" in msg:
                self._alarms.fingerprints(rid, rank, msg["fp"])  # replica drift
            said = {
                "step": msg.get("step"),
                "step_time": msg.get("step_time"),
                "backend": msg.get("backend"),
                "idle": msg.get("idle"),
                "seen": now,
                "pid": pid,
            }
            meta = msg.get("meta")
            if isinstance(meta, dict):
                said.update(meta)
            self._link.note(rank, said)
            self.messages += 1
            points.changed()

    def on_rank_info(self, msg: dict[str, Any]) -> None:
        """A rank says where it runs (sent once when its channel connects)."""
        rank = msg.get("rank")
        if not isinstance(rank, int):
            return
        said = {k: msg[k] for k in ("host", "local_rank", "pid") if msg.get(k) is not None}
        with self._points.lock:
            self._link.note(rank, said)
            self._points.changed()

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

    def reset(self) -> None:  # lock held
        """A new cluster: its ranks' sequences start over, and so do the counts of losses."""
        self._seq.clear()
        self._lost_by_rank.clear()
        self.lost_messages = self.lost_rows = 0
