"""The metrics store's core: every point of every rank, in typed columns, under one lock.

Owns: the state every part of ``MetricsStore`` shares (the lock, one ``Series`` per rank
and metric, ``rank_info``, ``knob_spec``, the current run's id, ``version``) and the plain
reads of the points: ``names``, ``ranks``, ``series``, ``count``, ``thinned``, ``latest``.
``PointStore`` is the base of the store's parts (``ingest``, ``runs``, ``knobreq``,
``views``, assembled in ``store``): its underscored fields are theirs to use, nobody
else's. Series are indexed by rank as well as by (rank, name), so views cost O(ranks),
not O(ranks x series): 1,024 ranks stay cheap.

Never: import the cluster, torch or widgets; hold the lock for more than a copy or an
append; invent a value (a reading a rank did not send is None or NaN, never 0).
"""

from __future__ import annotations

import threading
from array import array
from typing import Any

__all__ = ["MANY_RANKS", "PointStore", "Series", "thin_indices"]

#: beyond this many ranks, views summarise (shorter windows, per-host rows)
MANY_RANKS = 256


class Series:
    """One metric of one rank: typed columns (a message's arrays are appended at C speed
    and a point costs 24 bytes, not three Python objects)."""

    __slots__ = ("runs", "steps", "times", "values")

    def __init__(self) -> None:
        self.steps: array[int] = array("q")
        self.values: array[float] = array("d")
        self.times: array[float] = array("d")
        self.runs: list[tuple[int, int]] = []  # (run id, index of its first point here)

    def run_slice(self, run: int) -> slice:
        """The points of ``run`` (runs are appended in order, so one contiguous range)."""
        for k, (rid, start) in enumerate(self.runs):
            if rid == run:
                end = self.runs[k + 1][1] if k + 1 < len(self.runs) else len(self.steps)
                return slice(start, end)
        return slice(0, 0)


def thin_indices(length: int, n: int) -> tuple[list[int] | None, int]:
    """Which of ``length`` points a chart of at most ~``n`` points draws: None (all of
    them) or evenly spaced indices plus the last one; and the stride between them."""
    if length <= n:
        return None, 1
    stride = length / n
    return [int(i * stride) for i in range(n)] + [length - 1], max(1, int(stride))


class PointStore:
    """The points and the state the store's parts share; safe to read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[tuple[int, str], Series] = {}
        self._names_of: dict[int, list[str]] = {}  # rank -> its series' names
        self.version = 0  # bumped on every change; the panel redraws when it moves
        self.points = 0
        #: per rank: what it said of itself (host, local_rank, pid) and of its loop
        #: (step, step_time, backend, idle, seen)
        self.rank_info: dict[int, dict[str, Any]] = {}
        #: the knobs of the running job: name -> spec, with the value in force
        self.knob_spec: dict[str, dict[str, Any]] = {}
        self.run_id = 0  # the current run (0: none yet); views read it by default

    def _clear_points(self) -> None:  # lock held
        self._series.clear()
        self._names_of.clear()
        self.points = 0

    def names(self) -> list[str]:
        with self._lock:
            return sorted({n for _, n in self._series})

    def ranks(self) -> list[int]:
        with self._lock:
            return sorted(set(self._names_of) | set(self.rank_info))

    def series(
        self, name: str, rank: int, last: int | None = None, run: int | None = None
    ) -> tuple[list[int], list[float], list[float]]:
        """(steps, values, times) of one metric on one rank in ``run`` (default: the
        current run; -1: every run), the last ``last`` points (copies only those)."""
        with self._lock:
            s = self._series.get((rank, name))
            if s is None:
                return [], [], []
            rs = self._slice(s, run)
            if last:
                rs = slice(max(rs.start, rs.stop - last), rs.stop)
            return s.steps[rs].tolist(), s.values[rs].tolist(), s.times[rs].tolist()

    def _slice(self, s: Series, run: int | None) -> slice:
        if run == -1:
            return slice(0, len(s.steps))
        return s.run_slice(self.run_id if run is None else run)

    def count(self, name: str, rank: int, run: int | None = None) -> int:
        """How many points of one metric on one rank ``run`` holds (as ``series``)."""
        with self._lock:
            s = self._series.get((rank, name))
            if s is None:
                return 0
            rs = self._slice(s, run)
            return int(rs.stop - rs.start)

    def thinned(
        self, name: str, rank: int, n: int, run: int | None = None
    ) -> tuple[list[float], list[float], int]:
        """``series`` as a chart draws it: at most ~``n`` evenly spaced points (and the
        last), read without copying the whole history; returns (steps, values, stride)."""
        with self._lock:
            s = self._series.get((rank, name))
            if s is None:
                return [], [], 1
            rs = self._slice(s, run)
            idx, stride = thin_indices(rs.stop - rs.start, n)
            if idx is None:
                return [float(x) for x in s.steps[rs]], s.values[rs].tolist(), 1
            steps, values, a = s.steps, s.values, rs.start
            return [float(steps[a + i]) for i in idx], [values[a + i] for i in idx], stride

    def latest(self, name: str, rank: int) -> float | None:
        with self._lock:
            s = self._series.get((rank, name))
            return s.values[-1] if s is not None and s.values else None
