"""The panel's chart models: what each chart shows, read from the store, drawn by no one here.

One model per chart, as dask's dashboard has one ``DashboardComponent`` per plot: the loss
(``loss_chart``), allreduce time per step (``allreduce_chart``), the step-time breakdown
(``breakdown_chart``), memory (``memory_chart``) and the runs compared (``runs_chart``).
Each turns the ``MetricsStore`` into the numbers a chart shows: a line per rank, or beyond
``MAX_LINES`` ranks a min/max band with the median and one median line per host; EMA
smoothing; the window of last steps the loss and allreduce charts show; the breakdown's
stacked parts (per rank, or the median per host); the memory columns; the axis limits with
spike clipping (``axis_limits``; the round ticks are ``panel/ticks.py``'s); what a hover
reads at each step (``readouts``); each chart's title and colours (``title``, ``PALETTE``,
``BAND_COLOR``, ``MARK_COLOR``, ``ALARM_COLOR``, ``PHASES``). The live SVG
(``hvdnb.notebook.panel.svg``) and the saved PNG (``hvdnb.notebook.panel.png``) both draw
these models, so each shaping rule exists once, here; ``points`` (how many points a line
keeps) is the one thing a renderer picks.

Owns: the data of the charts, their titles and colours. Never: touch widgets, matplotlib or SVG
text; write to the store; turn a missing reading into 0 (None and NaN stay missing).
"""

from __future__ import annotations

import bisect
import math
import re
import statistics
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hvdnb.notebook.metrics.points import thin_indices
from hvdnb.notebook.metrics.store import MetricsStore
from hvdnb.notebook.panel.ticks import fmt_value, nice_ticks
from hvdnb.protocol.kinds import MAIN_LOSS

__all__ = [
    "ALARM_COLOR",
    "BAND_COLOR",
    "BAND_COLUMNS",
    "HOVER_COLUMNS",
    "LIVE_POINTS",
    "MARK_COLOR",
    "MAX_LINES",
    "PALETTE",
    "PHASES",
    "PNG_POINTS",
    "SPIKE_FACTOR",
    "WINDOWS",
    "BarChart",
    "Limits",
    "LineChart",
    "MemoryChart",
    "Readout",
    "RunsChart",
    "allreduce_chart",
    "axis_limits",
    "backend_name",
    "backends_text",
    "band_of",
    "breakdown_chart",
    "ema",
    "fmt_value",
    "loss_chart",
    "memory_chart",
    "nice_ticks",
    "readouts",
    "resample",
    "runs_chart",
    "window_note",
]

#: more ranks than this: a min/max band, the median and one median line per host
MAX_LINES = 16
#: points per line in the live charts (older points are thinned, not dropped from the store)
LIVE_POINTS = 300
#: points per line in the saved picture
PNG_POINTS = 1500
#: the band is resampled on at most this many columns (finer is invisible at the charts' widths)
BAND_COLUMNS = 400
#: with spike clipping, the y axis ends at this many times the 95th percentile
SPIKE_FACTOR = 3.0
#: the breakdown's parts, in stacking order, with their colours (both pictures)
PHASES: tuple[tuple[str, str], ...] = (
    ("data", "#f2a541"),
    ("compute", "#4c78a8"),
    ("comm", "#e45756"),
)

#: the colour of the watchers' alarm marks (knob changes are ``MARK_COLOR``)
ALARM_COLOR = "#7b2d8e"
#: a knob change's mark, and the note that spikes were clipped (both pictures)
MARK_COLOR = "#d62728"
#: the min-max band and its median (both pictures; the band's readout rows too)
BAND_COLOR = "#4c78a8"
#: the lines' colours, in order (the live panel's lines, legends and run marks)
PALETTE: tuple[str, ...] = (
    "#4c78a8",
    "#f58518",
    "#54a24b",
    "#e45756",
    "#72b7b2",
    "#b279a2",
    "#ff9da6",
    "#9d755d",
    "#bab0ac",
    "#eeca3b",
    "#1f77b4",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#17becf",
)
#: the step windows the loss and allreduce charts offer (0: the whole run)
WINDOWS: tuple[int, ...] = (0, 100, 1000, 10000)
#: a hover reads the lines on at most this many columns of the plot
HOVER_COLUMNS = 40

