"""The panel's controls: knob sliders, the knob text box, the view controls (log y,
smoothing, the window of last steps the loss and allreduce charts show) and the runs
chart's controls (x axis, clear old runs), with their handlers.

A slider or the text box asks for a knob change: the text is read by
``hvdnb.protocol.knobs.parse`` (the one knob text parser), the store's ``request_knobs``
validates it and sends it to rank 0, which picks the step. The handlers run on the
control subshell's thread while a cell trains (``hvdnb.notebook.panel.kernel``) or on the
main thread between cells: they only validate, send and note what happened, and ask the
panel for a redraw (``changed``); the main thread draws. The sliders follow the values
the ranks applied without sending anything back.

Owns: the control widgets, the knob status line and the note a handler leaves. Never:
draw, block (no waiting for rank 0's answer), or send a knob request for a value the
panel itself put on a slider.
"""

from __future__ import annotations

import html
import math
import threading
from collections.abc import Callable
from typing import Any

from hvdnb.notebook.metrics.knobreq import describe_change
from hvdnb.notebook.metrics.store import MetricsStore
from hvdnb.notebook.panel import kernel as _kernel
from hvdnb.notebook.panel.charts import WINDOWS
from hvdnb.protocol.knobs import KnobTextError, parse

__all__ = ["Controls"]

NO_KNOBS = "knobs: none yet (hvdnb.knobs(...) in a %%distributed cell)"


class Controls:
    """The control widgets of one panel.

    Parameters
    ----------
    store : the store whose knobs the controls change
    subshell : the kernel subshell the widgets' comms are routed to (None: main shell)
    lock : the panel's drawing lock (a note and the redraw request change together)
    changed : called (any thread) when what the panel draws changed: redraw at the next tick
    """

    def __init__(
        self,
        store: MetricsStore,
        subshell: str | None,
        lock: threading.RLock,
        changed: Callable[[], None],
    ) -> None:
        import ipywidgets as w  # noqa: PLC0415  widgets: only when the panel is shown

        self.store = store
        self.note = ""  # set by the handlers (any thread), drawn by the panel
        #: the size a ``ranks=N`` asked for, until the cluster has it (the note says so then)
        self._scaling: int | None = None
        self.knob_widgets: dict[str, Any] = {}
        self._subshell = subshell
        self._lock = lock
        self._changed = changed
        self._knob_names: tuple[str, ...] = ()
        self._syncing = False
        self.log_y = w.Checkbox(
            value=False, description="log y", indent=False, layout=w.Layout(width="80px")
        )
        self.smoothing = w.FloatSlider(
            value=0.0,
            min=0.0,
            max=0.99,
            step=0.01,
            description="smoothing",
            continuous_update=False,
        )
        # the first steps' loss (2.3 falling to 0.1) flattens the rest: show the last N
        self.window = w.Dropdown(
            options=[("steps: all", 0)] + [(f"last {n:,} steps", n) for n in WINDOWS if n],
            value=0,
            layout=w.Layout(width="150px"),
        )
        self.window.add_class("hvdnb-window")
        # one slider per row, each the panel's full width: side by side, three knobs left
        # each track 0 px wide at JupyterLab's default split (only handle and value showed)
        self.knob_box = w.VBox([], layout=w.Layout(width="100%"))
        self.knob_text = w.Text(
            placeholder="e.g. lr=0.05, warmup_steps=50",
            description="set",
            continuous_update=False,
            layout=w.Layout(width="320px"),
        )
        self.knob_apply = w.Button(description="apply", layout=w.Layout(width="70px"))
        self.knob_status = w.HTML(value=NO_KNOBS)
        self.cmp_x = w.ToggleButtons(
            options=[("runs by step", "step"), ("runs by samples seen", "samples")],
            value="step",
            style={"button_width": "150px"},
        )
        self.cmp_clear = w.Button(
            description="clear old runs",
            tooltip="keep only the newest run on the comparison chart",
            layout=w.Layout(width="120px"),
        )
        self.cmp_x.add_class("hvdnb-cmp-x")
        self.cmp_clear.add_class("hvdnb-cmp-clear")
        self.knob_status.add_class("hvdnb-knob-status")
        self.log_y.observe(self._on_view_change, "value")
        self.smoothing.observe(self._on_view_change, "value")
        self.window.observe(self._on_view_change, "value")
        self.cmp_x.observe(self._on_view_change, "value")
        self.cmp_clear.on_click(self._on_clear_runs)
        self.knob_apply.on_click(self._on_text_apply)
        self.knob_text.observe(self._on_text_apply, "value")
        _kernel.route_comms(
            [
                self.log_y,
                self.smoothing,
                self.window,
                self.knob_text,
                self.knob_apply,
                self.cmp_x,
                self.cmp_clear,
            ],
            subshell,
        )

    # -------------------------------------------------------------- handlers (any thread)
    def _on_view_change(self, change: Any) -> None:
        self._changed()

    def _on_clear_runs(self, *_: Any) -> None:
        n = self.store.hide_runs(keep_last=1)
        self.set_note(
            f"{n} old run{'s' if n != 1 else ''} taken off the comparison chart "
            "(still in hvdnb.metrics())"
        )

    def _on_knob_change(self, change: Any) -> None:
        if self._syncing:  # the panel itself showing a value the ranks applied
            return
        name = change["owner"].description
        self.request({name: change["new"]})

    def _on_text_apply(self, *_: Any) -> None:
        text = self.knob_text.value.strip()
        if not text:
            return
        try:
            values = dict(parse(text))
        except KnobTextError as exc:
            self.set_note(f"refused: {exc}")
            return
        if "ranks" in values:  # an elastic cluster's size, not a knob
            self.scale(values.pop("ranks"))
            if not values:
                return
        self.request(values)

    def scale(self, n: Any) -> None:
        """``ranks=N``: take an elastic cluster to N ranks, at the running elastic loop's
        next commit (``Cluster.request_scale``), or before the next cell."""
        self.store.attach_current()
        c = self.store.cluster
        if c is None or getattr(c, "membership", None) is None:
            self.set_note(
                "refused: ranks=N changes an elastic cluster's size; start one with `%dist "
                "start -n N --min-np M` (a fixed-size cluster: `%dist restart -n N`)"
            )
            return
        if isinstance(n, float) and n.is_integer():
            n = int(n)
        try:
            said = c.request_scale(n)
        except Exception as exc:  # ClusterError: out of --min-np..--max-np, not a whole number
            self.set_note(f"refused: {exc}")
            return
        with self._lock:
            self._scaling = n
            self.set_note(said)

    def _scaled(self) -> None:
        """Once the cluster has the size a ``ranks=N`` asked for, the note says so, in
        place of "scaling to N ranks ..." (the request carried out: none pending)."""
        n = self._scaling
        c = self.store.cluster
        m = getattr(c, "membership", None)
        if n is None or m is None or m.wanted is not None or m.size != n:
            return
        self._scaling = None
        self.note = (
            f"scaled to {n} rank{'s' if n != 1 else ''} (generation {c.generation}); "
            "`%dist status` lists them"
        )

    def request(self, values: dict[str, Any]) -> tuple[bool, str]:
        """Ask for a knob change (validated by the store, scheduled by rank 0)."""
        self.store.attach_current()
        ok, msg = self.store.request_knobs(**values)
        self.set_note(msg)
        return ok, msg

    def set_note(self, text: str) -> None:
        """Show ``text`` in the knob status line at the next redraw."""
        with self._lock:
            self.note = text
            self._changed()

    # -------------------------------------------------------------- drawing (main thread)
    def status_html(self) -> str:
        """The knob status line: current values, the last request's fate, the note."""
        s = self.store
        st = s.knob_status()
        with self._lock:
            self._scaled()
            note = html.escape(self.note)
        if not s.knob_spec:
            return f"{NO_KNOBS} &middot; {note}" if note else NO_KNOBS
        cur = ", ".join(f"{k}={v['value']:g}" for k, v in s.knob_spec.items())
        text = f"knobs: {html.escape(cur)}"
        said, refused = describe_change(st)  # the same words as %dist knobs
        if refused:
            text += f" &middot; <span style='color:#c00'>{html.escape(said)}</span>"
            if st.get("error"):  # refused here: the note says the same
                return text
        elif said:
            text += f" &middot; {html.escape(said)}"
        if note and not st.get("id"):
            text += f" &middot; {note}"
        elif note.startswith("refused"):
            text += f" &middot; <span style='color:#c00'>{note}</span>"
        return text

    def sync(self) -> None:
        """Show the store's knobs: new sliders for a new set of names, else the values
        the ranks applied (sending nothing)."""
        spec = self.store.knob_spec
        names = tuple(spec)
        if names != self._knob_names:
            ws = [_slider(name, spec[name]) for name in names]
            for ctl in ws:
                ctl.observe(self._on_knob_change, "value")
            self.knob_widgets = dict(zip(names, ws))
            self._knob_names = names
            _kernel.route_comms(ws, self._subshell)
            self.knob_box.children = tuple(ws)
            return
        for name, ctl in self.knob_widgets.items():
            v = spec[name]["value"]
            if ctl.value == v or not isinstance(v, (int, float)):
                continue
            self._syncing = True
            try:
                if hasattr(ctl, "base"):  # a log slider: its bounds are exponents
                    e = math.log10(max(v, 1e-12))
                    ctl.min, ctl.max = min(ctl.min, math.floor(e)), max(ctl.max, math.ceil(e))
                else:
                    ctl.min, ctl.max = min(ctl.min, int(v)), max(ctl.max, int(v))
                ctl.value = v
            finally:
                self._syncing = False


