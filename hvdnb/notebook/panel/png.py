"""The panel's picture: loss, allreduce, step-time breakdown and memory, drawn to PNG bytes.

Owns: one matplotlib ``Figure`` on the Agg canvas (no pyplot, no global state, no GUI
backend), drawn from a ``MetricsStore``. Many ranks: up to ``MAX_LINES`` lines, beyond that
a min/max band and the median. Never: touch widgets, the channel or the ranks; never draw
a missing reading as 0 (it says "n/a").
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

__all__ = ["MAX_LINES", "render_png", "smooth"]

MAX_LINES = 16
#: points per rank kept on the loss plot (older ones are thinned)
MAX_POINTS = 1500
_PHASE_COLORS = {"data": "#f2a541", "compute": "#4c78a8", "comm": "#e45756"}


def smooth(values: np.ndarray, alpha: float) -> np.ndarray:
    """Exponential moving average with weight ``alpha`` on the past (0: none)."""
    if alpha <= 0 or len(values) < 2:
        return values
    out = np.empty_like(values)
    acc = values[0]
    a, b = alpha, 1.0 - alpha
    for i, v in enumerate(values):
        if v == v:
            acc = a * acc + b * v if acc == acc else v
        out[i] = acc
    return out


def _thin(steps: list[int], vals: list[float]) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(steps, dtype=float)
    v = np.asarray(vals, dtype=float)
    if len(s) > MAX_POINTS:
        idx = np.linspace(0, len(s) - 1, MAX_POINTS).astype(int)
        s, v = s[idx], v[idx]
    return s, v


class _Figure:
    """A reusable figure (creating one costs more than drawing it)."""

    def __init__(self, width: float = 10.0, height: float = 6.2, dpi: int = 72) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.fig = Figure(figsize=(width, height), dpi=dpi)
        self.canvas = FigureCanvasAgg(self.fig)
        gs = self.fig.add_gridspec(2, 2, hspace=0.45, wspace=0.25)
        self.ax_loss = self.fig.add_subplot(gs[0, 0])
        self.ax_comm = self.fig.add_subplot(gs[0, 1])
        self.ax_break = self.fig.add_subplot(gs[1, 0])
        self.ax_mem = self.fig.add_subplot(gs[1, 1])

    def png(self) -> bytes:
        buf = io.BytesIO()
        self.canvas.print_png(buf)
        return buf.getvalue()


_FIG: _Figure | None = None


def _figure() -> _Figure:
    global _FIG
    if _FIG is None:
        _FIG = _Figure()
    return _FIG


def render_png(
    store: Any, *, log_y: bool = False, smoothing: float = 0.0, ranks: list[int] | None = None
) -> bytes:
    """Draw the four plots from ``store`` and return PNG bytes."""
    f = _figure()
    ranks = store.ranks() if ranks is None else ranks
    _loss(f.ax_loss, store, ranks, log_y, smoothing)
    _comm(f.ax_comm, store, ranks)
    _breakdown(f.ax_break, store)
    _memory(f.ax_mem, store, ranks)
    return f.png()


def _loss(ax: Any, store: Any, ranks: list[int], log_y: bool, alpha: float) -> None:
    ax.cla()
    ax.set_title("loss", fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    series = []
    for r in ranks:
        steps, vals, _ = store.thinned("loss", r, MAX_POINTS)
        if steps:
            s, v = _thin(steps, vals)
            series.append((r, s, smooth(v, alpha)))
    if not series:
        ax.text(
            0.5,
            0.5,
            "no loss yet: hvdnb.log(step, loss)",
            ha="center",
            va="center",
            transform=ax.transAxes,
            fontsize=8,
            color="gray",
        )
        return
    if len(series) <= MAX_LINES:
        for r, s, v in series:
            ax.plot(s, v, lw=1.0, label=f"rank {r}")
        if len(series) > 1:
            ax.legend(fontsize=6, ncol=2 if len(series) > 4 else 1, loc="upper right")
    else:
        lo = min(float(s[0]) for _, s, _ in series)
        hi = max(float(s[-1]) for _, s, _ in series)
        grid = np.linspace(lo, hi, 400) if hi > lo else np.array([lo])
        stack = np.vstack([np.interp(grid, s, v, left=np.nan, right=np.nan) for _, s, v in series])
        with np.errstate(all="ignore"):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                mn, mx = np.nanmin(stack, 0), np.nanmax(stack, 0)
                med = np.nanmedian(stack, 0)
        ax.fill_between(
            grid, mn, mx, alpha=0.25, color="#4c78a8", label=f"min-max of {len(series)} ranks"
        )
        ax.plot(grid, med, lw=1.2, color="#4c78a8", label="median")
        ax.legend(fontsize=6, loc="upper right")
    if log_y:
        ax.set_yscale("log")
    for step, label in list(store.marks)[-8:]:
        ax.axvline(step, color="#d62728", ls="--", lw=0.8)
        ax.annotate(
            label,
            (step, 1.0),
            xycoords=("data", "axes fraction"),
            fontsize=6,
            color="#d62728",
            rotation=90,
            va="top",
            ha="right",
        )


def _comm(ax: Any, store: Any, ranks: list[int]) -> None:
    ax.cla()
    backends = {i.get("backend") for i in store.rank_info.values() if i.get("backend")}
    name = "/".join(sorted(_backend_name(b) for b in backends)) or "backend n/a"
    ax.set_title(f"allreduce time per step (ms) - {name}", fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    drawn = 0
    shown = ranks if len(ranks) <= MAX_LINES else ranks[:: max(1, len(ranks) // MAX_LINES)]
    for r in shown:
        per = store.per_step("comm/", r, last_steps=MAX_POINTS)
        if per:
            st = sorted(per)
            ax.plot(st, [1e3 * per[k] for k in st], lw=0.9, label=f"rank {r}")
            drawn += 1
    if not drawn:
        ax.text(
            0.5,
            0.5,
            "no allreduce timings (hvdnb.torch reports them)",
            ha="center",
            va="center",
            transform=ax.transAxes,
            fontsize=8,
            color="gray",
        )
    elif drawn > 1 and drawn <= 8:
        ax.legend(fontsize=6, loc="upper right")


def _breakdown(ax: Any, store: Any) -> None:
    ax.cla()
    ax.set_title("step time per rank (ms, median of last 50 steps)", fontsize=10)
    ax.tick_params(labelsize=7)
    b = store.breakdown()
    if not b:
        ax.text(
            0.5,
            0.5,
            "no step times yet",
            ha="center",
            va="center",
            transform=ax.transAxes,
            fontsize=8,
            color="gray",
        )
        return
    ranks = sorted(b)
    y = np.arange(len(ranks))
    left = np.zeros(len(ranks))
    for ph in ("data", "compute", "comm"):
        w = np.array([1e3 * b[r][ph] for r in ranks])
        ax.barh(y, w, left=left, color=_PHASE_COLORS[ph], label=ph, height=0.7)
        left += w
    ax.set_yticks(y if len(ranks) <= 16 else y[:: max(1, len(ranks) // 16)])
    ax.set_yticklabels(
        [str(r) for r in (ranks if len(ranks) <= 16 else ranks[:: max(1, len(ranks) // 16)])]
    )
    ax.set_ylabel("rank", fontsize=8)
    ax.invert_yaxis()
    ax.legend(fontsize=6, loc="lower right", ncol=3)


def _memory(ax: Any, store: Any, ranks: list[int]) -> None:
    ax.cla()
    ax.tick_params(labelsize=7)
    mem = store.memory()
    gpu = any(m.get("gpu_allocated") is not None for m in mem.values())
    keys = ("gpu_allocated", "gpu_reserved") if gpu else ("rss",)
    ax.set_title("GPU memory per rank (GB)" if gpu else "process RSS per rank (GB)", fontsize=10)
    rs = sorted(mem)
    if not rs:
        ax.text(0.5, 0.5, "n/a", ha="center", va="center", transform=ax.transAxes, color="gray")
        return
    x = np.arange(len(rs))
    width = 0.8 / len(keys)
    for i, k in enumerate(keys):
        vals = [mem[r].get(k) for r in rs]
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
    if len(keys) > 1:
        ax.legend(fontsize=6)


def _backend_name(b: str | None) -> str:
    return {"nccl": "NCCL", "gloo": "Gloo", "mpi": "MPI", "local": "local"}.get(
        (b or "").lower(), b or "n/a"
    )


def fmt_bytes(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.2f} {unit}"
    return f"{v:.0f} B"
