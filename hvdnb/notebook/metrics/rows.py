"""The rows of ``hvdnb.metrics()``: every point with its run, knob segment and knobs.

Owns: ``MetricRow``, ``MetricRows`` (a list with ``to_csv``, ``to_jsonl``, ``to_pandas``)
and ``build_rows``, which reads the point store and the runs under the lock and builds the
rows outside it. Never: change the points or the runs.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, NamedTuple

from hvdnb.notebook.metrics.points import PointStore
from hvdnb.notebook.metrics.runs import Runs

__all__ = ["MetricRow", "MetricRows", "build_rows"]


class MetricRow(NamedTuple):
    """One point. ``run``: the logging run it belongs to (0: before any run);
    ``segment``: how many knob changes this rank had applied in that run at this step;
    ``knobs``: the knob values in force then (``{}`` when the loop has no knobs)."""

    rank: int
    step: int
    name: str
    value: float
    time: float
    run: int = 0
    segment: int = 0
    knobs: dict[str, float] = {}  # noqa: RUF012 - never mutated: a fresh dict per row


class MetricRows(list):  # type: ignore[type-arg]
    """A list of ``MetricRow`` with exports.

    ``lost_points`` counts the points the ranks recorded that never reached the notebook (a
    rank's ring lapped before it sent), ``lost_messages`` the ranks' messages that never
    arrived (gaps in their sequence); both 0 unless ``hvdnb.metrics()`` said otherwise.
    """

    lost_points: int = 0
    lost_messages: int = 0

    def to_csv(self, path: str | Path) -> Path:
        """Write ``rank,step,name,value,time,run,segment,knobs`` rows (knobs as JSON);
        returns the path."""
        p = Path(path)
        with p.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(MetricRow._fields)
            w.writerows((*r[:-1], json.dumps(r.knobs, sort_keys=True)) for r in self)
        return p

    def to_jsonl(self, path: str | Path) -> Path:
        """Write one JSON object per row; returns the path."""
        p = Path(path)
        with p.open("w") as f:
            for r in self:
                f.write(json.dumps(r._asdict(), allow_nan=True) + "\n")
        return p

    def to_pandas(self) -> Any:
        """A DataFrame with one column per field, the knobs spread over ``knob.<name>``
        columns (NaN where a knob did not exist)."""
        try:
            import pandas as pd  # noqa: PLC0415  pandas is optional
        except ImportError:  # pragma: no cover - pandas is a dependency of hvdnb
            raise ImportError("to_pandas() needs pandas: pip install pandas") from None

        df = pd.DataFrame([r[:-1] for r in self], columns=list(MetricRow._fields[:-1]))
        names = sorted({k for r in self for k in r.knobs})
        for k in names:
            df[f"knob.{k}"] = [r.knobs.get(k, math.nan) for r in self]
        return df


def build_rows(
    points: PointStore, runs: Runs, name: str | None, rank: int | None, run: int | None
) -> MetricRows:
    """Every point as ``(rank, step, name, value, time, run, segment, knobs)``, ordered
    by rank, name, arrival; ``run`` selects one run."""
    with points.lock:
        items = [
            (k, s.steps[:], s.values[:], s.times[:], list(s.runs))
            for k, s in points.items()
            if (name is None or k[1] == name) and (rank is None or k[0] == rank)
        ]
        segments = runs.segments()
    out = MetricRows()
    for (r, n), steps, values, times, offsets in sorted(items, key=lambda it: it[0]):
        for k, (rid, start) in enumerate(offsets):
            if run is not None and rid != run:
                continue
            end = offsets[k + 1][1] if k + 1 < len(offsets) else len(steps)
            knobs0, changes = segments.get(rid, ({}, []))
            mine = sorted((st, v) for st, v, rk in changes if rk == r or rk is None)
            for i in range(start, end):
                st = steps[i]
                seg, kv = 0, knobs0
                for cst, cv in mine:
                    if cst > st:
                        break
                    seg += 1
                    kv = {**kv, **cv}
                out.append(MetricRow(r, st, n, values[i], times[i], rid, seg, dict(kv)))
    return out
