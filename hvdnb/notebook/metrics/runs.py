"""Runs and knob segments: what tuning compares.

Each ``%%distributed`` cell that logs starts a *run* (``begin_cell`` / ``end_cell`` from
``hvdnb.notebook.cellout.cells``; the run begins with the cell's first point that is not a memory
reading or a knob record), and each knob change applied during it starts a new *segment*
of that run at the step it was applied. Every point is tagged with its run; rows carry
run, segment and the knob values in force at their step on their rank. Live views show
the current run; ``curves`` overlays the runs.

Owns (``Runs``): the list of runs (id, cell, start time, starting knobs, changes, marks,
hidden, the cluster it ran on), which one is current (``run_id``) and whether a cell is
running, starting one, hiding old ones from the comparison, and the overlaid curves, built
up between redraws (a run's points are only ever appended). Each start or restart of a
cluster begins a new *cluster* (``begin_cluster``): no run is current until its first cell
logs, and runs of earlier clusters stay on the comparison chart, labelled with the cluster
they ran on. Handed: the point store (its lock and points), the ``Link`` (which cluster)
and the knob values in force (a run's starting knobs).

Never: import the cluster, torch or widgets; delete points (hidden runs stay in
``hvdnb.metrics()``); change the knobs (``knobreq`` tells it of a change).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from typing import Any

from hvdnb.notebook.metrics.link import Link
from hvdnb.notebook.metrics.points import PointStore, Series, thin_indices
from hvdnb.protocol.kinds import MAIN_LOSS

__all__ = ["Runs", "cluster_text", "run_label"]


def _run_trigger(name: str) -> bool:
    """A point that shows a loop is logging (memory heartbeats and knob records do not)."""
    return not name.startswith(("mem/", "knob/"))


class _CurveSums:
    """One run's per-step sums of a metric over ranks (and of ``samples``), built up."""

    __slots__ = ("order", "pos", "samples", "sums", "unsorted")

    def __init__(self) -> None:
        self.pos: dict[tuple[int, str], int] = {}  # series -> index of its next new point
        self.sums: dict[int, list[float]] = {}  # step -> [sum over ranks, ranks counted]
        self.samples: dict[int, float] = {}  # step -> samples of every rank at that step
        #: the steps of ``sums`` in order, kept as they come (steps arrive increasing, so a
        #: redraw neither re-sorts nor rebuilds the whole curve)
        self.order: list[int] = []
        self.unsorted = False

    def add(self, series: Iterable[tuple[tuple[int, str], Series]], rid: int, name: str) -> None:
        for key, s in series:
            n = key[1]
            if n != name and n != "samples":
                continue
            rs = s.run_slice(rid)
            start = max(self.pos.get(key, rs.start), rs.start)
            if start >= rs.stop:
                continue
            self.pos[key] = rs.stop
            steps, values = s.steps[start : rs.stop], s.values[start : rs.stop]
            if n == "samples":
                dst = self.samples
                for st, v in zip(steps, values):
                    dst[st] = dst.get(st, 0.0) + v
            else:
                sums, order = self.sums, self.order
                for st, v in zip(steps, values):
                    if v == v:
                        a = sums.get(st)
                        if a is None:
                            sums[st] = [v, 1.0]
                            if order and st < order[-1]:
                                self.unsorted = True
                            order.append(st)
                        else:
                            a[0] += v
                            a[1] += 1.0


