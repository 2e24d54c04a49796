"""The saved picture: the chart models drawn to PNG bytes (loss, allreduce, step-time
breakdown, memory), for the copy of the panel a saved notebook shows.

Owns: one matplotlib ``Figure`` on the Agg canvas (no pyplot, no global state, no GUI
backend) and how each model looks in it. What the charts show (lines or band + host
medians, smoothing, the breakdown's rows, memory columns, clipped spikes) is the models'
in ``hvdnb.notebook.panel.charts``, the same as the live SVG's. Never: touch widgets, the
channel or the ranks; shape data here; run on a redraw tick or on a cell's path (a PNG of 2
ranks' 2,000 steps took a median 446 ms on a loaded 2-core box, 591 ms at 64 ranks:
``bench/bench_png.py``, ``bench/results/png.json``; ``layout`` draws it in a background
thread when the kernel is idle, and ``%dist stop`` draws a stale one); draw a missing
reading as 0 (it says "n/a").
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdnb.notebook.metrics.store import MetricsStore
from hvdnb.notebook.panel.charts import (
    ALARM_COLOR,
    BAND_COLOR,
    MARK_COLOR,
    PHASES,
    PNG_POINTS,
    BarChart,
    LineChart,
    MemoryChart,
    RunsChart,
    allreduce_chart,
    breakdown_chart,
    loss_chart,
    memory_chart,
    runs_chart,
)

__all__ = ["Picture", "draw", "picture", "render_png"]


class _Figure:
    """A reusable figure (creating one costs more than drawing it): the four charts in two
    rows, and with ``runs`` a third row across both columns for the runs chart."""

    def __init__(self, runs: bool = False, dpi: int = 72) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415  matplotlib is heavy: only for the saved picture
        from matplotlib.figure import Figure  # noqa: PLC0415  matplotlib is heavy: only for the saved picture

        rows = 3 if runs else 2
        self.fig = Figure(figsize=(10.0, 3.1 * rows), dpi=dpi)
        self.canvas = FigureCanvasAgg(self.fig)
        gs = self.fig.add_gridspec(rows, 2, hspace=0.45, wspace=0.25)
        self.ax_loss = self.fig.add_subplot(gs[0, 0])
        self.ax_comm = self.fig.add_subplot(gs[0, 1])
        self.ax_break = self.fig.add_subplot(gs[1, 0])
        self.ax_mem = self.fig.add_subplot(gs[1, 1])
        self.ax_runs = self.fig.add_subplot(gs[2, :]) if runs else None

    def png(self) -> bytes:
        buf = io.BytesIO()
        self.canvas.print_png(buf)
        return buf.getvalue()


_FIGS: dict[bool, _Figure] = {}


def _figure(runs: bool = False) -> _Figure:
    if runs not in _FIGS:
        _FIGS[runs] = _Figure(runs)
    return _FIGS[runs]


@dataclass
class Picture:
    """What one picture draws: the chart models, read from the store at one moment (a
    cell's end: that run's, however soon the next one starts) and drawn later, off the
    cell's path (``draw``)."""

    loss: LineChart
    comm: LineChart
    breakdown: BarChart
    memory: MemoryChart
    runs: RunsChart | None = None


def picture(
    store: MetricsStore,
    *,
    log_y: bool = False,
    smoothing: float = 0.0,
    ranks: list[int] | None = None,
    window: int = 0,
    runs: bool = False,
) -> Picture:
    """Read the models of a picture of ``store``'s current run (and with ``runs``, the runs
    chart of every run since the kernel started) now."""
    return Picture(
        loss_chart(
            store, points=PNG_POINTS, alpha=smoothing, log_y=log_y, ranks=ranks, window=window
        ),
        allreduce_chart(store, points=PNG_POINTS, ranks=ranks, window=window),
        breakdown_chart(store),
        memory_chart(store),
        runs_chart(store, points=PNG_POINTS, log_y=log_y) if runs else None,
    )


def draw(p: Picture) -> bytes:
    """``p`` drawn to PNG bytes (matplotlib: hundreds of ms; never on a cell's path)."""
    f = _figure(p.runs is not None)
    _loss(f.ax_loss, p.loss)
    _comm(f.ax_comm, p.comm)
    _breakdown(f.ax_break, p.breakdown)
    _memory(f.ax_mem, p.memory)
    if f.ax_runs is not None and p.runs is not None:
        _runs(f.ax_runs, p.runs)
    return f.png()


def render_png(
    store: MetricsStore,
    *,
    log_y: bool = False,
    smoothing: float = 0.0,
    ranks: list[int] | None = None,
    window: int = 0,
    runs: bool = False,
) -> bytes:
    """Draw the four charts from ``store`` and return PNG bytes; the loss and allreduce
    over the last ``window`` steps (0: the whole run), as the live panel shows them; with
    ``runs``, the runs chart below them."""
    return draw(
        picture(store, log_y=log_y, smoothing=smoothing, ranks=ranks, window=window, runs=runs)
    )