#: (label, xs, ys)
Line = tuple[str, list[float], list[float]]
#: (grid, min, max, median), each a list over the grid
Band = tuple[list[float], list[float], list[float], list[float]]


# ------------------------------------------------------------------ shaping rules
def ema(values: list[float], alpha: float) -> list[float]:
    """Exponential moving average with weight ``alpha`` on the past (0: none). A NaN
    leaves the average where it was (and a leading NaN stays NaN)."""
    if alpha <= 0:
        return values
    out: list[float] = []
    acc: float | None = None
    for v in values:
        if v == v:
            acc = v if acc is None else alpha * acc + (1 - alpha) * v
        out.append(acc if acc is not None else v)
    return out


def resample(lines: Sequence[Line], columns: int) -> tuple[np.ndarray, np.ndarray]:
    """Every line resampled on one grid of ``columns`` steps (NaN outside its range):
    (grid, stack) with one stack row per line."""
    lo = min(xs[0] for _, xs, _ in lines)
    hi = max(xs[-1] for _, xs, _ in lines)
    grid = np.linspace(lo, hi, columns) if hi > lo else np.array([lo])
    stack = np.vstack([np.interp(grid, xs, ys, left=np.nan, right=np.nan) for _, xs, ys in lines])
    return grid, stack


def band_of(grid: np.ndarray, stack: np.ndarray) -> Band:
    """(grid, min, max, median) over the rows of ``stack``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mn, mx, med = np.nanmin(stack, 0), np.nanmax(stack, 0), np.nanmedian(stack, 0)
    return grid.tolist(), mn.tolist(), mx.tolist(), med.tolist()


def _median_of(stack: np.ndarray) -> list[float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return list(np.nanmedian(stack, 0).tolist())


def backend_name(b: Any) -> str:
    """A rank's backend as shown (NCCL, Gloo, MPI; anything else as it came)."""
    return {"nccl": "NCCL", "gloo": "Gloo", "mpi": "MPI"}.get(str(b).lower(), str(b or "n/a"))


def backends_text(store: MetricsStore) -> str:
    """The ranks' backends, e.g. ``NCCL`` or ``Gloo/MPI`` (``backend n/a`` before any)."""
    names = {backend_name(i.get("backend")) for i in store.rank_info.values() if i.get("backend")}
    return "/".join(sorted(names)) or "backend n/a"


@dataclass(frozen=True)
class Limits:
    """A line chart's axes: x0..x1, y0..y1 (y in log10 units on a log axis); ``clipped``
    values lie above y1 (a spike), the largest being ``y_max``."""

    x0: float
    x1: float
    y0: float
    y1: float
    clipped: int = 0
    y_max: float = 0.0

    @property
    def clip_note(self) -> str:
        """What the chart says about the clipped values ("" when none)."""
        if not self.clipped:
            return ""
        s = "s" if self.clipped > 1 else ""
        return f"{self.clipped} point{s} above the axis (max {fmt_value(self.y_max)})"


def axis_limits(
    series: Sequence[tuple[str, Sequence[float], Sequence[float]]],
    band: tuple[Sequence[float], Sequence[float], Sequence[float], Sequence[float]] | None = None,
    *,
    log_y: bool = False,
    clip_spikes: bool = False,
) -> Limits | None:
    """The axes that show ``series`` and ``band`` (None: nothing to show; NaN and, on a
    log axis, values <= 0 are left out).

    ``clip_spikes``: a few values far above the rest (the first allreduce of a loop, which
    sets up connections, took 319 ms where the steady ones took 0.13) would squash every
    other point onto the axis. With 20 or more points and a largest value over twice the
    cap (``SPIKE_FACTOR`` x the 95th percentile), the y axis ends at the cap. A flat line
    gets half its value of room either side."""
    pts = [(x, y) for _, xs, ys in series for x, y in zip(xs, ys) if y == y]
    if band is not None:
        pts += [(x, y) for x, lo, hi, _ in zip(*band) for y in (lo, hi) if y == y]
    if log_y:
        pts = [(x, y) for x, y in pts if y > 0]
    if not pts:
        return None
    xs_all = [p[0] for p in pts]
    ys_all = [math.log10(p[1]) for p in pts] if log_y else [p[1] for p in pts]
    x0, x1 = min(xs_all), max(xs_all)
    y0, y1 = min(ys_all), max(ys_all)
    clipped, y_max = 0, y1
    if clip_spikes and not log_y and len(ys_all) >= 20:
        cap = SPIKE_FACTOR * float(np.percentile(ys_all, 95))
        if y0 < cap and y1 > 2 * cap:  # a mild outlier keeps the full axis
            clipped = sum(1 for y in ys_all if y > cap)
            y1 = cap
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5 * (abs(y0) or 1), y1 + 0.5 * (abs(y1) or 1)
    return Limits(x0, x1, y0, y1, clipped, y_max)