class Runs:
    """The runs of a ``MetricsStore``; safe to call from any thread (the point store's
    lock guards them; methods marked *lock held* are for the other parts, holding it)."""

    def __init__(
        self, points: PointStore, link: Link, knob_values: Callable[[], dict[str, Any]]
    ) -> None:
        self._points = points
        self._link = link
        self._knob_values = knob_values
        #: runs in order: {"id", "cell", "started", "knobs" (at its start), "changes"
        #: [(step, values, rank)], "marks" [(step, label)], "hidden", "cluster",
        #: "cluster_text"}
        self.records: list[dict[str, Any]] = []
        self._run_id = 0  # the current run (0: none yet); views read it by default
        self._want_run = False  # a cell is running and has not logged yet
        self._in_cell = False
        self._cell_no: int | None = None
        #: (run id, name) -> what ``curves`` has summed so far (a run's points are only
        #: ever appended, so each redraw adds the new points instead of starting over)
        self._curves: dict[tuple[int, str], _CurveSums] = {}

    @property
    def run_id(self) -> int:
        """The current run (0: none yet)."""
        return self._run_id

    @property
    def in_cell(self) -> bool:
        """A ``%%distributed`` cell is running."""
        return self._in_cell

    @property
    def cell_no(self) -> int | None:
        """The number of the ``%%distributed`` cell running or last run (None before)."""
        return self._cell_no

    @property
    def marks(self) -> list[tuple[int, str]]:
        """(step, label) of the knob changes applied in the current run."""
        run = self.record(self._run_id)
        return list(run["marks"]) if run is not None else []

    def record(self, rid: int) -> dict[str, Any] | None:
        """Run ``rid``'s record (None: no such run)."""
        return self.records[rid - 1] if 0 < rid <= len(self.records) else None

    # ------------------------------------------------------------------ main thread
    def begin_cell(self, cell_no: int | None = None) -> None:
        """A ``%%distributed`` cell starts: its first logged point starts a new run."""
        with self._points.lock:
            self._want_run = True
            self._in_cell = True
            self._cell_no = cell_no

    def end_cell(self) -> None:
        """The cell ended (after its last points arrived)."""
        with self._points.lock:
            self._want_run = False
            self._in_cell = False

    # ------------------------------------------------------------------ the other parts
    def tag(self, now: float, names: Iterable[str]) -> int:
        """The run a message's points (their metrics' ``names``) belong to, lock held: a
        logged point of a cell that has not logged yet (or the first ever) starts one."""
        if (self._want_run or not self.records) and any(map(_run_trigger, names)):
            self._start(now)
        return self._run_id

    def _start(self, now: float) -> None:  # lock held
        rid = len(self.records) + 1
        self.records.append(
            {
                "id": rid,
                "cell": self._cell_no,
                "started": now,
                "knobs": self._knob_values(),
                "changes": [],
                "marks": [],
                "hidden": False,
                "cluster": self._link.number,
                "cluster_text": cluster_text(self._link.info),
            }
        )
        self._run_id = rid
        self._want_run = False

    def knobs_made(self, values: dict[str, Any]) -> None:
        """The ranks announced their knobs (lock held): made in the running cell, they are
        its run's starting values (before its first point the run is not started, and the
        last run's stay)."""
        run = self.record(self._run_id)
        if self._in_cell and not self._want_run and run is not None and not run["changes"]:
            run["knobs"] = values

    def applied(self, step: int, values: dict[str, Any], rank: Any, now: float) -> None:
        """A rank applied a knob change at ``step`` (lock held): a segment of the running
        run (which starts here when the change came before the cell's first log)."""
        if self._in_cell and self._want_run:
            self._start(now)
        run = self.record(self._run_id)
        if self._in_cell and run is not None:
            label = ", ".join(f"{k}={v:g}" for k, v in values.items())
            run["changes"].append((step, dict(values), rank))
            if (step, label) not in run["marks"]:
                run["marks"].append((step, label))

    def mark(self, step: int, label: str) -> None:
        """An event of the running run at ``step`` (lock held): a mark on its loss chart."""
        run = self.record(self._run_id)
        if self._in_cell and run is not None and (step, label) not in run["marks"]:
            run["marks"].append((step, label))

    def begin_cluster(self) -> None:  # lock held
        """A new cluster: no run is current (views of the current run start empty) until
        a cell of it logs; earlier runs keep their points and are marked earlier."""
        self._run_id = 0
        self._want_run = False

    def segments(self) -> dict[int, tuple[dict[str, Any], list[Any]]]:
        """Per run: its starting knobs and its changes, copied (lock held)."""
        return {r["id"]: (dict(r["knobs"]), list(r["changes"])) for r in self.records}

    def clear(self) -> None:  # lock held
        self._curves.clear()
        self.records.clear()
        self._run_id = 0

    # ------------------------------------------------------------------ views
    def hide(self, keep_last: int = 1) -> int:
        """Take all but the last ``keep_last`` runs off the comparison chart (their points
        stay in ``hvdnb.metrics()``); returns how many were hidden."""
        with self._points.lock:
            n = 0
            for run in self.records[: max(0, len(self.records) - keep_last)]:
                if not run["hidden"]:
                    run["hidden"] = True
                    n += 1
            self._points.changed()
            return n

    def _sums(self, rid: int, name: str) -> _CurveSums:  # lock held
        cs = self._curves.get((rid, name))
        if cs is None:
            cs = self._curves[(rid, name)] = _CurveSums()
        cs.add(self._points.items(), rid, name)
        return cs

    def curves(
        self, x: str = "step", name: str = "loss", last_runs: int = 5, points: int | None = None
    ) -> list[dict[str, Any]]:
        """The visible runs' mean-over-ranks ``name`` per step, for overlaying.

        Parameters
        ----------
        x : ``"step"`` or ``"samples"`` (samples seen by all ranks together up to and
            including that step: the running sum of every rank's ``samples``); a run that
            logged no ``samples`` gets ``xs = None`` for ``"samples"``
        last_runs : at most this many of the newest visible runs
        points : at most ~this many evenly spaced points per curve (``thin_indices``);
            None: every step. Against ``x="step"`` a thinned curve costs the same however
            long the run is.

        Returns
        -------
        list of ``{"id", "label", "xs", "ys", "marks": [(x, label)], "earlier"}``, oldest
        first; ``earlier``: the run was on a cluster stopped or restarted since (its label
        says which: ``run 2 (earlier cluster: 1 rank, NCCL)``)
        """
        with self._points.lock:
            runs = [dict(r) for r in self.records if not r["hidden"]][-last_runs:]
            out = []
            for run in runs:
                rid = run["id"]
                cs = self._sums(rid, name)
                if not cs.order and name == "loss":  # a framework logging on its main
                    main = self._sums(rid, MAIN_LOSS)  # process only (the HF Trainer)
                    cs = main if main.order else cs
                acc, samples = cs.sums, cs.samples
                if cs.unsorted:
                    cs.order.sort()
                    cs.unsorted = False
                steps = cs.order
                idx = thin_indices(len(steps), points)[0] if points else None
                shown = steps if idx is None else [steps[i] for i in idx]
                ys = [a[0] / a[1] for a in map(acc.__getitem__, shown)]
                xs: list[float] | None = list(map(float, shown))
                xmap: dict[int, float] = {}
                if x == "samples":  # running sums: every step (this view is not thinned)
                    xs = None
                    if samples:
                        tot = 0.0
                        for st in sorted(set(samples) | set(steps)):
                            tot += samples.get(st, 0.0)
                            xmap[st] = tot
                        xs = [xmap[st] for st in shown]
                marks = []
                for st, lab in run["marks"]:
                    if xs is not None and steps:  # the logged step nearest to the mark
                        i = bisect.bisect_left(steps, st)
                        if i == len(steps) or (i > 0 and st - steps[i - 1] <= steps[i] - st):
                            i -= 1
                        marks.append((xmap[steps[i]] if xmap else float(steps[i]), lab))
                earlier = run.get("cluster", self._link.number) != self._link.number
                out.append(
                    {
                        "id": rid,
                        "label": run_label(run, earlier=earlier),
                        "xs": xs,
                        "ys": ys,
                        "marks": marks,
                        "earlier": earlier,
                    }
                )
        return out


