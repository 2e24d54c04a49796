"""The panel's chart models: what each chart shows, read from the store, drawn by no one here.

One model per chart, as dask's dashboard has one ``DashboardComponent`` per plot: the loss
(``loss_chart``), allreduce time per step (``allreduce_chart``), the step-time breakdown
(``breakdown_chart``), memory (``memory_chart``) and the runs compared (``runs_chart``).
Each turns the ``MetricsStore`` into the numbers a chart shows: a line per rank, or beyond
``MAX_LINES`` ranks a min/max band with the median and one median line per host; EMA
smoothing; the breakdown's stacked parts (per rank, or the median per host); the memory
columns; the axis limits with spike clipping (``axis_limits``). The live SVG
(``hvdnb.notebook.panel.svg``) and the saved PNG (``hvdnb.notebook.panel.png``) both draw
these models, so each shaping rule exists once, here; ``points`` (how many points a line
keeps) is the one thing a renderer picks.

Owns: the data of the charts. Never: touch widgets, matplotlib or SVG text; write to the
store; turn a missing reading into 0 (None and NaN stay missing).
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hvdnb.notebook.metrics.store import MetricsStore

__all__ = [
    "BAND_COLUMNS",
    "LIVE_POINTS",
    "MAX_LINES",
    "PHASES",
    "PNG_POINTS",
    "SPIKE_FACTOR",
    "BarChart",
    "Limits",
    "LineChart",
    "MemoryChart",
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
    "resample",
    "runs_chart",
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


def fmt_value(v: float) -> str:
    """A number as the charts print it (axis ticks, the clipped maximum)."""
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e4 or a < 1e-3:
        return f"{v:.1e}"
    return f"{v:.4g}"


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

    def limits(self) -> Limits | None:
        return axis_limits(self.lines, self.band, log_y=self.log_y, clip_spikes=self.clip_spikes)


def loss_chart(
    store: MetricsStore,
    *,
    points: int = LIVE_POINTS,
    alpha: float = 0.0,
    log_y: bool = False,
    ranks: list[int] | None = None,
) -> LineChart:
    """Each rank's loss of the current run (at most ~``points`` points, EMA-smoothed with
    ``alpha`` per step); beyond ``MAX_LINES`` ranks the min/max band and median over all
    of them, plus one median line per host (2 to ``MAX_LINES`` hosts); the last 8 knob
    changes as marks."""
    ranks = store.ranks() if ranks is None else ranks
    lines: list[Line] = []
    drawn: list[int] = []
    for r in ranks:
        xs, ys, stride = store.thinned("loss", r, points)
        if xs:  # thinned by ``stride``: one drawn point stands for ``stride`` steps
            lines.append((f"rank {r}", xs, ema(ys, alpha**stride if alpha else 0.0)))
            drawn.append(r)
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
    return LineChart(
        lines,
        "no loss yet: hvdnb.log(step, loss)",
        band=band,
        band_ranks=len(drawn) if band is not None else 0,
        marks=marks,
        log_y=log_y,
    )


def allreduce_chart(
    store: MetricsStore, *, points: int = LIVE_POINTS, ranks: list[int] | None = None
) -> LineChart:
    """Milliseconds per step over the last ``points`` steps: the collective's own time
    summed over buckets, and the time each rank's step waited for it (exposed), for up to
    ``MAX_LINES - 1`` ranks (evenly picked beyond that); spikes clipped."""
    ranks = store.ranks() if ranks is None else ranks
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
    return LineChart(
        lines,
        "no allreduce timings (hvdnb.torch reports them)",
        clip_spikes=True,
        backends=backends_text(store),
    )


@dataclass
class BarChart:
    """Stacked bars: one row (name, ms per part of ``PHASES``) per rank, or per host (the
    median of its ranks) when there are more than ``MAX_LINES`` ranks on several hosts."""

    #: "rank" or "host": what a row is (a rank's row is named by its number)
    by: str
    rows: list[tuple[str, list[float]]]
    empty: str = "no step times yet"

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
    With a GPU (any rank reports ``gpu_allocated``) the GPU's figures, else the RSS."""

    values: dict[int, dict[str, float | None]]
    gpu: bool

    @property
    def ranks(self) -> list[int]:
        return sorted(self.values)

    @property
    def columns(self) -> list[str]:
        """The readings the memory table lists."""
        return ["gpu_allocated", "gpu_reserved", "gpu_nvml_used", "rss"] if self.gpu else ["rss"]

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
    ``missing``: runs without an x (no ``samples=`` logged)."""

    x: str
    lines: list[Line]
    marks: list[tuple[float, str, int]]
    missing: list[int]
    empty: str
    log_y: bool = False


def runs_chart(
    store: MetricsStore, *, x: str = "step", points: int = LIVE_POINTS, log_y: bool = False
) -> RunsChart:
    curves = store.run_curves(x=x, points=points)
    lines: list[Line] = []
    marks: list[tuple[float, str, int]] = []
    missing: list[int] = []
    for c in curves:
        if c["xs"] is None:
            missing.append(c["id"])
            continue
        marks.extend((mx, lab, len(lines)) for mx, lab in c["marks"])
        lines.append((c["label"], c["xs"], c["ys"]))
    empty = (
        "no runs yet: a %%distributed cell that calls hvdnb.log is a run"
        if not curves
        else "n/a: these runs logged no samples= (hvdnb.log(step, loss, samples=n))"
    )
    return RunsChart(x, lines, marks[-12:], missing, empty, log_y)
