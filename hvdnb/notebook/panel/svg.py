"""The live picture: the chart models drawn as inline SVG strings for the panel's HTML widget.

A matplotlib redraw of the four plots took ~430 ms on the project's 2-core machine (tick
layout dominates), which would take CPU from the ranks at the panel's 5 Hz; an SVG string
of the same data costs about a millisecond and the browser draws it. matplotlib is kept
for the PNG snapshot a saved notebook shows (``hvdnb.notebook.panel.png``).

The hover readout (step, then each line's value there, like plotly's "x unified" hover)
is CSS, not script: the panel is an HTML widget's innerHTML, where scripts never run. The
plot is cut into ``charts.HOVER_COLUMNS`` transparent columns (in one
``g.hvdnb-hover``), each a ``g`` holding its hidden readout (a guide line, a box, the
rows) and a ``<title>`` with the same text (the browser's own tooltip); the chart's
``<style>`` shows the readout of the column under the pointer. That costs the readouts'
text in every redraw: under ~15 KB a chart (fewer columns when a readout lists many
lines, ``HOVER_BYTES``).

Owns: the SVG primitives (line charts: lines, min/max band + median, vertical marks, log
y, clipped spikes, round ticks, the hover readout; stacked bars; legends) and
``charts_html`` / ``runs_html``, which draw the models of ``hvdnb.notebook.panel.charts``
with them. Never: touch widgets; shape data (what a chart shows is the model's:
smoothing, bands, stacking, windows, axis limits and ticks, the readouts' values live in
``charts``); draw a missing value as 0.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdnb.notebook.metrics.store import MetricsStore
from hvdnb.notebook.panel.charts import (
    ALARM_COLOR,
    BAND_COLOR,
    HOVER_COLUMNS,
    LIVE_POINTS,
    MARK_COLOR,
    PALETTE,
    PHASES,
    LineChart,
    Readout,
    RunsChart,
    allreduce_chart,
    axis_limits,
    breakdown_chart,
    fmt_value,
    loss_chart,
    nice_ticks,
    readouts,
    runs_chart,
)

__all__ = [
    "PALETTE",
    "charts_html",
    "legend_html",
    "line_chart",
    "runs_html",
    "stacked_bars",
]

W, H = 460, 220
L, R, T, B = 52, 10, 22, 26
#: (label, xs, ys): one line; (xs, lo, hi, median): a band; (x, label[, colour]): a mark
Series = tuple[str, Sequence[float], Sequence[float]]
SvgBand = tuple[Sequence[float], Sequence[float], Sequence[float], Sequence[float]]
Mark = tuple[float, str] | tuple[float, str, str]
#: a readout lists one line per row up to this many lines, two per row beyond
READOUT_ROWS = 8
#: about this many bytes of readouts a chart (the hover reads fewer columns, down to
#: ``MIN_COLUMNS``, when each readout lists many lines)
HOVER_BYTES = 14_500
MIN_COLUMNS = 12
#: the hover's rules (an inline SVG's style applies to the page: every rule is scoped)
HOVER_CSS = (
    "<style>.hvdnb-hover>g>rect{fill-opacity:0}"
    ".hvdnb-hover .readout{visibility:hidden;pointer-events:none}"
    ".hvdnb-hover>g:hover .readout{visibility:visible}"
    ".hvdnb-hover path{stroke:#666;stroke-dasharray:3,2}"
    ".hvdnb-hover .readout rect{fill:#fff;fill-opacity:.92;stroke:#aaa}"
    ".hvdnb-hover text:first-of-type{font-weight:bold}</style>"
)


def _fmt_x(x: float) -> str:
    return f"{x:,.0f}" if x == int(x) else fmt_value(x)


def _hover_columns(lines: int) -> int:
    """How many columns the hover reads for readouts of ``lines`` lines."""
    per = 170 + (92 * lines if lines <= READOUT_ROWS else 58 * lines)  # bytes a readout
    return max(MIN_COLUMNS, min(HOVER_COLUMNS, HOVER_BYTES // per))


def _hover(
    reads: Sequence[Readout],
    sx: Callable[[float], float],
    pw: float,
    ph: float,
    x_name: str,
) -> list[str]:
    """One ``g`` per readout (the caller puts them in a ``g.hvdnb-hover``): a transparent
    column over the plot with its
    ``<title>`` (the browser's tooltip), and the readout the CSS shows: a dashed guide at
    the step read, a box with the step and one row per line in its colour (two rows a
    line, uncoloured, beyond ``READOUT_ROWS`` lines)."""
    out: list[str] = []
    esc: dict[str, str] = {}  # a label's escaped and short forms, worked out once
    short: dict[str, str] = {}
    for rd in reads:
        a, b, gx = round(sx(rd.a)), round(sx(rd.b)), sx(rd.x)
        head = f"{x_name} {_fmt_x(rd.x)}"
        items = []
        for label, v, k in rd.rows:
            e = esc.get(label)
            if e is None:
                e = esc[label] = html.escape(label)
                short[label] = re.sub(r"^rank (\d+)", r"r\1", e)
            items.append((label, e, fmt_value(v), k))
        tip = "\n".join([head] + [f"{e} {v}" for _, e, v, _ in items])
        if len(items) <= READOUT_ROWS:
            rows = [
                (
                    f"{e} {v}",
                    len(label) + len(v),
                    BAND_COLOR if k < 0 else PALETTE[k % len(PALETTE)],
                )
                for label, e, v, k in items
            ]
        else:  # two a row: short labels, the text's own colour
            pairs = [f"{short[label]} {v}" for label, _, v, _ in items]
            rows = [
                (t, len(t), "")
                for t in (" \u00b7 ".join(pairs[i : i + 2]) for i in range(0, len(pairs), 2))
            ]
        bw = round(8 + 5.6 * max(len(head), *(n for _, n, _ in rows)))
        bx = round(gx + 6 if gx + 6 + bw <= L + pw else max(L, gx - 6 - bw))
        tx = bx + 4
        parts = [
            f"<g><rect x='{a}' y='{T}' width='{b - a}' height='{ph}'>"
            f"<title>{tip}</title></rect><g class='readout'><path d='M{gx:.1f} {T}v{ph}'/>"
            f"<rect x='{bx}' y='{T + 4}' width='{bw}' height='{17 + 11 * len(rows)}'/>"
            f"<text x='{tx}' y='{T + 15}'>{head}</text>"
        ]
        for j, (text, _, color) in enumerate(rows):
            fill = f" fill='{color}'" if color else ""
            parts.append(f"<text x='{tx}' y='{T + 26 + 11 * j}'{fill}>{text}</text>")
        parts.append("</g></g>")
        out.append("".join(parts))
    return out


@dataclass(frozen=True)
class _Plot:
    """Where a line chart draws: the axes' limits (``charts.Limits``) and the plot's size
    in pixels; maps data to pixels."""

    x0: float
    x1: float
    y0: float
    y1: float
    pw: float
    ph: float
    log_y: bool
    #: values above the axis, drawn on its top edge (0: none)
    clipped: int

    def sx(self, x: float) -> float:
        return L + (x - self.x0) / (self.x1 - self.x0) * self.pw

    def tenths(self, xs: Sequence[float], ys: Sequence[float]) -> Any:
        """A curve in tenths of a pixel, as integers (drawn inside a scale(0.1) group):
        formatting them is one join over a numpy array (a float f-string per point was
        half a redraw). NaN (and, on a log axis, values <= 0) dropped; clipped spikes run
        along the top edge."""
        x = np.asarray(xs, dtype=float)
        y = np.asarray(ys, dtype=float)
        ok = y == y
        if self.log_y:
            ok &= y > 0
        x, y = x[ok], y[ok]
        if self.log_y:
            y = np.log10(y)
        if self.clipped:
            y = np.minimum(y, self.y1)
        px = np.rint(10 * (L + (x - self.x0) / (self.x1 - self.x0) * self.pw)).astype(np.int64)
        py = np.rint(10 * (T + self.ph - (y - self.y0) / (self.y1 - self.y0) * self.ph))
        return np.column_stack((px, py.astype(np.int64)))


def _joined(xy: Any) -> str:
    return " ".join(map(str, xy.ravel().tolist()))


def _grid(p: _Plot, height: int) -> list[str]:
    """The plot's frame, grid lines and round ticks on both axes."""
    pw, ph = p.pw, p.ph
    yt = [
        (T + ph - (t - p.y0) / (p.y1 - p.y0) * ph, label)
        for t, label in nice_ticks(p.y0, p.y1, log=p.log_y)
    ]
    xt = [(p.sx(t), label) for t, label in nice_ticks(p.x0, p.x1, integer=True)]
    out = [f"<rect x='{L}' y='{T}' width='{pw}' height='{ph}' fill='none' stroke='#ccc'/>"]
    out.append("<g stroke='#eee'>")
    out.extend(f"<path d='M{L} {yy:.1f}h{pw}'/>" for yy, _ in yt)
    out.append("</g><g class='hvdnb-ticks-y' text-anchor='end' fill='#555'>")
    out.extend(f"<text x='{L - 3}' y='{yy + 3:.1f}'>{label}</text>" for yy, label in yt)
    out.append("</g><g class='hvdnb-ticks-x' text-anchor='middle' fill='#555'>")
    out.extend(f"<text x='{xx:.1f}' y='{height - 10}'>{label}</text>" for xx, label in xt)
    out.append("</g>")
    return out


def _curves(p: _Plot, series: Sequence[Series], band: SvgBand | None) -> list[str]:
    """The band (min-max polygon and median) and one polyline per series, in its colour."""
    out = ["<g transform='scale(0.1)'>"]
    if band is not None:
        bx, lo, hi, med = band
        upper, lower = p.tenths(bx, hi), p.tenths(bx, lo)
        if len(upper) and len(lower):
            poly = _joined(np.concatenate((upper, lower[::-1])))
            out.append(
                f"<polygon points='{poly}' fill='{BAND_COLOR}' fill-opacity='0.25' stroke='none'/>"
            )
        out.append(
            f"<polyline points='{_joined(p.tenths(bx, med))}' fill='none' "
            f"stroke='{BAND_COLOR}' stroke-width='15'/>"
        )
    for i, (label, xs, ys) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        out.append(
            f"<polyline points='{_joined(p.tenths(xs, ys))}' fill='none' stroke='{color}' "
            f"stroke-width='12'><title>{html.escape(label)}</title></polyline>"
        )
    out.append("</g>")
    return out


def _labels(
    p: _Plot, marks: Sequence[Mark], keys: list[tuple[str, str]], clip_note: str
) -> list[str]:
    """The marks (dashed lines and their labels), the clip note and the legend's keys.

    A mark's label goes right of its line (left of it in the plot's last quarter), on the
    first row where it overlaps no other label, the clip note (top left) or the legend
    (top right)."""
    out: list[str] = []
    pw, ph = p.pw, p.ph
    # per row: where its last label ends, and where the legend's label starts
    ends = [L + 3 + 5.6 * len(clip_note) + 12] if p.clipped else []
    stops = [L + pw - 4 - 5.6 * len(label) for label, _ in keys]
    for mark in sorted(marks, key=lambda m: m[0]):
        x, label = mark[0], mark[1]
        mc = mark[2] if len(mark) > 2 else MARK_COLOR
        if p.x0 <= x <= p.x1:
            xx = p.sx(x)
            tw = 5.6 * len(label)
            left = xx > L + 0.75 * pw and xx - 2 - tw >= L
            a, b = (xx - 2 - tw, xx - 2) if left else (xx + 2, xx + 2 + tw)
            row = 0
            while (row < len(ends) and ends[row] >= a) or (row < len(stops) and b >= stops[row]):
                row += 1
            ends += [float(L)] * (row + 1 - len(ends))
            ends[row] = b
            anchor = " text-anchor='end'" if left else ""
            out.append(
                f"<line x1='{xx:.1f}' x2='{xx:.1f}' y1='{T}' y2='{T + ph}' stroke='{mc}' "
                f"stroke-dasharray='4,3' class='hvdnb-mark'/><text x='{(b if left else a):.1f}' "
                f"y='{T + 11 + 11 * min(row, 12)}' fill='{mc}'{anchor}>{html.escape(label)}</text>"
            )
    if p.clipped:
        out.append(
            f"<text x='{L + 3}' y='{T + 11}' fill='{MARK_COLOR}' class='hvdnb-clipped'>"
            f"&#8593; {clip_note}</text>"
        )
    for i, (label, color) in enumerate(keys):
        out.append(
            f"<text x='{L + pw - 4}' y='{T + 11 + 11 * i}' text-anchor='end' "
            f"fill='{color}'>{html.escape(label)}</text>"
        )
    return out


def line_chart(
    title: str,
    series: Sequence[Series],
    *,
    band: SvgBand | None = None,
    marks: Sequence[Mark] = (),
    log_y: bool = False,
    empty: str = "no data yet",
    width: int = W,
    height: int = H,
    legend: bool = True,
    clip_spikes: bool = False,
    x_name: str = "step",
    hover: bool = True,
) -> str:
    """An SVG line chart. ``series``: (label, xs, ys); ``band``: (xs, lo, hi, median);
    ``marks``: (x, label[, color]) vertical dashed lines; ``legend=False`` leaves the
    labels to the caller (long labels, e.g. ``legend_html``). Round ticks on both axes
    (``charts.nice_ticks``); ``hover``: the readout of ``x_name`` and each line's value
    under the pointer (``charts.readouts``).

    ``clip_spikes``: a few values far above the rest (the first allreduce of a loop, which
    sets up connections) would squash every other point onto the axis; where
    ``charts.axis_limits`` clips the axis, values above it are drawn on the top edge and
    the chart says how many there are and the largest."""
    head = (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"class='hvdnb-chart' data-title='{html.escape(title)}' "
        f"style='font:10px sans-serif;background:#fff'>"
        f"<text x='{width / 2}' y='13' text-anchor='middle' font-weight='bold'>"
        f"{html.escape(title)}</text>"
    )
    lim = axis_limits(series, band, log_y=log_y, clip_spikes=clip_spikes)
    if lim is None:
        return head + (
            f"<text x='{width / 2}' y='{height / 2}' text-anchor='middle' "
            f"fill='#888'>{html.escape(empty)}</text></svg>"
        )
    p = _Plot(lim.x0, lim.x1, lim.y0, lim.y1, width - L - R, height - T - B, log_y, lim.clipped)
    out = [head, *_grid(p, height), *_curves(p, series, band)]
    keys = [(label, PALETTE[i % len(PALETTE)]) for i, (label, _, _) in enumerate(series)]
    if band is not None:
        keys = [("min-max band + median", BAND_COLOR)]
    out += _labels(p, marks, keys[:8] if legend else [], lim.clip_note if lim.clipped else "")
    if hover:  # last: the columns lie over everything else
        n = len(series) + (3 if band is not None else 0)
        reads = readouts(series, band, p.x0, p.x1, _hover_columns(n))
        if reads:
            out.append(HOVER_CSS + "<g class='hvdnb-hover'>")
            out.extend(_hover(reads, p.sx, p.pw, p.ph, x_name))
            out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def stacked_bars(
    title: str,
    rows: Sequence[tuple[str, Sequence[float]]],
    parts: Sequence[tuple[str, str]],
    *,
    unit: str = "ms",
    empty: str = "no data yet",
    width: int = W,
) -> str:
    """Horizontal stacked bars: ``rows`` (label, values per part); ``parts`` (name, color)."""
    n = len(rows)
    bar = 12 if n <= 16 else max(2, 200 // n)
    height = T + B + max(1, n) * (bar + 2) + 4
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"class='hvdnb-chart' style='font:10px sans-serif;background:#fff'>"
        f"<text x='{width / 2}' y='13' text-anchor='middle' font-weight='bold'>"
        f"{html.escape(title)}</text>"
    ]
    if not rows:
        out.append(
            f"<text x='{width / 2}' y='{height / 2 + 5}' text-anchor='middle' fill='#888'>"
            f"{html.escape(empty)}</text></svg>"
        )
        return "".join(out)
    vmax = max(sum(v for v in vals if v == v) for _, vals in rows) or 1.0
    pw = width - L - R
    for i, (label, vals) in enumerate(rows):
        y = T + i * (bar + 2)
        x = float(L)
        if n <= 32 or i % max(1, n // 16) == 0:
            out.append(
                f"<text x='{L - 3}' y='{y + bar - 2}' text-anchor='end' fill='#555'>"
                f"{html.escape(label)}</text>"
            )
        for (name, color), v in zip(parts, vals):
            if v != v or v <= 0:
                continue
            w = v / vmax * pw
            out.append(
                f"<rect x='{x:.1f}' y='{y}' width='{w:.1f}' height='{bar}' fill='{color}'>"
                f"<title>{html.escape(label)} {name}: {v:.3g} {unit}</title></rect>"
            )
            x += w
    ly = height - 8
    for i, (name, color) in enumerate(parts):
        out.append(
            f"<rect x='{L + 70 * i}' y='{ly - 8}' width='9' height='9' fill='{color}'/>"
            f"<text x='{L + 70 * i + 12}' y='{ly}'>{html.escape(name)}</text>"
        )
    out.append(
        f"<text x='{width - R}' y='{ly}' text-anchor='end' fill='#555'>max "
        f"{fmt_value(vmax)} {unit}</text></svg>"
    )
    return "".join(out)


def legend_html(labels: Sequence[str]) -> str:
    """Labels in the chart's colours, one per line (for labels too long for the chart)."""
    return "".join(
        f"<div class='hvdnb-legend' style='color:{PALETTE[i % len(PALETTE)]};font:11px sans-serif'>"
        f"&#9644; {html.escape(lab)}</div>"
        for i, lab in enumerate(labels)
    )


def _line_svg(m: LineChart) -> str:
    return line_chart(
        m.title,
        m.lines,
        band=m.band,
        marks=[*m.marks, *((x, lab, ALARM_COLOR) for x, lab in m.alarms)],
        log_y=m.log_y,
        empty=m.empty,
        clip_spikes=m.clip_spikes,
    )


def runs_svg(m: RunsChart) -> str:
    """The runs compared: the chart, its legend of knob values, and the runs without x."""
    svg = line_chart(
        m.title,
        m.lines,
        marks=[(x, lab, PALETTE[i % len(PALETTE)]) for x, lab, i in m.marks],
        log_y=m.log_y,
        empty=m.empty,
        legend=False,
        x_name="samples" if m.x == "samples" else "step",
    )
    note = (
        f"<div style='color:#888;font:11px sans-serif'>runs {', '.join(map(str, m.missing))}: "
        "n/a (no samples= logged)</div>"
        if m.missing and m.lines
        else ""
    )
    return f"<div class='hvdnb-runs'>{svg}{legend_html([lab for lab, _, _ in m.lines])}{note}</div>"


def runs_html(store: MetricsStore, x: str = "step", log_y: bool = False) -> str:
    """The comparison chart: the last runs' mean loss over ranks, overlaid, with a legend
    of their knob values and the knob changes marked in each run's colour."""
    return runs_svg(runs_chart(store, x=x, points=LIVE_POINTS, log_y=log_y))


def charts_html(
    store: MetricsStore,
    *,
    log_y: bool = False,
    alpha: float = 0.0,
    runs_x: str | None = "step",
    window: int = 0,
) -> str:
    """The live charts as inline SVG: loss of the current run, allreduce per step (both
    over the last ``window`` steps; 0: the whole run), step-time breakdown and (``runs_x``
    not None) the runs compared."""
    loss = loss_chart(store, points=LIVE_POINTS, alpha=alpha, log_y=log_y, window=window)
    comm = allreduce_chart(store, points=LIVE_POINTS, window=window)
    bars = breakdown_chart(store)
    out = [
        _line_svg(loss),
        _line_svg(comm),
        stacked_bars(
            bars.title,
            list(zip(bars.labels(), [vals for _, vals in bars.rows])),
            PHASES,
            empty=bars.empty,
        ),
    ]
    if runs_x is not None:
        out.append(runs_html(store, runs_x, log_y))
    return "".join(out)
