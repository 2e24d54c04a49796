"""The notebook's metrics store: every point the ranks sent, and ``hvdnb.metrics()``.

``MetricsStore`` is assembled from its parts, each in its own module: the points and the
state they share (``points``), ingesting the side channel's messages (``ingest``), runs
and knob segments (``runs``), the knob protocol's notebook half (``knobreq``) and the
views the panel reads (``views``). This module adds what needs them all: the rows of
``hvdnb.metrics()`` with their exports, clearing, and the wiring to a cluster's side
channel; and the notebook's one store (``get_store``, ``attach``), ``hvdnb.metrics`` and
``hvdnb.set_knobs``.

One-way with the cluster: a cluster attaches the store when it starts; the store follows
the current cluster (a restart brings a new channel) through the tiny
``hvdnb.notebook.cluster.registry``, and reads of a cluster only ``channel`` and
``client.ids``.

Never: import torch, widgets or the cluster's modules beyond that registry; block the
channel thread; invent a value: a reading a rank did not send is None (shown as "n/a") or
NaN, not 0.
"""

from __future__ import annotations

import csv
import json
import math
import threading
from pathlib import Path
from typing import Any, NamedTuple

from hvdnb.notebook.cluster import registry
from hvdnb.notebook.metrics.ingest import IngestMixin
from hvdnb.notebook.metrics.knobreq import KnobsMixin
from hvdnb.notebook.metrics.views import ViewsMixin
from hvdnb.notebook.metrics.watchers import WatchSettings
from hvdnb.protocol import kinds

__all__ = [
    "MetricRow",
    "MetricRows",
    "MetricsStore",
    "attach",
    "get_store",
    "metrics",
    "set_knobs",
    "watch",
]


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
    """A list of ``MetricRow`` with exports."""

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
            import pandas as pd
        except ImportError:  # pragma: no cover - pandas is a dependency of hvdnb
            raise ImportError("to_pandas() needs pandas: pip install pandas") from None

        df = pd.DataFrame([r[:-1] for r in self], columns=list(MetricRow._fields[:-1]))
        names = sorted({k for r in self for k in r.knobs})
        for k in names:
            df[f"knob.{k}"] = [r.knobs.get(k, math.nan) for r in self]
        return df


class MetricsStore(IngestMixin, KnobsMixin, ViewsMixin):
    """Every point from every rank, plus runs and knob events; safe to feed from any thread.

    Its parts: ``IngestMixin`` (``ingest``, ``on_rank_info``, ``wait_for``), ``RunsMixin``
    (``begin_cell``, ``end_cell``, ``runs``, ``current_run``, ``cell_no``, ``marks``,
    ``hide_runs``, ``run_curves``),
    ``KnobsMixin`` (``request_knobs``, ``knob_status``, ``on_spec``/``on_plan``/
    ``on_applied``), ``AlarmsMixin`` (``set_watch``, ``alarms``, ``take_lines``,
    ``alarm_marks``, ``on_stop_plan``), ``ViewsMixin`` (``breakdown``, ``hint``,
    ``comm_summary``, ...) and ``PointStore`` (``series``, ``thinned``, ``latest``,
    ``ranks``, ``names``).
    """

    def rows(
        self, name: str | None = None, rank: int | None = None, run: int | None = None
    ) -> MetricRows:
        """Every point as ``(rank, step, name, value, time, run, segment, knobs)``, ordered
        by rank, name, arrival; ``run`` selects one run."""
        with self._lock:
            items = [
                (k, s.steps[:], s.values[:], s.times[:], list(s.runs))
                for k, s in self._series.items()
                if (name is None or k[1] == name) and (rank is None or k[0] == rank)
            ]
            runs = {r["id"]: (dict(r["knobs"]), list(r["changes"])) for r in self.runs}
        out = MetricRows()
        for (r, n), steps, values, times, offsets in sorted(items, key=lambda it: it[0]):
            for k, (rid, start) in enumerate(offsets):
                if run is not None and rid != run:
                    continue
                end = offsets[k + 1][1] if k + 1 < len(offsets) else len(steps)
                knobs0, changes = runs.get(rid, ({}, []))
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

    def ranks(self) -> list[int]:
        """The ranks of the attached cluster (every rank heard from, before any)."""
        if not self.cluster_no:
            return super().ranks()
        with self._lock:
            return sorted(self.rank_info)

    def clear(self) -> None:
        with self._lock:
            self._clear_points()
            self._clear_runs()
            self.knob_events.clear()
            self._clear_alarms()
            self.version += 1

    # -------------------------------------------------------------- wiring
    def attach_current(self) -> None:
        """Follow ``hvdnb.current()`` (a restarted cluster has a new channel)."""
        c = registry.current()
        if c is not None and c.channel is not None and c.channel is not self._channel:
            self.attach(c)

    def attach(self, cluster: Any) -> None:
        """Feed this store from ``cluster.channel`` (again after a restart: idempotent)."""
        ch = getattr(cluster, "channel", None)
        if ch is None or ch is self._channel:
            self._cluster = cluster
            return
        with self._lock:
            self._begin_cluster(cluster)
        self._cluster = cluster
        self._channel = ch
        ch.on(kinds.METRICS, self.ingest)
        ch.on(kinds.RANK_INFO, self.on_rank_info)
        ch.on(kinds.KNOBS_SPEC, self.on_spec)
        ch.on(kinds.KNOBS_PLAN, self.on_plan)
        ch.on(kinds.KNOBS_APPLIED, self.on_applied)
        ch.on(kinds.STOP_PLAN, self.on_stop_plan)

    def _begin_cluster(self, cluster: Any) -> None:  # lock held
        """A new cluster (a start or a restart: a new channel). What the live views say
        (ranks, step, backend, knobs, lost messages) is of this cluster from now on: the
        ranks it has, known by the hello each sent before its start returned, and no step
        yet. The points of earlier clusters stay (``hvdnb.metrics()``, the runs chart)."""
        self.rank_info.clear()
        for r, host in dict(getattr(cluster, "hosts_seen", None) or {}).items():
            self.rank_info[r] = {"host": host}
        self._seq.clear()
        self._lost_by_rank.clear()
        self.lost_messages = self.lost_rows = 0
        self.knob_spec = {}
        info = {k: getattr(cluster, k, None) for k in ("n", "backend", "device")}
        self._begin_runs_of_cluster(info)
        self.version += 1