@dataclass(frozen=True)
class Readout:
    """What a hover shows over one column of a line chart: the column's span ``a``..``b``
    (x units), the step ``x`` it reads, and (label, value, line) for each line with a
    point there; ``line`` is the index in ``series`` (its colour), -1 for the band's
    min / median / max."""

    a: float
    b: float
    x: float
    rows: list[tuple[str, float, int]]


def _short(label: str) -> str:
    """A line's label as a readout row names it: ``run 3``, not the run's knob values;
    ``collective``, not ``collective (all buckets)``."""
    return re.split(r": | \(", label, maxsplit=1)[0]


def _nearest(xs: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Per value of ``at``, the index of the nearest of the sorted ``xs``."""
    i = np.clip(np.searchsorted(xs, at), 1, len(xs) - 1)
    return np.where(np.abs(xs[i - 1] - at) <= np.abs(xs[i] - at), i - 1, i)


def readouts(
    series: Sequence[tuple[str, Sequence[float], Sequence[float]]],
    band: tuple[Sequence[float], Sequence[float], Sequence[float], Sequence[float]] | None,
    x0: float,
    x1: float,
    columns: int = HOVER_COLUMNS,
) -> list[Readout]:
    """The hover readouts of a chart whose x axis runs ``x0``..``x1``, like plotly's
    "x unified" hover: the axis cut into ``columns`` columns, each reading the drawn
    point nearest its middle (of the band's grid, else of the first line) and every
    line's value at that step (the band's max / median / min first). A line without a
    point within a column's width of that step (or a NaN there) has no row; neighbouring
    columns that read the same step are one (a short run has a few wide columns)."""
    if x1 <= x0 or columns < 1:
        return []
    xs_of: list[tuple[np.ndarray, np.ndarray]] = []
    for _, xs, ys in series:
        x = np.asarray(xs, dtype=float)
        y = np.asarray(ys, dtype=float)
        if len(x) and np.any(np.diff(x) < 0):  # two loops in one run: steps start over
            order = np.argsort(x, kind="stable")
            x, y = x[order], y[order]
        xs_of.append((x, y))
    bx: np.ndarray | None = None
    stats: list[tuple[str, np.ndarray]] = []
    if band is not None and len(band[0]):
        bx = np.asarray(band[0], dtype=float)
        stats = [
            ("max", np.asarray(band[2], dtype=float)),
            ("median", np.asarray(band[3], dtype=float)),
            ("min", np.asarray(band[1], dtype=float)),
        ]
    ref = bx if bx is not None else next((x for x, _ in xs_of if len(x)), None)
    if ref is None:
        return []
    width = (x1 - x0) / columns
    mids = x0 + width * (np.arange(columns) + 0.5)
    at = ref[_nearest(ref, mids)] if len(ref) > 1 else np.full(columns, ref[0])
    if bx is not None:  # the band's grid is resampled: it reads the nearest whole step
        at = np.rint(at)
    picks: list[tuple[list[bool], list[float]]] = []  # per line: (has a row, value) a column
    for x, y in ([(bx, v) for _, v in stats] if bx is not None else []) + xs_of:
        if not len(x):
            picks.append(([False] * columns, [math.nan] * columns))
            continue
        i = _nearest(x, at) if len(x) > 1 else np.zeros(columns, int)
        v = y[i]
        picks.append((((np.abs(x[i] - at) <= width) & (v == v)).tolist(), v.tolist()))
    labels = [(name, -1) for name, _ in stats] + [
        (_short(lab), k) for k, (lab, _, _) in enumerate(series)
    ]
    steps = at.tolist()
    out: list[Readout] = []
    for c in range(columns):
        a, b, step = x0 + c * width, x0 + (c + 1) * width, steps[c]
        if out and out[-1].x == step and out[-1].b >= a - 1e-9 * width:
            out[-1] = Readout(out[-1].a, b, step, out[-1].rows)
            continue
        rows = [(name, vs[c], k) for (name, k), (ok, vs) in zip(labels, picks) if ok[c]]
        if rows:
            out.append(Readout(a, b, step, rows))
    return out


# ------------------------------------------------------------------ the models
@dataclass
class LineChart:
    """Lines (label, xs, ys), or a band with per-host median lines over it; vertical
    marks (x, label); ``empty``: what the chart says without data."""

    lines: list[Line]
    empty: str
    band: Band | None = None
    #: ranks the band covers (0: no band)
    band_ranks: int = 0
    marks: list[tuple[float, str]] = field(default_factory=list)
    log_y: bool = False
    clip_spikes: bool = False
    #: the ranks' backends (the allreduce chart's title)
    backends: str = ""
    #: the last steps shown (0: the whole run)
    window: int = 0
    #: the watchers' alarms (x, label): ``nan r1``, ``spike r0``, ``drift`` (loss chart)
    alarms: list[tuple[float, str]] = field(default_factory=list)
    #: the chart's title, the same in the live panel and the saved picture
    title: str = ""

    def limits(self) -> Limits | None:
        return axis_limits(self.lines, self.band, log_y=self.log_y, clip_spikes=self.clip_spikes)


def window_note(window: int) -> str:
    """How a chart's title says its window: `` (last 1,000 steps)``; "" for the whole run."""
    return f" (last {window:,} steps)" if window else ""


def _cut(lines: list[Line], window: int) -> list[Line]:
    """``lines`` from the last ``window`` steps of the furthest one on (0: all of them)."""
    ends = [xs[-1] for _, xs, _ in lines if xs]
    if not window or not ends:
        return lines
    first = max(ends) - window
    out: list[Line] = []
    for label, xs, ys in lines:
        keep = [i for i, x in enumerate(xs) if x > first] if xs and xs[0] <= first else None
        if keep is None:
            out.append((label, xs, ys))
        elif keep:
            out.append((label, [xs[i] for i in keep], [ys[i] for i in keep]))
    return out


def _loss_lines(
    store: MetricsStore, ranks: list[int], points: int, window: int, name: str = "loss"
) -> list[tuple[int, list[float], list[float], int]]:
    """(rank, steps, losses, stride) of each rank with a loss: at most ~``points`` points
    of the run, or of its last ``window`` steps (counted from the furthest rank)."""
    if not window:
        out = []
        for r in ranks:
            xs, ys, stride = store.thinned(name, r, points)
            if xs:  # thinned by ``stride``: one drawn point stands for ``stride`` steps
                out.append((r, xs, ys, stride))
        return out
    raw: list[tuple[int, list[int], list[float]]] = []
    for r in ranks:  # copies at most ``window`` points per rank
        if store.count(name, r) <= points:
            xs, ys, _ = store.thinned(name, r, points)
            raw.append((r, [int(x) for x in xs], ys))
        else:
            steps, vals, _ = store.series(name, r, last=window)
            raw.append((r, steps, vals))
    ends = [steps[-1] for _, steps, _ in raw if steps]
    if not ends:
        return []
    first = max(ends) - window
    out = []
    for r, steps, vals in raw:
        a = bisect.bisect_right(steps, first)  # steps rise within a loop
        if a == len(steps):
            continue
        idx, stride = thin_indices(len(steps) - a, points)
        if idx is None:
            out.append((r, [float(x) for x in steps[a:]], vals[a:], 1))
        else:
            out.append((r, [float(steps[a + i]) for i in idx], [vals[a + i] for i in idx], stride))
    return out


def loss_chart(
    store: MetricsStore,
    *,
    points: int = LIVE_POINTS,
    alpha: float = 0.0,
    log_y: bool = False,
    ranks: list[int] | None = None,
    window: int = 0,
) -> LineChart:
    """Each rank's loss of the current run, or of its last ``window`` steps (at most
    ~``points`` points, EMA-smoothed with ``alpha`` per step); where no rank logged a
    ``loss``, the loss a framework logged on its main process (``MAIN_LOSS``: the HF
    Trainer's mean over ranks, ``accelerator.log``'s), one line "main process"; beyond
    ``MAX_LINES`` ranks the min/max band and median over all of them, plus one median
    line per host (2 to ``MAX_LINES`` hosts); the last 8 knob changes as marks, the last 8
    watchers' alarms (``hvdnb.watch``) as marks of their own."""
    ranks = store.ranks() if ranks is None else ranks
    lines: list[Line] = []
    drawn: list[int] = []
    for r, xs, ys, stride in _loss_lines(store, ranks, points, window):
        lines.append((f"rank {r}", xs, ema(ys, alpha**stride if alpha else 0.0)))
        drawn.append(r)
    if not lines:  # a framework that logs its loss on the main process only (HF Trainer)
        for _, xs, ys, stride in _loss_lines(store, ranks, points, window, MAIN_LOSS):
            lines.append(("main process", xs, ema(ys, alpha**stride if alpha else 0.0)))
    band = None
    if len(lines) > MAX_LINES:
        grid, stack = resample(lines, min(points, BAND_COLUMNS))
        band = band_of(grid, stack)
        hosts = store.hosts()
        per_host: list[Line] = []
        if 1 < len(hosts) <= MAX_LINES:  # one median line per host over the band
            row_of = {r: i for i, r in enumerate(drawn)}
            for host, rs in hosts.items():
                rows = [row_of[r] for r in rs if r in row_of]
                if rows:
                    per_host.append((f"{host} ({len(rows)})", band[0], _median_of(stack[rows])))
        lines = per_host
    marks = [(float(st), lab) for st, lab in list(store.marks)[-8:]]
    alarms = [(float(st), lab) for st, lab in store.alarm_marks()[-8:]]
    return LineChart(
        lines,
        "no loss yet: hvdnb.log(step, loss)",
        band=band,
        band_ranks=len(drawn) if band is not None else 0,
        marks=marks,
        log_y=log_y,
        window=window,
        alarms=alarms,
        title="loss" + (" (log)" if log_y else "") + window_note(window),
    )


def allreduce_chart(
    store: MetricsStore,
    *,
    points: int = LIVE_POINTS,
    ranks: list[int] | None = None,
    window: int = 0,
) -> LineChart:
    """Milliseconds per step over the last ``points`` timed steps (collectives are timed
    on sampled steps), cut to the last ``window`` steps (0: no cut): the collective's own
    time summed over buckets, and the time each rank's step waited for it (exposed), for
    up to ``MAX_LINES - 1`` ranks (evenly picked beyond that); spikes clipped."""
    ranks = store.live_ranks() if ranks is None else ranks
    lines: list[Line] = []
    shown = ranks if len(ranks) <= MAX_LINES else ranks[:: max(1, len(ranks) // MAX_LINES)]
    total: dict[int, float] = {}
    for per_bucket in store.collective_times(last_steps=points).values():
        for st, v in per_bucket.items():
            total[st] = total.get(st, 0.0) + v
    if total:
        steps = sorted(total)
        lines.append(
            ("collective (all buckets)", [float(x) for x in steps], [1e3 * total[k] for k in steps])
        )
    for r in shown[: max(1, MAX_LINES - 1)]:
        per = store.per_step("comm/", r, last_steps=points, suffix="/exposed")
        if per:
            steps = sorted(per)
            lines.append(
                (f"rank {r} exposed", [float(x) for x in steps], [1e3 * per[k] for k in steps])
            )
    backends = backends_text(store)
    return LineChart(
        _cut(lines, window),
        "no allreduce timings (hvdnb.torch reports them)",
        clip_spikes=True,
        backends=backends,
        window=window,
        title=f"allreduce ms per step ({backends}){window_note(window)}",
    )


@dataclass
class BarChart:
    """Stacked bars: one row (name, ms per part of ``PHASES``) per rank, or per host (the
    median of its ranks) when there are more than ``MAX_LINES`` ranks on several hosts."""

    #: "rank" or "host": what a row is (a rank's row is named by its number)
    by: str
    rows: list[tuple[str, list[float]]]
    empty: str = "no step times yet"

    @property
    def title(self) -> str:
        return "step time (median of last 50 steps; comm = exposed)"

    def labels(self) -> list[str]:
        """The rows' labels: ``rank 3``, or the host's ``name (ranks)``."""
        if self.by == "rank":
            return [f"rank {name}" for name, _ in self.rows]
        return [name for name, _ in self.rows]


def breakdown_chart(store: MetricsStore) -> BarChart:
    """The step time split into data / compute / comm (exposed), in ms, median of the
    last 50 steps; one bar per host (its ranks' median, first 64 hosts) beyond
    ``MAX_LINES`` ranks on several hosts."""
    b = store.breakdown()
    parts = [p for p, _ in PHASES]
    rows = [(str(r), [1e3 * b[r][p] for p in parts]) for r in sorted(b)]
    hosts = store.hosts()
    if len(rows) > MAX_LINES and len(hosts) > 1:
        per_host = []
        for host, rs in list(hosts.items())[:64]:
            mine = [b[r] for r in rs if r in b]
            if mine:
                per_host.append(
                    (
                        f"{host} ({len(mine)})",
                        [1e3 * statistics.median(m[p] for m in mine) for p in parts],
                    )
                )
        return BarChart("host", per_host)
    return BarChart("rank", rows)


@dataclass
class MemoryChart:
    """The latest memory readings per rank (bytes; None: not reported, shown as n/a).
    With a GPU (any rank reports ``gpu_allocated``) the GPU's figures, its utilisation
    (``*_pct``: NVML's utilization.gpu and utilization.memory, percent; n/a without NVML),
    else the RSS."""

    values: dict[int, dict[str, float | None]]
    gpu: bool

    @property
    def title(self) -> str:
        return "GPU memory per rank (GB)" if self.gpu else "process RSS per rank (GB)"

    @property
    def ranks(self) -> list[int]:
        return sorted(self.values)

    @property
    def columns(self) -> list[str]:
        """The readings the memory table lists."""
        if not self.gpu:
            return ["rss"]
        return [
            "gpu_allocated",
            "gpu_reserved",
            "gpu_nvml_used",
            "gpu_util_pct",
            "gpu_membw_util_pct",
            "rss",
        ]

    @property
    def bars(self) -> tuple[str, ...]:
        """The readings the memory chart draws."""
        return ("gpu_allocated", "gpu_reserved") if self.gpu else ("rss",)


def memory_chart(store: MetricsStore) -> MemoryChart:
    mem = store.memory()
    return MemoryChart(mem, any(m.get("gpu_allocated") is not None for m in mem.values()))


@dataclass
class RunsChart:
    """The last runs' mean loss over ranks (x: step or samples seen), one line each,
    labelled with its knob values; marks (x, label, line number) at its knob changes;
    ``missing``: runs without an x (no ``samples=`` logged); ``earlier``: the line numbers
    of runs on an earlier cluster or pinned from the run store (``%dist compare``)."""

    x: str
    lines: list[Line]
    marks: list[tuple[float, str, int]]
    missing: list[int]
    empty: str
    log_y: bool = False
    earlier: list[int] = field(default_factory=list)

    @property
    def title(self) -> str:
        what = "samples seen (all ranks)" if self.x == "samples" else "step"
        return f"runs: mean loss vs {what}" + (" (log)" if self.log_y else "")


def runs_chart(
    store: MetricsStore, *, x: str = "step", points: int = LIVE_POINTS, log_y: bool = False
) -> RunsChart:
    curves = store.run_curves(x=x, points=points)
    lines: list[Line] = []
    marks: list[tuple[float, str, int]] = []
    missing: list[int] = []
    earlier: list[int] = []
    for c in store.pinned_curves(x=x, points=points) + curves:  # pinned: %dist compare
        if c["xs"] is None:
            missing.append(c["id"])
            continue
        marks.extend((mx, lab, len(lines)) for mx, lab in c["marks"])
        if c.get("earlier"):
            earlier.append(len(lines))
        lines.append((c["label"], c["xs"], c["ys"]))
    empty = (
        "no runs yet: a %%distributed cell that calls hvdnb.log is a run"
        if not curves
        else "n/a: these runs logged no samples= (hvdnb.log(step, loss, samples=n))"
    )
    return RunsChart(x, lines, marks[-12:], missing, empty, log_y, earlier)