#: the label at its own width (whole, never "warmup_s..."), the track gets the rest
_SLIDER_STYLE = {"description_width": "initial"}


def _SLIDER_LAYOUT() -> Any:  # a layout per widget (widgets cannot share one)
    import ipywidgets as w  # noqa: PLC0415  widgets: only when the panel is shown

    return w.Layout(width="100%", min_width="200px", max_width="560px")


def _slider(name: str, s: dict[str, Any]) -> Any:
    """A slider for one knob: linear for an int, log for a float (two decades either side)."""
    import ipywidgets as w  # noqa: PLC0415  widgets: only when the panel is shown

    v = s["value"]
    if s["kind"] == "int":
        ctl = w.IntSlider(
            value=int(v),
            min=int(s["min"]),
            max=int(min(s["max"], max(4 * v, 100))),
            description=name,
            continuous_update=False,
            layout=_SLIDER_LAYOUT(),
            style=_SLIDER_STYLE,
        )
    else:
        base = max(v, 1e-12)
        lo = max(math.log10(max(s["min"], 1e-12)), math.log10(base) - 2)
        hi = min(math.log10(s["max"]), math.log10(base) + 2)
        ctl = w.FloatLogSlider(
            value=v,
            base=10,
            min=lo,
            max=hi,
            step=0.05,
            description=name,
            continuous_update=False,
            readout_format=".3g",
            layout=_SLIDER_LAYOUT(),
            style=_SLIDER_STYLE,
        )
    ctl.add_class(f"hvdnb-knob-{name}")
    return ctl
