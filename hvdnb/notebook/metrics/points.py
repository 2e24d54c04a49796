"""The metrics store's point store: every point of every rank, in typed columns, and the lock.

Owns: one ``Series`` per rank and metric (indexed by rank as well as by (rank, name), so
views cost O(ranks), not O(ranks x series): 1,024 ranks stay cheap), the count of points,
the store's one lock and its ``version``. Every part of ``MetricsStore`` is handed this
object and takes its lock for its own fields too: a message's ingest is one acquisition,
and no two locks can be taken in the wrong order. Methods marked *lock held* are for the
parts, which hold the lock already; the others take it.

Never: know about runs (a read is told which run; ``-1``: every run), import the cluster,
torch or widgets; hold the lock for more than a copy or an append; invent a value (a
reading a rank did not send is None or NaN, never 0).
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import ItemsView, KeysView, Sequence

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
        """The points of ``run`` (runs are appended in order, so one contiguous range);
        ``-1``: every point."""
        if run == -1:
            return slice(0, len(self.steps))
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
    """The points of every rank and the store's lock; its reads are safe from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._series: dict[tuple[int, str], Series] = {}
        self._names_of: dict[int, list[str]] = {}  # rank -> its series' names
        self.version = 0  # bumped on every change to the store; the panel redraws on it
        self.points = 0

    # ------------------------------------------------------------ for the parts (lock held)
    def changed(self) -> None:
        """Something in the store changed (lock held): the panel redraws."""
        self.version += 1

    def append(
        self,
        rank: int,
        name: str,
        run: int,
        steps: array[int],
        times: array[float],
        values: array[float],
    ) -> None:
        """Append one column of a rank's message, tagged with ``run`` (lock held)."""
        s = self._series.get((rank, name))
        if s is None:
            s = self._series[(rank, name)] = Series()
            self._names_of.setdefault(rank, []).append(name)
        if not s.runs or s.runs[-1][0] != run:
            s.runs.append((run, len(s.steps)))
        s.steps.extend(steps)
        s.times.extend(times)
        s.values.extend(values)
        self.points += len(steps)

    def get(self, rank: int, name: str) -> Series | None:
        """One series, or None (lock held)."""
        return self._series.get((rank, name))

    def items(self) -> ItemsView[tuple[int, str], Series]:
        """Every ((rank, name), series) (lock held)."""
        return self._series.items()

    def names_of(self, rank: int) -> Sequence[str]:
        """The names of ``rank``'s series, in the order they came (lock held)."""
        return self._names_of.get(rank, ())

    def rank_ids(self) -> KeysView[int]:
        """The ranks that sent points (lock held)."""
        return self._names_of.keys()

    def clear(self) -> None:
        """Drop every point (lock held)."""
        self._series.clear()
        self._names_of.clear()
        self.points = 0

    # ------------------------------------------------------------------------ reads
    def names(self) -> list[str]:
        """Every metric's name."""
        with self.lock:
            return sorted({n for _, n in self._series})

    def series(
        self, name: str, rank: int, run: int, last: int | None = None
    ) -> tuple[list[int], list[float], list[float]]:
        """(steps, values, times) of one metric on one rank in ``run`` (-1: every run),
        the last ``last`` points (copies only those)."""
        with self.lock:
            s = self._series.get((rank, name))
            if s is None:
                return [], [], []
            rs = s.run_slice(run)
            if last:
                rs = slice(max(rs.start, rs.stop - last), rs.stop)
            return s.steps[rs].tolist(), s.values[rs].tolist(), s.times[rs].tolist()

    def count(self, name: str, rank: int, run: int) -> int:
        """How many points of one metric on one rank ``run`` holds (as ``series``)."""
        with self.lock:
            s = self._series.get((rank, name))
            if s is None:
                return 0
            rs = s.run_slice(run)
            return int(rs.stop - rs.start)

    def thinned(
        self, name: str, rank: int, n: int, run: int
    ) -> tuple[list[float], list[float], int]:
        """``series`` as a chart draws it: at most ~``n`` evenly spaced points (and the
        last), read without copying the whole history; returns (steps, values, stride)."""
        with self.lock:
            s = self._series.get((rank, name))
            if s is None:
                return [], [], 1
            rs = s.run_slice(run)
            idx, stride = thin_indices(rs.stop - rs.start, n)
            if idx is None:
                return [float(x) for x in s.steps[rs]], s.values[rs].tolist(), 1
            steps, values, a = s.steps, s.values, rs.start
            return [float(steps[a + i]) for i in idx], [values[a + i] for i in idx], stride

    def latest(self, name: str, rank: int, since: float | None = None) -> float | None:
        """The last value of one metric on one rank (None: none yet, or none taken at or
        after ``since``, a ``time.time()``)."""
        with self.lock:
            s = self._series.get((rank, name))
            if s is None or not s.values or (since is not None and s.times[-1] < since):
                return None
            return s.values[-1]