def cluster_text(info: dict[str, Any]) -> str:
    """``2 ranks, Gloo, CPU``: a cluster as a run's label and the panel's header name it."""
    if not info:
        return ""
    n = info.get("n")
    parts = [f"{n} rank{'s' if n != 1 else ''}" if n is not None else "? ranks"]
    backend = info.get("backend")
    parts.append(
        {"nccl": "NCCL", "gloo": "Gloo", "mpi": "MPI"}.get(str(backend), str(backend))
        if backend
        else "backend auto"
    )
    if info.get("device"):
        parts.append(str(info["device"]))
    return ", ".join(parts)


def run_label(run: dict[str, Any], earlier: bool = False) -> str:
    """``run 3: batch_size=64 warmup_steps=100 -> batch_size=128 @ 200``; a run of an
    earlier cluster: ``run 1 (earlier cluster: 1 rank, NCCL, GPU): ...``."""
    knobs = " ".join(f"{k}={v:g}" for k, v in run["knobs"].items() if isinstance(v, (int, float)))
    text = f"run {run['id']}"
    if earlier:
        was = run.get("cluster_text") or ""
        text += f" (earlier cluster{': ' + was if was else ''})"
    text += f": {knobs}" if knobs else ""
    seen = set()
    for st, vals, _ in run["changes"]:
        key = (st, tuple(sorted(vals.items())))
        if key in seen:
            continue
        seen.add(key)
        text += " -> " + " ".join(f"{k}={v:g}" for k, v in vals.items()) + f" @ {st}"
    return text
