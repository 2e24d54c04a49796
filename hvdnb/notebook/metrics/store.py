"""Client side of the live panel: every point the ranks sent, in one thread-safe store.

Owns: ingesting ``metrics`` messages from the cluster's side channel (handlers run on the
channel's I/O thread: an append under a lock, nothing more), sequence checks per rank (a
gap is counted in ``lost``, never hidden), the knob protocol's notebook leg (forwarding
rank 0's plan to every rank, recording specs, plans and applications), and the views the
panel and exports read: ``rows()`` (``hvdnb.metrics()``), per-rank series, the step-time
breakdown with its one-line hint, allreduce and memory summaries, and the ranks grouped
by host (``hosts()``, ``host_summary()``: each rank says its host once, in ``rank_info``).
CSV and JSONL exports read the same rows.

Runs and segments (what tuning compares): each ``%%distributed`` cell that logs starts a
*run* (``begin_cell`` / ``end_cell`` from ``hvdnb.notebook.cells``; the run begins with the cell's
first point that is not a memory reading or a knob record), and each knob change applied
during it starts a new *segment* of that run at the step it was applied. Every point is
tagged with its run; rows carry run, segment and the knob values in force at their step
on their rank. Live views (per-rank series, step breakdown, allreduce) show the current
run; ``run_curves`` overlays the runs.

Communication, per collective or fused bucket and step, as ``hvdnb.torch`` and
``ddp_comm_hook`` report it: ``comm/<bucket>/time`` is the collective's own duration,
``comm/<bucket>/exposed`` what the training thread waited for it (the step breakdown's
"comm" when the loop marks no ``phase("comm")``), ``comm/<bucket>/bytes`` this rank's
payload. While a loop logs, ranks time the collectives of one step in k (see
``Config.comm_sample_interval``): these rows exist on those steps only. A collective is
one operation: it runs from the moment the last rank joins it to its completion, and a
rank that started it earlier also waited for the others. So the panel's *collective
time* of a bucket at a step is the smallest of the ranks' own readings (the last rank to
arrive waited least); a rank's excess over it is waiting for peers, which shows as
exposed time and in the straggler hint. Bus bandwidth follows nccl-tests:
``bytes * 2 (n - 1) / n / collective time`` for n ranks. Series are indexed by rank as
well as by (rank, name), so views cost O(ranks), not O(ranks x series): 1,024 ranks
stay cheap.

Never: import torch or widgets, block the channel thread, or invent a value: a reading a
rank did not send is None (shown as "n/a"), not 0.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import json
import math
import statistics
import threading
import time
from array import array
from pathlib import Path
from typing import Any, NamedTuple

from hvdnb.protocol import kinds

__all__ = ["MetricRow", "MetricRows", "MetricsStore", "attach", "get_store", "metrics", "set_knobs"]


#: beyond this many ranks, views summarise (shorter windows, per-host rows)
MANY_RANKS = 256


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


class _Series:
    """One metric of one rank: typed columns (a message's arrays are appended at C speed
    and a point costs 24 bytes, not three Python objects)."""

    __slots__ = ("runs", "steps", "times", "values")

    def __init__(self) -> None:
        self.steps = array("q")
        self.values = array("d")
        self.times = array("d")
        self.runs: list[tuple[int, int]] = []  # (run id, index of its first point here)

    def run_slice(self, run: int) -> slice:
        """The points of ``run`` (runs are appended in order, so one contiguous range)."""
        for k, (rid, start) in enumerate(self.runs):
            if rid == run:
                end = self.runs[k + 1][1] if k + 1 < len(self.runs) else len(self.steps)
                return slice(start, end)
        return slice(0, 0)


def _typed_columns(col: Any) -> tuple[array, array, array]:
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
    return not (name.startswith("mem/") or name.startswith("knob/"))


def thin_indices(length: int, n: int) -> tuple[list[int] | None, int]:
    """Which of ``length`` points a chart of at most ~``n`` points draws: None (all of
    them) or evenly spaced indices plus the last one; and the stride between them."""
    if length <= n:
        return None, 1
    stride = length / n
    return [int(i * stride) for i in range(n)] + [length - 1], max(1, int(stride))


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

    def add(self, series: dict[tuple[int, str], _Series], rid: int, name: str) -> None:
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


class MetricsStore:
    """Every point from every rank, plus knob events; safe to feed from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # a rank's message came in
        self._series: dict[tuple[int, str], _Series] = {}
        self._names_of: dict[int, list[str]] = {}  # rank -> its series' names
        self.version = 0  # bumped on every change; the panel redraws when it moves
        self.points = 0
        self.messages = 0
        self.lost_messages = 0  # sequence gaps
        self.lost_rows = 0  # rows a rank's ring overwrote before it could flush
        self._seq: dict[int, tuple[int, int]] = {}  # rank -> (pid, last seq)
        self._lost_by_rank: dict[int, int] = {}
        self.rank_info: dict[int, dict[str, Any]] = {}
        self.knob_spec: dict[str, dict[str, Any]] = {}
        self.knob_events: list[dict[str, Any]] = []  # requests, plans, applications, errors
        #: runs in order: {"id", "cell", "started", "knobs" (at its start), "changes"
        #: [(step, values, rank)], "marks" [(step, label)], "hidden"}
        self.runs: list[dict[str, Any]] = []
        self.run_id = 0  # the current run (0: none yet)
        self._want_run = False  # a cell is running and has not logged yet
        self._in_cell = False
        self._cell_no: int | None = None
        self._ids = itertools.count(1)
        self.last_request: str | None = None
        self._cluster: Any = None
        self._channel: Any = None
        #: (time a row was logged on its rank, time it reached this store), for latency
        self.arrivals: list[tuple[float, float]] = []
        self.keep_arrivals = False
        self._breakdown_cache: tuple[tuple[int, int], dict[int, dict[str, float]]] | None = None
        #: (run id, name) -> what run_curves has summed so far (a run's points are only
        #: ever appended, so each redraw adds the new points instead of starting over)
        self._curves: dict[tuple[int, str], _CurveSums] = {}

    @property
    def marks(self) -> list[tuple[int, str]]:
        """(step, label) of the knob changes applied in the current run."""
        run = self._run(self.run_id)
        return list(run["marks"]) if run is not None else []

    def _run(self, rid: int) -> dict[str, Any] | None:
        return self.runs[rid - 1] if 0 < rid <= len(self.runs) else None

    # -------------------------------------------------------------- runs (main thread)
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
            }
        )
        self.run_id = rid
        self._want_run = False

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

    # -------------------------------------------------------------- ingest (I/O thread)
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
            for name, col in cols.items():
                try:
                    steps, times, values = _typed_columns(col)
                except (TypeError, ValueError, OverflowError):
                    continue  # not three columns of numbers of one length: dropped
                s = self._series.get((rank, name))
                if s is None:
                    s = self._series[(rank, name)] = _Series()
                    self._names_of.setdefault(rank, []).append(name)
                if not s.runs or s.runs[-1][0] != rid:
                    s.runs.append((rid, len(s.steps)))
                s.steps.extend(steps)
                s.times.extend(times)
                s.values.extend(values)
                n += len(steps)
                if self.keep_arrivals and name == "loss":
                    self.arrivals.extend((t, now) for t in times)
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

    def on_spec(self, msg: dict[str, Any]) -> None:
        spec = msg.get("spec")
        if isinstance(spec, dict):
            with self._lock:
                self.knob_spec = spec
                run = self._run(self.run_id)
                if self._in_cell and run is not None and not run["changes"]:
                    # knobs made in the running cell: they are this run's starting values
                    run["knobs"] = {k: v.get("value") for k, v in spec.items()}
                self.version += 1

    def on_plan(self, msg: dict[str, Any]) -> None:
        """Rank 0's decision: record it and forward it to every rank."""
        with self._lock:
            self.knob_events.append({"kind": "plan", "time": time.time(), **_strip(msg)})
            self.version += 1
        if msg.get("error"):
            return
        ch = self._channel
        if ch is not None:
            payload = {k: msg[k] for k in ("id", "apply_at", "values") if k in msg}
            for r in self._ranks():
                ch.send(r, kinds.KNOBS_PLAN, **payload)

    def on_applied(self, msg: dict[str, Any]) -> None:
        with self._lock:
            self.knob_events.append({"kind": "applied", "time": time.time(), **_strip(msg)})
            if not msg.get("error"):
                vals = msg.get("values") or {}
                label = ", ".join(f"{k}={v:g}" for k, v in vals.items())
                step = int(msg.get("step", 0))
                run = self._run(self.run_id)
                if self._in_cell and self._want_run:  # applied before the cell's first log
                    self._start_run(time.time())
                    run = self._run(self.run_id)
                if self._in_cell and run is not None:  # a segment of the running run
                    run["changes"].append((step, dict(vals), msg.get("rank")))
                    if (step, label) not in run["marks"]:
                        run["marks"].append((step, label))
                for k, v in vals.items():
                    if k in self.knob_spec:
                        self.knob_spec[k] = {**self.knob_spec[k], "value": v}
            self.version += 1

    def _ranks(self) -> list[int]:
        c = self._cluster
        ids = None
        try:
            ids = list(c.client.ids) if c is not None and c.client is not None else None
        except Exception:
            ids = None
        if ids:
            return sorted(ids)
        ch = self._channel
        return list(ch.ranks) if ch is not None else []

    # -------------------------------------------------------------- knobs (notebook)
    def request_knobs(self, at_step: int | None = None, **values: Any) -> tuple[bool, str]:
        """Ask rank 0 to schedule a change; returns (sent, message). Validated here first.

        ``at_step``: apply at that step of the running loop (or of the next one, when no
        loop runs); default: as soon as every rank can, at one step."""
        from hvdnb.protocol.knobs import validate

        spec = self.knob_spec
        if not spec:
            return False, "no knobs yet: create them with hvdnb.knobs(...) in a %%distributed cell"
        err = validate(spec, values)
        if (
            err is None
            and at_step is not None
            and (isinstance(at_step, bool) or not isinstance(at_step, int) or at_step < 0)
        ):
            err = f"at_step must be a step number >= 0, not {at_step!r}"
        if err:
            with self._lock:
                self.knob_events.append(
                    {"kind": "refused", "time": time.time(), "error": err, "values": values}
                )
                self.version += 1
            return False, f"refused: {err}"
        if self._channel is None:
            return False, "no cluster is running"
        rid = f"k{next(self._ids)}-{int(time.time() * 1000) % 100000}"
        with self._lock:
            self.knob_events.append(
                {"kind": "request", "time": time.time(), "id": rid, "values": values}
            )
            self.version += 1
        self.last_request = rid
        extra = {"at_step": at_step} if at_step is not None else {}
        self._channel.send(0, kinds.KNOBS_REQ, id=rid, values=values, **extra)
        return True, f"sent to rank 0 ({rid})"

    def knob_status(self, rid: str | None = None) -> dict[str, Any]:
        """For one request (default: the latest): plan and the ranks that applied it."""
        with self._lock:
            events = list(self.knob_events)
        if rid is None:
            reqs = [e for e in events if e["kind"] in ("request", "refused")]
            if not reqs:
                return {}
            if reqs[-1]["kind"] == "refused":
                return {"error": reqs[-1]["error"]}
            rid = reqs[-1]["id"]
        plan = next((e for e in events if e["kind"] == "plan" and e.get("id") == rid), None)
        applied = {
            e["rank"]: e
            for e in events
            if e["kind"] == "applied" and e.get("id") == rid and "rank" in e
        }
        return {"id": rid, "plan": plan, "applied": applied}

    # -------------------------------------------------------------- views
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

    def _slice(self, s: _Series, run: int | None) -> slice:
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
            return rs.stop - rs.start

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

    def per_step(
        self, prefix: str, rank: int, last_steps: int = 50, suffix: str = "/time"
    ) -> dict[int, float]:
        """Sum of every metric whose name starts with ``prefix`` and ends with ``suffix``
        (or equals ``prefix``), per step of the current run, over its last ``last_steps``
        steps."""
        with self._lock:
            keys = self._summed_keys(prefix, rank, suffix)
            parts = []
            for k in keys:
                s = self._series[k]
                rs = s.run_slice(self.run_id)
                lo = max(rs.start, rs.stop - 4 * last_steps)
                parts.append((s.steps[lo : rs.stop], s.values[lo : rs.stop]))
        out: dict[int, float] = {}
        for steps, values in parts:
            for st, v in zip(steps, values):
                if v == v:
                    out[st] = out.get(st, 0.0) + v
        if len(out) > last_steps:
            keep = sorted(out)[-last_steps:]
            out = {k: out[k] for k in keep}
        return out

    def _summed_keys(self, prefix: str, rank: int, suffix: str) -> list[tuple[int, str]]:
        """The series ``per_step`` / ``at_steps`` sum: ``prefix`` itself, or names starting
        with ``prefix`` and ending with ``suffix`` (caller holds the lock)."""
        return [
            (rank, n)
            for n in self._names_of.get(rank, ())
            if n == prefix or (n.startswith(prefix) and n.endswith(suffix))
        ]

    def at_steps(
        self, prefix: str, rank: int, steps: Any, suffix: str = "/time"
    ) -> dict[int, float]:
        """``per_step``'s sums at the given steps of the current run (steps missing from a
        series contribute nothing). Found by bisection: step numbers increase within a
        loop; a cell that runs two loops (steps start over) may find fewer of them."""
        with self._lock:
            keys = self._summed_keys(prefix, rank, suffix)
            out: dict[int, float] = {}
            for k in keys:
                s = self._series[k]
                rs = s.run_slice(self.run_id)
                arr, values = s.steps, s.values
                lo_, hi_ = rs.start, rs.stop
                for st in steps:
                    i = bisect.bisect_left(arr, st, lo_, hi_)
                    while i < hi_ and arr[i] == st:
                        v = values[i]
                        if v == v:
                            out[st] = out.get(st, 0.0) + v
                        i += 1
        return out

    def breakdown(self, last_steps: int = 50) -> dict[int, dict[str, float]]:
        """Median seconds per step on each rank, split into data / compute / comm.

        ``step`` comes from the time between two ``hvdnb.log`` calls, ``data`` from
        ``phase("data")`` (or ``data_time=``), ``comm`` from ``phase("comm")`` when marked,
        else the *exposed* communication ``hvdnb.torch`` / ``ddp_comm_hook`` reported (time
        the training thread waited for collectives; communication hidden behind backward
        is compute time, not comm), and ``compute`` is the rest (or ``phase("compute")``
        when marked). With exposed communication, the medians are over the last
        ``last_steps`` steps whose collectives were timed (one step in k while a loop logs,
        see ``Config.comm_sample_interval``): each row pairs a step's own total, data and
        comm.

        Computed once per store version (the panel's chart and hint share it); beyond
        ``MANY_RANKS`` ranks the medians cover the last ``last_steps // 5`` steps, which
        keeps a redraw at 1,024 ranks within ~0.1 s.
        """
        cached = self._breakdown_cache
        if cached is not None and cached[0] == (self.version, last_steps):
            return cached[1]
        version = self.version
        ranks = self.ranks()
        if len(ranks) > MANY_RANKS:
            last_steps = max(5, last_steps // 5)
        out: dict[int, dict[str, float]] = {}
        for r in ranks:
            step = self.per_step("time/step", r, last_steps)
            if not step:
                continue
            comm = self.per_step("time/comm", r, last_steps)
            if comm:
                data = self.per_step("time/data", r, last_steps)
                marked_compute = self.per_step("time/compute", r, last_steps)
            else:
                comm = self.per_step("comm/", r, last_steps, suffix="/exposed")
                if comm:  # the timed steps (one in k): every part read at those steps
                    step = self.at_steps("time/step", r, comm) or step
                data = self.at_steps("time/data", r, step)
                marked_compute = self.at_steps("time/compute", r, step)
            rows = []
            for st, total in step.items():
                d = min(data.get(st, 0.0), total)
                c = min(comm.get(st, 0.0), total - d)
                comp = marked_compute.get(st, total - d - c)
                rows.append((total, d, c, comp))
            med = [statistics.median(col) for col in zip(*rows)]
            out[r] = {"step": med[0], "data": med[1], "comm": med[2], "compute": med[3]}
        self._breakdown_cache = (
            (version, last_steps if len(ranks) <= MANY_RANKS else last_steps * 5),
            out,
        )
        return out

    def hint(self, last_steps: int = 50) -> str:
        """One line naming the bottleneck (data, communication or compute) and stragglers."""
        b = self.breakdown(last_steps)
        if not b:
            return "no step times yet: call hvdnb.log(step, loss) once per step"
        tot = {k: statistics.median(v[k] for v in b.values()) for k in ("data", "comm", "compute")}
        step = statistics.median(v["step"] for v in b.values()) or 1e-12
        worst = max(tot, key=lambda k: tot[k])
        words = {"data": "data loading", "comm": "communication", "compute": "compute"}
        line = f"bottleneck: {words[worst]} ({100 * tot[worst] / step:.0f}% of a {1e3 * step:.1f} ms step)"
        busy = {r: v["data"] + v["compute"] for r, v in b.items()}
        if len(busy) > 1:
            med = statistics.median(busy.values())
            slow = max(busy, key=lambda r: busy[r])
            if med > 0 and busy[slow] > 1.2 * med and busy[slow] - med > 1e-4:
                line += (
                    f"; straggler: rank {slow} ({busy[slow] / med:.2f}x the median "
                    "data+compute time; the others wait for it in allreduce)"
                )
        return line

    def hosts(self) -> dict[str, list[int]]:
        """Ranks grouped by the host they said they run on (``"?"`` until they say)."""
        out: dict[str, list[int]] = {}
        for r in self.ranks():
            out.setdefault(str(self.rank_info.get(r, {}).get("host") or "?"), []).append(r)
        return dict(sorted(out.items(), key=lambda kv: kv[1][0]))

    def host_summary(self, name: str = "loss") -> list[dict[str, Any]]:
        """Per host: its ranks, the step range, and the min / median / max over its ranks
        of the latest ``name`` and of the step time (None where no rank sent them)."""
        out = []
        for host, ranks in self.hosts().items():
            vals, steps, times = [], [], []
            for r in ranks:
                v = self.latest(name, r)
                if v is not None and v == v:
                    vals.append(v)
                info = self.rank_info.get(r, {})
                if info.get("step") is not None:
                    steps.append(int(info["step"]))
                if info.get("step_time") is not None:
                    times.append(float(info["step_time"]))
            out.append(
                {
                    "host": host,
                    "ranks": ranks,
                    "step_min": min(steps) if steps else None,
                    "step_max": max(steps) if steps else None,
                    f"{name}_min": min(vals) if vals else None,
                    f"{name}_median": statistics.median(vals) if vals else None,
                    f"{name}_max": max(vals) if vals else None,
                    "step_time_min": min(times) if times else None,
                    "step_time_max": max(times) if times else None,
                }
            )
        return out

    def collective_times(self, last_steps: int = 50) -> dict[str, dict[int, float]]:
        """Per bucket, per step of the current run: the collective's time, i.e. the
        smallest of the ranks' readings at that step (see the module docstring); NaN
        readings (not measurable) are left out."""
        with self._lock:
            out: dict[str, dict[int, float]] = {}
            for (r, n), s in self._series.items():
                if not (n.startswith("comm/") and n.endswith("/time")):
                    continue
                rs = s.run_slice(self.run_id)
                lo = max(rs.start, rs.stop - 4 * last_steps)
                per = out.setdefault(n[5:-5], {})
                for st, v in zip(s.steps[lo : rs.stop], s.values[lo : rs.stop]):
                    if v == v and (st not in per or v < per[st]):
                        per[st] = v
        for bucket, per in out.items():
            if len(per) > last_steps:
                keep = sorted(per)[-last_steps:]
                out[bucket] = {k: per[k] for k in keep}
        return out

    def comm_summary(self, last: int = 20) -> list[dict[str, Any]]:
        """Per rank and bucket, over its last ``last`` completions in the current run:
        median collective time (``time``: the bucket's time at each step is the smallest
        of the ranks' readings, see the module docstring; ``own_time``: this rank's own
        readings, waiting for peers included), median exposed time (``exposed``), median
        bytes, bus bandwidth (``bytes * 2 (n - 1) / n / time``, nccl-tests' definition,
        n = ranks reporting) and backend. A figure that was not measured is None
        ("n/a")."""
        n_ranks = max(1, len(self.ranks()))
        coll = self.collective_times(last_steps=last)
        with self._lock:
            keys = [k for k in self._series if k[1].startswith("comm/") and k[1].endswith("/time")]
            data = []

            def tail(key: tuple[int, str]) -> tuple[list[int], list[float]]:
                s = self._series.get(key)
                if s is None:
                    return [], []
                rs = s.run_slice(self.run_id)
                lo = max(rs.start, rs.stop - last)
                return s.steps[lo : rs.stop], s.values[lo : rs.stop]

            for r, n in keys:
                steps, t = tail((r, n))
                if t:
                    data.append(
                        (
                            r,
                            n[5:-5],
                            steps,
                            t,
                            tail((r, n[:-5] + "/bytes"))[1],
                            tail((r, n[:-5] + "/exposed"))[1],
                        )
                    )
        out = []
        factor = 2 * (n_ranks - 1) / n_ranks
        for r, bucket, steps, t, nb, ex in sorted(data):
            own = [x for x in t if x == x]
            per = coll.get(bucket, {})
            tt = [per[st] for st in steps if st in per]
            ee = [x for x in ex if x == x]
            med_t = statistics.median(tt) if tt else None
            med_b = statistics.median(nb) if nb else None
            bw = med_b * factor / med_t if med_t and med_b is not None and factor else None
            out.append(
                {
                    "rank": r,
                    "bucket": bucket,
                    "time": med_t,
                    "bytes": med_b,
                    "own_time": statistics.median(own) if own else None,
                    "exposed": statistics.median(ee) if ee else None,
                    "bus_bandwidth": bw,
                    "bandwidth": bw,
                    "backend": self.rank_info.get(r, {}).get("backend"),
                }
            )
        return out

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
        list of ``{"id", "label", "xs", "ys", "marks": [(x, label)]}``, oldest first
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
                out.append(
                    {
                        "id": rid,
                        "label": _run_label(run),
                        "xs": xs,
                        "ys": ys,
                        "marks": marks,
                    }
                )
        return out

    def memory(self) -> dict[int, dict[str, float | None]]:
        """Latest memory readings per rank (None: the rank did not report it)."""
        names = ("mem/rss", "mem/gpu_allocated", "mem/gpu_reserved", "mem/gpu_nvml_used")
        return {r: {n[4:]: self.latest(n, r) for n in names} for r in self.ranks()}

    def throughput(self, window: float = 3.0) -> float | None:
        """Samples per second over every rank in the last ``window`` seconds of logs."""
        total, t_lo, t_hi = 0.0, math.inf, -math.inf
        found = False
        ranks = self.ranks()
        last = 2000 if len(ranks) <= MANY_RANKS else 200
        for r in ranks:
            _, vals, times = self.series("samples", r, last=last)
            if not times:
                continue
            found = True
            # a rank's samples come from its log() calls, in time order
            i = bisect.bisect_right(times, times[-1] - window)
            if len(times) - i < 2:
                continue
            total += sum(vals[i + 1 :])
            t_lo, t_hi = min(t_lo, times[i]), max(t_hi, times[-1])
        if not found or t_hi <= t_lo:
            return None
        return total / (t_hi - t_lo)

    def progress(self) -> tuple[int, int | None]:
        """(latest step seen on any rank, total_steps if the loop said so)."""
        steps = [i.get("step") or 0 for i in self.rank_info.values()]
        totals = [i.get("total_steps") for i in self.rank_info.values() if i.get("total_steps")]
        return (max(steps) if steps else 0), (max(totals) if totals else None)

    def clear(self) -> None:
        with self._lock:
            self._series.clear()
            self._curves.clear()
            self._names_of.clear()
            self.runs.clear()
            self.run_id = 0
            self.knob_events.clear()
            self.points = 0
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

    # -------------------------------------------------------------- wiring
    def attach_current(self) -> None:
        """Follow ``hvdnb.current()`` (a restarted cluster has a new channel)."""
        from hvdnb.notebook.cluster.lifecycle import current

        c = current()
        if c is not None and c.channel is not None and c.channel is not self._channel:
            self.attach(c)

    def attach(self, cluster: Any) -> None:
        """Feed this store from ``cluster.channel`` (again after a restart: idempotent)."""
        ch = getattr(cluster, "channel", None)
        if ch is None or ch is self._channel:
            self._cluster = cluster
            return
        self._cluster = cluster
        self._channel = ch
        ch.on(kinds.METRICS, self.ingest)
        ch.on(kinds.RANK_INFO, self.on_rank_info)
        ch.on(kinds.KNOBS_SPEC, self.on_spec)
        ch.on(kinds.KNOBS_PLAN, self.on_plan)
        ch.on(kinds.KNOBS_APPLIED, self.on_applied)


def _run_label(run: dict[str, Any]) -> str:
    """``run 3: batch_size=64 warmup_steps=100 -> batch_size=128 @ 200``."""
    knobs = " ".join(f"{k}={v:g}" for k, v in run["knobs"].items() if isinstance(v, (int, float)))
    text = f"run {run['id']}" + (f": {knobs}" if knobs else "")
    seen = set()
    for st, vals, _ in run["changes"]:
        key = (st, tuple(sorted(vals.items())))
        if key in seen:
            continue
        seen.add(key)
        text += " -> " + " ".join(f"{k}={v:g}" for k, v in vals.items()) + f" @ {st}"
    return text


def _strip(msg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in msg.items() if k != "kind"}


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
    from hvdnb.notebook.cluster.lifecycle import current

    store = get_store()
    c = cluster if cluster is not None else current()
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
    from hvdnb.protocol.knobs import validate

    store = attach()
    if not values:
        raise ValueError("no knob values given: e.g. set_knobs(batch_size=64)")
    if after is not None:
        if not isinstance(after, (int, float)) or isinstance(after, bool) or not after >= 0:
            raise ValueError(f"after must be a number of seconds >= 0, not {after!r}")
        if store.knob_spec:  # refuse what is already known to be wrong now, not later
            err = validate(store.knob_spec, values)
            if err:
                raise ValueError(f"refused: {err}")
        if store._channel is None:
            raise ValueError("no cluster is running: `%dist start` first")

        def later() -> None:
            ok, msg = store.request_knobs(at_step=at_step, **values)
            if not ok:
                with store._lock:
                    store.knob_events.append(
                        {"kind": "refused", "time": time.time(), "error": msg, "values": values}
                    )
                    store.version += 1

        timer = threading.Timer(float(after), later)
        timer.daemon = True
        timer.start()
        return {"scheduled_in": float(after)}
    ok, msg = store.request_knobs(at_step=at_step, **values)
    if not ok:
        raise ValueError(msg)
    rid = store.last_request
    deadline = time.monotonic() + timeout
    status = store.knob_status(rid)
    while time.monotonic() < deadline:
        status = store.knob_status(rid)
        plan = status.get("plan")
        if plan is not None and (plan.get("error") or plan.get("apply_at") is not None):
            break  # refused, or planned for a step: the ranks apply it when they get there
        if plan is not None and len(status.get("applied") or {}) >= len(store._ranks()):
            break
        time.sleep(0.02)
    return status


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
