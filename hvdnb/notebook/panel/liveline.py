"""One live line under the ``%%distributed`` cell that is training.

The panel sits beside the notebook; the cell the user watches should not be silent either.
When a cell starts a run (its first logged point), this displays one output line under it
and keeps updating it in place (``update_display``, one message per update, at most every
``interval`` seconds) until the cell ends:

    run 3 · step 120/400 · loss r0 0.521 r1 0.563 · 1,240 samples/s · bottleneck: compute
    (62% of a 1.1 ms step) · batch_size=64 warmup_steps=100

Figures: step is the furthest rank's steps done (its last logged step + 1, so a
finished ``range(400)`` loop reads 400/400); loss is each rank's latest (min-max
beyond 4 ranks); samples/s and the bottleneck are the store's (``throughput``, ``hint``);
the knob values are those in force now; the watchers' alarms of the run, last
(``⚠ nan loss r1@57``: ``hvdnb.watch``). Runs on the notebook's main thread, called by
``hvdnb.notebook.cellout.cells``' wait hook, so the update carries the cell's parent header.

Owns: the line's text and its display handle. Never: send more than one message per
interval, or show a line for a cell that logs no step (``STEP_METRICS``: a cell that only
compiles, saves or prints, whose collectives and memory still reach the store).
"""

from __future__ import annotations

import base64
import html
import time
from typing import Any

from hvdnb.notebook.metrics.store import MetricsStore
from hvdnb.protocol.kinds import MAIN_LOSS

__all__ = ["STEP_METRICS", "LiveLine", "picture_line"]

#: what a training step logs (``hvdnb.log``, the frameworks' callbacks): a run with none of
#: these on any rank trained nothing
STEP_METRICS = ("time/step", "loss", "samples", MAIN_LOSS)


class LiveLine:
    """A wait hook (``fn(final)``) that keeps one line under the running cell current.

    Parameters
    ----------
    store : the notebook's metrics store
    interval : minimum seconds between two updates of the line
    """

    def __init__(self, store: MetricsStore, interval: float = 0.25) -> None:
        self.store = store
        self.interval = interval
        self.updates = 0
        self._cell: Any = None
        self._handle: Any = None
        self._last = 0.0
        self._version = -1
        #: called with (display handle, final text) when a training cell ends (the panel's
        #: ``cell_ended``: the run's picture goes under the line)
        self.on_end: Any = None

    def __call__(self, final: bool) -> None:
        st = self.store
        cell = st.cell_no
        if cell != self._cell:  # a new cell: a new line, if it logs
            self._cell, self._handle, self._version = cell, None, -1
        run = st.current_run()
        if run is None or run["cell"] != cell or cell is None or not self._trains():
            return
        now = time.monotonic()
        if not final and (st.version == self._version or now - self._last < self.interval):
            return
        self._version, self._last = st.version, now
        out = _Line(self.text(run, final))
        if self._handle is None:
            from IPython.display import display  # noqa: PLC0415  IPython: only inside a kernel

            self._handle = display(out, display_id=True)
        elif self._handle is not None:
            self._handle.update(out)
        self.updates += 1
        if final and self.on_end is not None and self._handle is not None:
            self.on_end(self._handle, out.text)

    def text(self, run: dict[str, Any], final: bool = False) -> str:
        """The line for ``run`` now."""
        st = self.store
        step, total = st.progress()
        parts = [
            f"run {run['id']}" + (" done" if final else ""),
            f"step {step}" + (f"/{total}" if total else ""),
        ]
        losses = {}
        for r in st.live_ranks():  # not a lost rank's: its last loss is stale
            _, vals, _ = st.series("loss", r, last=1)
            if vals and vals[-1] == vals[-1]:
                losses[r] = vals[-1]
        if losses and len(losses) <= 4:
            parts.append("loss " + " ".join(f"r{r} {v:.4g}" for r, v in sorted(losses.items())))
        elif losses:
            parts.append(
                f"loss {min(losses.values()):.4g}-{max(losses.values()):.4g} ({len(losses)} ranks)"
            )
        else:
            parts.append(self._main_loss())
        rate = st.throughput()
        parts.append(f"{rate:,.0f} samples/s" if rate is not None else "samples/s n/a")
        if st.breakdown():
            parts.append(st.hint())
        knobs = " ".join(f"{k}={v['value']:g}" for k, v in st.knob_spec.items())
        if knobs:
            parts.append(knobs)
        alarms = st.alarm_summary()
        if alarms:
            parts.append(f"⚠ {alarms}")
        lost = _lost(st.lost_rows, st.lost_messages)
        if lost:
            parts.append(f"⚠ {lost}")
        return " · ".join(parts)

    def _trains(self) -> bool:
        """The run has logged a step: a loss, samples or a step time on some rank. A cell
        that only builds a model, compiles or saves (its collectives' timings, its memory)
        trains nothing and gets no line."""
        for r in self.store.ranks():
            for name in STEP_METRICS:
                if self.store.count(name, r):
                    return True
        return False

    def _main_loss(self) -> str:
        """A framework's loss logged on its main process only (``MAIN_LOSS``), or n/a."""
        for r in self.store.ranks():
            _, vals, _ = self.store.series(MAIN_LOSS, r, last=1)
            if vals and vals[-1] == vals[-1]:
                return f"loss {vals[-1]:.4g} (main process)"
        return "loss n/a"


def _lost(rows: int, messages: int) -> str:
    """What the ranks' points lost says, or "" (none lost): the line, the panel's table and
    ``hvdnb.metrics()`` say it in the same words."""
    parts = []
    if rows:
        parts.append(f"{rows:,} point{'s' if rows != 1 else ''}")
    if messages:
        parts.append(f"{messages:,} message{'s' if messages != 1 else ''}")
    return ("lost " + " and ".join(parts)) if parts else ""


class _Line:
    def __init__(self, text: str, png: bytes = b"") -> None:
        self.text = text
        self.png = png

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, str]:
        img = ""
        bundle = {"text/plain": self.text}
        if self.png:
            b64 = base64.b64encode(self.png).decode("ascii")
            bundle["image/png"] = b64
            img = (
                f"<img class='hvdnb-run-picture' alt='the run: loss per rank, allreduce, "
                f"step time split, memory' src='data:image/png;base64,{b64}'/>"
            )
        bundle["text/html"] = (
            "<div class='hvdnb-liveline' style='font:12px monospace;"
            "border-left:3px solid #4c78a8;padding-left:6px'>"
            f"{html.escape(self.text)}</div>{img}"
        )
        return bundle


def picture_line(text: str, png: bytes) -> Any:
    """A cell's last live line with its run's picture under it (what the saved file keeps)."""
    return _Line(text, png)