_STORE: MetricsStore | None = None
_SLOCK = threading.Lock()


def get_store() -> MetricsStore:
    """The notebook's store (one per kernel)."""
    global _STORE
    with _SLOCK:
        if _STORE is None:
            _STORE = MetricsStore()
        return _STORE


def attach(cluster: Any = None) -> MetricsStore:
    """Feed the notebook's store from ``cluster`` (default: ``hvdnb.current()``)."""
    store = get_store()
    c = cluster if cluster is not None else registry.current()
    if c is not None:
        store.attach(c)
    return store


def set_knobs(
    *, at_step: int | None = None, after: float | None = None, timeout: float = 3.0, **values: Any
) -> dict[str, Any]:
    """Change knobs of the job from code: the same validated request as the panel's controls.

    Every rank applies the change at one step (rank 0 picks it; see ``hvdnb.knobs``).

    Parameters
    ----------
    at_step : apply at this step of the running loop, or of the next loop that runs
        (a plan waiting for its step carries over to the knob set a new cell makes)
    after : send the request this many seconds from now (from a timer thread), so a
        training cell started meanwhile is changed while it runs; returns at once
    timeout : seconds to wait for rank 0's plan and, when it applies at once (no loop
        running), for every rank's report
    **values : knob names and new values

    Returns
    -------
    dict: ``{"id", "plan", "applied": {rank: report}}`` (``{"scheduled_in": after}`` with
    ``after``)

    Raises
    ------
    ValueError
        a value the knobs refuse (unknown name, out of range, wrong kind), no knobs yet, or
        no cluster; nothing is sent then.

    Examples
    --------
    >>> hvdnb.set_knobs(warmup_steps=200, batch_size=64)          # doctest: +SKIP
    >>> hvdnb.set_knobs(batch_size=128, at_step=150)              # doctest: +SKIP
    """
    return attach().change_knobs(at_step=at_step, after=after, timeout=timeout, **values)


def watch(
    nan: str | None = None,
    spike: str | None = None,
    drift: str | None = None,
    **options: Any,
) -> WatchSettings:
    """What the watchers do when a training loop goes wrong; on by default (``warn``).

    While a ``%%distributed`` cell's loop calls ``hvdnb.log``, the notebook watches what it
    logs: a NaN or +-inf in a logged value (``nan``), a loss above 3x its running median
    (``spike``), ranks whose parameters no longer agree (``drift``, with
    ``hvd.DistributedOptimizer`` or ``hvdnb.ddp_comm_hook``). Each alarm is one line in the
    running cell's output (kept in the saved notebook), on the live line and a mark on the
    panel's loss chart. ``stop``: every rank also raises ``hvdnb.TrainingStopped`` at the
    same step (the cluster stays usable). The README's "Watchers" section defines each.

    Parameters
    ----------
    nan, spike, drift : ``"warn"`` (default), ``"stop"`` or ``"off"``
    **options : thresholds: ``spike_factor`` (3), ``spike_window`` (50 steps),
        ``spike_history`` (50 losses before judging), ``spike_floor`` (0.3 x the starting
        level), ``spike_end`` (10 steps), ``drift_rtol`` (1e-6)

    Returns
    -------
    WatchSettings, the settings now in force (called without arguments: unchanged)

    Raises
    ------
    ValueError
        an unknown setting or a bad value; nothing changes then.

    Examples
    --------
    >>> hvdnb.watch(nan="stop", spike="warn", drift="stop")        # doctest: +SKIP
    >>> hvdnb.watch(spike_factor=5)                                # doctest: +SKIP
    """
    values = {k: v for k, v in (("nan", nan), ("spike", spike), ("drift", drift)) if v is not None}
    return attach().set_watch(**values, **options)


def metrics(name: str | None = None, rank: int | None = None, run: int | None = None) -> MetricRows:
    """Every point the ranks recorded with ``hvdnb.log`` (and allreduce, memory, phases),
    as rows ``(rank, step, name, value, time, run, segment, knobs)``.

    Parameters
    ----------
    name : only this metric (e.g. ``"loss"``)
    rank : only this rank
    run : only this run (``hvdnb.metrics().to_pandas().run`` lists them)

    Returns
    -------
    MetricRows, a list with ``to_csv(path)``, ``to_jsonl(path)`` and ``to_pandas()``

    Examples
    --------
    >>> rows = hvdnb.metrics("loss")                               # doctest: +SKIP
    >>> rows.to_csv("loss.csv")
    """
    return attach().rows(name, rank, run)
