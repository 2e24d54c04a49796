"""Runs and knob segments: what tuning compares.

Each ``%%distributed`` cell that logs starts a *run* (``begin_cell`` / ``end_cell`` from
``hvdnb.notebook.cells``; the run begins with the cell's first point that is not a memory
reading or a knob record), and each knob change applied during it starts a new *segment*
of that run at the step it was applied. Every point is tagged with its run; rows carry
run, segment and the knob values in force at their step on their rank. Live views show
the current run; ``run_curves`` overlays the runs.

Owns: the list of runs (id, cell, start time, starting knobs, changes, marks, hidden, the
cluster it ran on), starting one, hiding old ones from the comparison, and the overlaid
curves, built up between redraws (a run's points are only ever appended). Each start or
restart of a cluster begins a new *cluster* (``begin_cluster``): no run is current until
its first cell logs, and runs of earlier clusters stay on the comparison chart, labelled
with the cluster they ran on.

Never: import the cluster, torch or widgets; delete points (hidden runs stay in
``hvdnb.metrics()``).
"""

from __future__ import annotations

import bisect
from typing import Any

from hvdnb.notebook.metrics.points import PointStore, Series, thin_indices

__all__ = ["RunsMixin", "cluster_text", "run_label"]


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

    def add(self, series: dict[tuple[int, str], Series], rid: int, name: str) -> None:
        for key, s in series.items():
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


class RunsMixin(PointStore):
    """The runs of a ``MetricsStore``."""

    def __init__(self) -> None:
        super().__init__()
        #: runs in order: {"id", "cell", "started", "knobs" (at its start), "changes"
        #: [(step, values, rank)], "marks" [(step, label)], "hidden"}
        self.runs: list[dict[str, Any]] = []
        self._want_run = False  # a cell is running and has not logged yet
        self._in_cell = False
        self._cell_no: int | None = None
        #: (run id, name) -> what run_curves has summed so far (a run's points are only
        #: ever appended, so each redraw adds the new points instead of starting over)
        self._curves: dict[tuple[int, str], _CurveSums] = {}
        #: the cluster the live views describe: how many were attached (0: none yet) and
        #: what it is (``{"n", "backend", "device"}``, as ``begin_cluster`` got it)
        self.cluster_no = 0
        self.cluster_info: dict[str, Any] = {}

    @property
    def marks(self) -> list[tuple[int, str]]:
        """(step, label) of the knob changes applied in the current run."""
        run = self._run(self.run_id)
        return list(run["marks"]) if run is not None else []

    @property
    def cell_no(self) -> int | None:
        """The number of the ``%%distributed`` cell running or last run (None before)."""
        return self._cell_no

    def current_run(self) -> dict[str, Any] | None:
        """The current run's record (None before the first run); see ``runs``."""
        return self._run(self.run_id)

    def _run(self, rid: int) -> dict[str, Any] | None:
        return self.runs[rid - 1] if 0 < rid <= len(self.runs) else None

    # ------------------------------------------------------------------ main thread
    def begin_cell(self, cell_no: int | None = None) -> None:
        """A ``%%distributed`` cell starts: its first logged point starts a new run."""
        with self._lock:
            self._want_run = True
            self._in_cell = True
            self._cell_no = cell_no

    def end_cell(self) -> None:
        """The cell ended (after its last points arrived)."""
        with self._lock:
            self._want_run = False
            self._in_cell = False

    def _start_run(self, now: float) -> None:  # lock held
        rid = len(self.runs) + 1
        self.runs.append(
            {
                "id": rid,
                "cell": self._cell_no,
                "started": now,
                "knobs": {k: v.get("value") for k, v in self.knob_spec.items()},
                "changes": [],
                "marks": [],
                "hidden": False,
                "cluster": self.cluster_no,
                "cluster_text": cluster_text(self.cluster_info),
            }
        )
        self.run_id = rid
        self._want_run = False

    def _begin_runs_of_cluster(self, info: dict[str, Any]) -> None:  # lock held
        """A new cluster: no run is current (views of the current run start empty) until
        a cell of it logs; earlier runs keep their points and are marked earlier."""
        self.cluster_no += 1
        self.cluster_info = dict(info)
        self.run_id = 0
        self._want_run = False

    def _clear_runs(self) -> None:  # lock held
        self._curves.clear()
        self.runs.clear()
        self.run_id = 0

    def hide_runs(self, keep_last: int = 1) -> int:
        """Take all but the last ``keep_last`` runs off the comparison chart (their points
        stay in ``hvdnb.metrics()``); returns how many were hidden."""
        with self._lock:
            n = 0
            for run in self.runs[: max(0, len(self.runs) - keep_last)]:
                if not run["hidden"]:
                    run["hidden"] = True
                    n += 1
            self.version += 1
            return n

    def run_curves(
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
        with self._lock:
            runs = [dict(r) for r in self.runs if not r["hidden"]][-last_runs:]
            out = []
            for run in runs:
                rid = run["id"]
                cs = self._curves.get((rid, name))
                if cs is None:
                    cs = self._curves[(rid, name)] = _CurveSums()
                cs.add(self._series, rid, name)
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
                earlier = run.get("cluster", self.cluster_no) != self.cluster_no
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