def _runs(ax: Any, m: RunsChart) -> None:
    _start(ax, m.title)
    ax.set_xlabel("samples seen" if m.x == "samples" else "step", fontsize=8)
    if not m.lines:
        _empty(ax, m.empty)
        return
    colors = []
    for i, (label, xs, ys) in enumerate(m.lines):
        style = ":" if i in m.earlier else "-"
        (ln,) = ax.plot(xs, ys, lw=1.1, ls=style, label=label)
        colors.append(ln.get_color())
    for x, _label, i in m.marks:  # knob changes, in their run's colour
        ax.axvline(x, color=colors[i] if i < len(colors) else MARK_COLOR, ls="--", lw=0.7)
    if m.log_y:
        ax.set_yscale("log")
    ax.legend(fontsize=6, loc="upper right", ncol=1 if len(m.lines) <= 6 else 2)


def _start(ax: Any, title: str) -> None:
    ax.cla()
    ax.set_title(title, fontsize=10)
    ax.tick_params(labelsize=7)


def _empty(ax: Any, text: str) -> None:
    ax.text(
        0.5,
        0.5,
        text,
        ha="center",
        va="center",
        transform=ax.transAxes,
        fontsize=8,
        color="gray",
    )


def _loss(ax: Any, m: LineChart) -> None:
    _start(ax, m.title)
    ax.set_xlabel("step", fontsize=8)
    if not m.lines and m.band is None:
        _empty(ax, m.empty)
        return
    if m.band is not None:
        grid, mn, mx, med = m.band
        ax.fill_between(
            grid, mn, mx, alpha=0.25, color=BAND_COLOR, label=f"min-max of {m.band_ranks} ranks"
        )
        ax.plot(grid, med, lw=1.2, color=BAND_COLOR, label="median")
    for label, xs, ys in m.lines:  # per rank, or per host over the band
        ax.plot(xs, ys, lw=1.0, label=label)
    if m.band is not None or len(m.lines) > 1:
        ax.legend(fontsize=6, ncol=2 if len(m.lines) > 4 else 1, loc="upper right")
    if m.log_y:
        ax.set_yscale("log")
    for step, label, color in [
        *((x, lab, MARK_COLOR) for x, lab in m.marks),
        *((x, lab, ALARM_COLOR) for x, lab in m.alarms),
    ]:
        ax.axvline(step, color=color, ls="--", lw=0.8)
        ax.annotate(
            label,
            (step, 1.0),
            xycoords=("data", "axes fraction"),
            fontsize=6,
            color=color,
            rotation=90,
            va="top",
            ha="right",
        )


def _comm(ax: Any, m: LineChart) -> None:
    _start(ax, m.title)
    ax.set_xlabel("step", fontsize=8)
    if not m.lines:
        _empty(ax, m.empty)
        return
    lim = m.limits()
    for label, xs, ys in m.lines:
        if lim is not None and lim.clipped:  # spikes run along the top edge
            ys = np.minimum(np.asarray(ys, dtype=float), lim.y1).tolist()
        ax.plot(xs, ys, lw=0.9, label=label)
    if lim is not None and lim.clipped:
        ax.text(
            0.01,
            0.97,
            "\u2191 " + lim.clip_note,
            transform=ax.transAxes,
            fontsize=7,
            color=MARK_COLOR,
            va="top",
        )
    if 1 < len(m.lines) <= 8:
        ax.legend(fontsize=6, loc="upper right")


def _breakdown(ax: Any, m: BarChart) -> None:
    _start(ax, m.title)
    if not m.rows:
        _empty(ax, m.empty)
        return
    n = len(m.rows)
    y = np.arange(n)
    left = np.zeros(n)
    for i, (ph, color) in enumerate(PHASES):
        w = np.array([vals[i] for _, vals in m.rows])
        ax.barh(y, w, left=left, color=color, label=ph, height=0.7)
        left += w
    every = 1 if n <= 16 else max(1, n // 16)
    ax.set_yticks(y[::every])
    ax.set_yticklabels([name for name, _ in m.rows][::every])
    ax.set_ylabel(m.by, fontsize=8)
    ax.invert_yaxis()
    ax.legend(fontsize=6, loc="lower right", ncol=3)


def _memory(ax: Any, m: MemoryChart) -> None:
    _start(ax, m.title)
    rs = m.ranks
    if not rs:
        ax.text(0.5, 0.5, "n/a", ha="center", va="center", transform=ax.transAxes, color="gray")
        return
    x = np.arange(len(rs))
    width = 0.8 / len(m.bars)
    for i, k in enumerate(m.bars):
        vals = [m.values[r].get(k) for r in rs]
        h = [v / 1e9 if v is not None else 0.0 for v in vals]
        bars = ax.bar(x + i * width, h, width=width, label=k.replace("gpu_", ""))
        for bar, v in zip(bars, vals):
            if v is None:  # unknown is shown as such, never as a 0 bar
                ax.annotate(
                    "n/a",
                    (bar.get_x() + bar.get_width() / 2, 0),
                    fontsize=6,
                    ha="center",
                    va="bottom",
                    color="gray",
                )
    step = max(1, len(rs) // 16)
    ax.set_xticks(x[::step])
    ax.set_xticklabels([str(r) for r in rs[::step]])
    ax.set_xlabel("rank", fontsize=8)
    if len(m.bars) > 1:
        ax.legend(fontsize=6)
