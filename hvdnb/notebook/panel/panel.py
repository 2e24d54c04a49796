"""The live panel: plots, numbers and knob controls for the running training, in the notebook.

How it stays live: ranks flush their points over the side channel into the notebook's
``MetricsStore`` (channel thread). The panel redraws on the notebook's main thread: from
``hvdnb.notebook.cells``' wait hook while a ``%%distributed`` cell runs (every ~50 ms, with the
cell's parent header) and from an idle timer on the kernel's event loop between cells. A
redraw happens only when the store changed and at most every ``render_interval`` seconds,
and sends one batched update per widget (``hold_sync``): a handful of comm messages per
tick, far below the Jupyter server's IOPub limit (1000/s).

Controls while a cell runs: the control widgets' comms are routed to a private ipykernel 7
subshell (``hvdnb.notebook.panel.kernel``), so a slider moved during training reaches rank 0 at
once; the handlers only validate and send (thread-safe), the main thread draws the result.

Where it shows: by default beside the notebook (JupyterLab's main area split, through
jupyterlab-sidecar's ``Sidecar``), so it stays in view while the user scrolls to the cell
that trains; ``%dist panel --inline`` (or ``HVDNB_PANEL=inline``) shows it in a cell's
output instead, for front ends without a side area (classic Notebook, VS Code). The
``%dist start`` cell keeps a small stand-in: a button that brings the side panel back
after its tab was closed, and a PNG of the plots (refreshed when each cell ends), so a
saved notebook on GitHub or nbviewer shows the last picture. Each ``%%distributed`` cell
that logs also gets one live line under itself (``hvdnb.notebook.panel.liveline``).

Runs: the panel overlays the last runs' mean loss (x: step or samples seen), each labelled
with its knob values and changes, the changes marked; "clear old runs" takes all but the
newest off the chart (their points stay in ``hvdnb.metrics()``).

Many ranks (more than ``MAX_LINES``): the loss chart draws the min/max band and median
over all ranks plus one median line per host, and a table gives each host's min/max
(loss, step, step time); per-rank tables show the first ranks only.

Owns: the widgets, their layout and the display handles. Never: import torch, run on
engines, block the channel thread, or send a widget message per data point.
"""

from __future__ import annotations

import base64
import html
import re
import threading
import time
from typing import Any

from hvdnb.notebook.metrics.store import MetricsStore, get_store
from hvdnb.notebook.panel import kernel as _kernel
from hvdnb.notebook.panel.png import MAX_LINES, fmt_bytes, render_png
from hvdnb.notebook.panel.svg import PALETTE, legend_html, line_chart, stacked_bars
from hvdnb.protocol.knobs import KnobTextError, parse

__all__ = ["Panel", "get_panel", "show_panel"]

_PANEL: Panel | None = None


class Panel:
    """The live panel of one notebook kernel.

    Parameters
    ----------
    store : the store to draw (default: the notebook's store)
    render_interval : minimum seconds between two redraws

    While a cell runs, a redraw waits until every rank heard from in the last 5 s has
    sent a message since the previous redraw (ranks flush within milliseconds of each
    other), or ``settle`` seconds (0.3) after the change was first seen: one redraw per
    round of messages, not one per rank.
    """

    def __init__(self, store: MetricsStore | None = None, render_interval: float = 0.2) -> None:
        import ipywidgets as w

        self.store = store or get_store()
        self.render_interval = render_interval
        self.renders = 0
        self.render_seconds = 0.0
        self._drawn_version = -1
        self._last_render = 0.0
        self._last_render_wall = 0.0  # time.time() of the last redraw
        self._changed_at = 0.0  # monotonic time the store was first seen changed, undrawn
        #: seconds a redraw waits for the other ranks' messages of the same round
        self.settle = 0.3
        self._last_cost = 0.0
        self._lock = threading.RLock()
        self._note = ""  # set by control handlers (any thread), drawn by tick()
        self._handles: list[Any] = []
        self._png = b""
        self._knob_names: tuple[str, ...] = ()
        self._knob_widgets: dict[str, Any] = {}
        self._syncing = False
        self._seen_loss: dict[int, int] = {}
        self.latencies: list[float] = []
        self.measure_latency = False
        self._subshell = _kernel.control_subshell()
        self.line: Any = None  # the LiveLine under the running cell (with a kernel)

        #: everything drawn (header, charts, hint, tables) is this one widget: one comm
        #: message per redraw
        self.view = w.HTML(value="<b>hvdnb</b>: waiting for data from the ranks")
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
        self.knob_box = w.HBox([])
        self.knob_text = w.Text(
            placeholder="e.g. lr=0.05, warmup_steps=50",
            description="set",
            continuous_update=False,
            layout=w.Layout(width="320px"),
        )
        self.knob_apply = w.Button(description="apply", layout=w.Layout(width="70px"))
        self.knob_status = w.HTML(
            value="knobs: none yet (hvdnb.knobs(...) in a %%distributed cell)"
        )
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
        self.log_y.observe(self._on_view_change, "value")
        self.smoothing.observe(self._on_view_change, "value")
        self.cmp_x.observe(self._on_view_change, "value")
        self.cmp_clear.on_click(self._on_clear_runs)
        self.knob_apply.on_click(self._on_text_apply)
        self.knob_text.observe(self._on_text_apply, "value")
        # the knobs first: tuning is what the panel is for, and a side area is narrow
        self.box = w.VBox(
            [
                self.knob_box,
                w.HBox([self.knob_text, self.knob_apply]),
                self.knob_status,
                self.view,
                w.HBox([self.log_y, self.smoothing]),
                w.HBox([self.cmp_x, self.cmp_clear]),
            ]
        )
        self.box.add_class("hvdnb-panel")
        self.view.add_class("hvdnb-view")
        self.knob_status.add_class("hvdnb-knob-status")
        self._sidecar: Any = None
        self._want_side = False
        self._stub: _Stub | None = None
        _kernel.route_comms(
            [
                self.log_y,
                self.smoothing,
                self.knob_text,
                self.knob_apply,
                self.cmp_x,
                self.cmp_clear,
            ],
            self._subshell,
        )
        self._idle = _kernel.IdleTimer(lambda: self.tick(False), 0.5)
        self.render(force=True)

    # -------------------------------------------------------------- display
    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = dict(self.box._repr_mimebundle_(**kwargs) or {})
        if self._png:
            bundle["image/png"] = base64.b64encode(self._png).decode("ascii")
        bundle["text/plain"] = self._text()
        return bundle

    def _text(self) -> str:
        head, _ = self._header()
        return html.unescape(re.sub(r"<[^>]+>", "", head)) + "\n" + self.store.hint()

    def show(self, inline: bool = True) -> None:
        """Display the panel in the current cell's output (``inline``), or beside the
        notebook with a stand-in (button + picture) in the current cell's output."""
        from IPython.display import display

        obj: Any = self
        if not inline:
            self.open_side()
            if self._stub is None:
                self._stub = _Stub(self)
            obj = self._stub
        handle = display(obj, display_id=True)
        if handle is not None:
            self._handles.append((handle, obj))

    def open_side(self) -> None:
        """Open the panel beside the notebook (again: a closed tab comes back)."""
        from sidecar import Sidecar

        old, self._sidecar = self._sidecar, None
        if old is not None:
            try:
                old.close()
            except Exception:
                pass
        sc = Sidecar(title="hvdnb panel", anchor="split-right")
        sc.append_display_data(self.box)
        self._sidecar = sc

    def _on_clear_runs(self, *_: Any) -> None:
        n = self.store.hide_runs(keep_last=1)
        self._set_note(
            f"{n} old run{'s' if n != 1 else ''} taken off the comparison chart "
            "(still in hvdnb.metrics())"
        )

    def snapshot(self) -> None:
        """Refresh the PNG kept in every displayed copy (what a saved notebook shows)."""
        if not self._handles:
            return
        try:
            self._png = render_png(
                self.store, log_y=self.log_y.value, smoothing=self.smoothing.value
            )
        except Exception:  # a missing picture must not break the cell's end
            return
        for h, obj in self._handles:
            try:
                h.update(obj)
            except Exception:
                pass

    # -------------------------------------------------------------- controls (any thread)
    def _on_view_change(self, change: Any) -> None:
        self._drawn_version = -1  # redraw at the next tick

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
            values = parse(text)
        except KnobTextError as exc:
            self._set_note(f"refused: {exc}")
            return
        self.request(dict(values))

    def request(self, values: dict[str, Any]) -> tuple[bool, str]:
        """Ask for a knob change (validated here, scheduled by rank 0)."""
        self.store.attach_current()
        ok, msg = self.store.request_knobs(**values)
        self._set_note(msg)
        return ok, msg

    def _set_note(self, text: str) -> None:
        with self._lock:
            self._note = text
            self._drawn_version = -1

    # -------------------------------------------------------------- drawing (main thread)
    def tick(self, final: bool = False) -> None:
        """Redraw if the store changed (at most every ``render_interval``); the cells'
        wait hook calls it every ~50 ms and once with ``final=True`` when a cell ends."""
        self.store.attach_current()
        if self._want_side:  # the stand-in's button, pressed on the control thread
            self._want_side = False
            self.open_side()
        now = time.monotonic()
        if final:
            self.render(force=True)
            self.snapshot()
            return
        # a redraw may take most of this thread at 1,000 ranks: keep it under ~25 % of it
        if now - self._last_render < max(self.render_interval, 3 * self._last_cost):
            return
        if self.store.version == self._drawn_version:
            self._changed_at = 0.0
            return
        if not self._changed_at:
            self._changed_at = now
        # ranks in step flush within milliseconds of each other: one redraw for the round,
        # not one per rank's message (each redraw takes the notebook's CPU, which on a
        # small machine is the ranks' CPU); a rank that lags holds it back ``settle`` s
        if now - self._changed_at < self.settle and not self._round_complete():
            return
        self.render()

    def _round_complete(self) -> bool:
        """Every rank heard from lately has sent a message since the last redraw."""
        drawn = self._last_render_wall
        recent = time.time() - 5.0
        seen = [i.get("seen") or 0.0 for i in list(self.store.rank_info.values())]
        return all(t > drawn for t in seen if t > recent)

    def render(self, force: bool = False) -> bool:
        """Draw now if anything changed; returns whether widgets were updated."""
        with self._lock:
            version = self.store.version
            if version == self._drawn_version and not force:
                return False
            t0 = time.perf_counter()
            self._drawn_version = version
            self._sync_knob_widgets()
            view = self._view_html()
            if view != self.view.value:
                with self.view.hold_sync():
                    self.view.value = view
            status = self._knob_status()
            if status != self.knob_status.value:
                self.knob_status.value = status
            self._last_render = time.monotonic()
            self._last_render_wall = time.time()
            self._changed_at = 0.0
            self.renders += 1
            self._last_cost = time.perf_counter() - t0
            self.render_seconds += self._last_cost
            if self.measure_latency:
                self._record_latency()
            return True

    def _record_latency(self) -> None:
        now = time.time()
        for r in self.store.ranks():
            n = self.store.count("loss", r)
            seen = self._seen_loss.get(r, 0)
            if n > seen:
                _, _, times = self.store.series("loss", r, last=n - seen)
                self.latencies.extend(now - t for t in times)
            self._seen_loss[r] = n

    def _header(self) -> tuple[str, tuple[int, int] | None]:
        s = self.store
        ranks = s.ranks()
        if not ranks:
            return (
                "<b>hvdnb</b>: waiting for data from the ranks (hvdnb.log(step, loss) in the loop)",
                None,
            )
        step, total = s.progress()
        backends = sorted({_bk(i.get("backend")) for i in s.rank_info.values() if i.get("backend")})
        rate = s.throughput()
        seen = max((i.get("seen") or 0) for i in s.rank_info.values()) if s.rank_info else 0
        age = time.time() - seen if seen else None
        running = any(not i.get("idle", True) for i in s.rank_info.values())
        parts = [
            f"<b>hvdnb</b> {len(ranks)} rank{'s' if len(ranks) > 1 else ''}",
            "/".join(backends) or "backend n/a",
            f"step {step}" + (f" of {total}" if total else ""),
            f"{rate:,.0f} samples/s" if rate is not None else "samples/s n/a",
            "training" if running else "idle",
        ]
        if age is not None:
            parts.append(f"updated {age:.1f} s ago")
        if s.lost_messages or s.lost_rows:
            parts.append(
                f"<span style='color:#c00'>lost: {s.lost_messages} messages, "
                f"{s.lost_rows} points</span>"
            )
        return " &middot; ".join(parts), ((step, total) if total else None)

    def _view_html(self) -> str:
        head, prog = self._header()
        if prog is not None:
            head += (
                f" <progress max='{prog[1]}' value='{min(prog[0], prog[1])}' "
                "style='width:160px;vertical-align:middle'></progress>"
            )
        charts = charts_html(
            self.store, log_y=self.log_y.value, alpha=self.smoothing.value, runs_x=self.cmp_x.value
        )
        hint = html.escape(self.store.hint()) if self.store.ranks() else ""
        return (
            f"<div class='hvdnb-header'>{head}</div>"
            f"<div style='display:flex;flex-wrap:wrap;gap:6px'>{charts}</div>"
            f"<div class='hvdnb-hint'><b>{hint}</b></div>{self._tables()}"
        )

    def _tables(self) -> str:
        s = self.store
        rows = s.comm_summary()
        out = [self._host_table()]
        if rows:
            by_rank = sorted({r["rank"] for r in rows})
            shown = [r for r in rows if r["rank"] in by_rank[:8]]
            out.append(
                "<b>allreduce</b> (median of the last 20; <i>collective</i>: the "
                "operation's own time, from the last rank's arrival, <i>exposed</i>: what the step waited for it, "
                "<i>bus bw</i>: size x 2(n-1)/n / collective)"
                "<table class='hvdnb-comm'><tr><th>rank</th><th>bucket</th><th>size</th>"
                "<th>collective</th><th>exposed</th><th>bus bw</th>"
                "<th>backend</th></tr>"
            )
            for r in shown[:48]:
                t = f"{1e3 * r['time']:.3f} ms" if r["time"] is not None else "n/a"
                ex = f"{1e3 * r['exposed']:.3f} ms" if r.get("exposed") is not None else "n/a"
                bw = f"{r['bus_bandwidth'] / 1e9:.2f} GB/s" if r["bus_bandwidth"] else "n/a"
                out.append(
                    f"<tr><td>{r['rank']}</td><td>{html.escape(r['bucket'])}</td>"
                    f"<td>{fmt_bytes(r['bytes'])}</td><td>{t}</td><td>{ex}</td>"
                    f"<td>{bw}</td><td>{_bk(r['backend'])}</td></tr>"
                )
            out.append("</table>")
            if len(by_rank) > 8:
                out.append(f"(first 8 of {len(by_rank)} ranks)")
        mem = s.memory()
        if mem:
            gpu = any(m.get("gpu_allocated") is not None for m in mem.values())
            cols = ["gpu_allocated", "gpu_reserved", "gpu_nvml_used", "rss"] if gpu else ["rss"]
            out.append(
                "<b>memory</b><table><tr><th>rank</th>"
                + "".join(f"<th>{c}</th>" for c in cols)
                + "</tr>"
            )
            for r in sorted(mem)[:MAX_LINES]:
                out.append(
                    f"<tr><td>{r}</td>"
                    + "".join(f"<td>{fmt_bytes(mem[r].get(c))}</td>" for c in cols)
                    + "</tr>"
                )
            out.append("</table>")
        return "".join(out)

    def _host_table(self) -> str:
        """One row per host (when ranks span hosts): ranks, steps, loss and step-time bands."""
        hs = self.store.host_summary()
        if len(hs) < 2:
            return ""
        from hvdnb.notebook.output import format_ranks

        def num(v: Any, fmt: str = ".4g") -> str:
            return "n/a" if v is None else format(v, fmt)

        out = [
            "<b>hosts</b><table class='hvdnb-hosts'><tr><th>host</th><th>ranks</th>"
            "<th>step min..max</th><th>loss min / median / max</th>"
            "<th>step time min..max</th></tr>"
        ]
        for h in hs[:64]:
            st = (
                f"{1e3 * h['step_time_min']:.1f}..{1e3 * h['step_time_max']:.1f} ms"
                if h["step_time_min"] is not None
                else "n/a"
            )
            out.append(
                f"<tr><td>{html.escape(h['host'])}</td><td>{format_ranks(h['ranks'])}</td>"
                f"<td>{num(h['step_min'], 'd')}..{num(h['step_max'], 'd')}</td>"
                f"<td>{num(h['loss_min'])} / {num(h['loss_median'])} / {num(h['loss_max'])}</td>"
                f"<td>{st}</td></tr>"
            )
        out.append("</table>")
        if len(hs) > 64:
            out.append(f"(first 64 of {len(hs)} hosts)")
        return "".join(out)

    def _knob_status(self) -> str:
        s = self.store
        st = s.knob_status()
        note = html.escape(self._note)
        if not s.knob_spec:
            return f"knobs: none yet (hvdnb.knobs(...) in a %%distributed cell) {note}"
        cur = ", ".join(f"{k}={v['value']:g}" for k, v in s.knob_spec.items())
        text = f"knobs: {html.escape(cur)}"
        if st.get("error"):
            return text + f" &middot; <span style='color:#c00'>{html.escape(st['error'])}</span>"
        if st.get("id"):
            plan, applied = st.get("plan"), st.get("applied") or {}
            if plan is None:
                text += " &middot; waiting for rank 0"
            elif plan.get("error"):
                text += f" &middot; <span style='color:#c00'>rank 0 refused: {html.escape(plan['error'])}</span>"
            else:
                at = plan.get("apply_at")
                text += f" &middot; rank 0 planned step {at if at is not None else 'now (idle)'}"
                if applied:
                    steps = sorted({a.get("step") for a in applied.values()})
                    late = sorted(r for r, a in applied.items() if a.get("late"))
                    text += (
                        f"; applied on ranks {','.join(map(str, sorted(applied)))} at step "
                        f"{','.join(map(str, steps))}"
                    )
                    if late:
                        text += f" (late on ranks {','.join(map(str, late))})"
        if note and not st.get("id"):
            text += f" &middot; {note}"
        elif note.startswith("refused"):
            text += f" &middot; <span style='color:#c00'>{note}</span>"
        return text

    def _sync_knob_widgets(self) -> None:
        import ipywidgets as w

        spec = self.store.knob_spec
        names = tuple(spec)
        if names != self._knob_names:
            ws = []
            for name in names:
                s = spec[name]
                v = s["value"]
                if s["kind"] == "int":
                    hi = int(min(s["max"], max(4 * v, 100)))
                    ctl = w.IntSlider(
                        value=int(v),
                        min=int(s["min"]),
                        max=hi,
                        description=name,
                        continuous_update=False,
                    )
                else:
                    import math

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
                    )
                ctl.add_class(f"hvdnb-knob-{name}")
                ctl.observe(self._on_knob_change, "value")
                ws.append(ctl)
            self._knob_widgets = dict(zip(names, ws))
            self._knob_names = names
            _kernel.route_comms(ws, self._subshell)
            self.knob_box.children = tuple(ws)
            return
        # same knobs, new values (applied, or a new knob set): show them, send nothing
        for name, ctl in self._knob_widgets.items():
            v = spec[name]["value"]
            if ctl.value == v or not isinstance(v, (int, float)):
                continue
            self._syncing = True
            try:
                if hasattr(ctl, "base"):  # a log slider: its bounds are exponents
                    import math

                    e = math.log10(max(v, 1e-12))
                    ctl.min, ctl.max = min(ctl.min, math.floor(e)), max(ctl.max, math.ceil(e))
                else:
                    ctl.min, ctl.max = min(ctl.min, int(v)), max(ctl.max, int(v))
                ctl.value = v
            finally:
                self._syncing = False

    def close(self) -> None:
        self._idle.stop()
        if self._sidecar is not None:
            self._sidecar.close()
        self.box.close()


class _Stub:
    """What the ``%dist start`` cell shows when the panel is beside the notebook: a button
    that brings the panel back, and the panel's last picture for saved notebooks."""

    def __init__(self, panel: Panel) -> None:
        import ipywidgets as w

        self.panel = panel
        self.button = w.Button(
            description="show the panel",
            icon="columns",
            tooltip="open the live panel beside the notebook (again)",
            layout=w.Layout(width="180px"),
        )
        self.button.add_class("hvdnb-show-panel")
        self.button.on_click(self._on_click)
        note = w.HTML(
            "<span class='hvdnb-stub'>hvdnb: the live panel is open beside the "
            "notebook. Not there? <code>%dist panel --inline</code> shows it "
            "here.</span>"
        )
        self.box = w.HBox([self.button, note])
        _kernel.route_comms([self.button], panel._subshell)

    def _on_click(self, *_: Any) -> None:
        self.panel._want_side = True  # opened on the main thread (tick), never here
        if _kernel.kernel() is not None and self.panel._subshell is None:
            self.panel.tick(False)  # no subshell: we are on the main thread already

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = dict(self.box._repr_mimebundle_(**kwargs) or {})
        text = self.panel._text()
        png = self.panel._png
        img = (
            f"<img src='data:image/png;base64,{base64.b64encode(png).decode('ascii')}'/>"
            if png
            else ""
        )
        bundle["text/html"] = (
            f"<div><b>hvdnb live panel</b> (last picture; the live panel "
            f"opens beside the notebook)<pre>{html.escape(text)}</pre>"
            f"{img}</div>"
        )
        if png:
            bundle["image/png"] = base64.b64encode(png).decode("ascii")
        bundle["text/plain"] = text
        return bundle


#: points per line in the live charts (older points are thinned, not dropped from the store)
LIVE_POINTS = 300


def _ema(vals: list[float], alpha: float) -> list[float]:
    if alpha <= 0:
        return vals
    out, acc = [], None
    for v in vals:
        if v == v:
            acc = v if acc is None else alpha * acc + (1 - alpha) * v
        out.append(acc if acc is not None else v)
    return out


def runs_html(store: MetricsStore, x: str = "step", log_y: bool = False) -> str:
    """The comparison chart: the last runs' mean loss over ranks, overlaid, with a legend
    of their knob values and the knob changes marked in each run's colour."""
    curves = store.run_curves(x=x, points=LIVE_POINTS)
    lines, marks, labels = [], [], []
    missing = []
    for i, c in enumerate(curves):
        if c["xs"] is None:
            missing.append(c["id"])
            continue
        color = PALETTE[len(lines) % len(PALETTE)]
        lines.append((c["label"], c["xs"], c["ys"]))
        labels.append(c["label"])
        marks.extend((mx, lab, color) for mx, lab in c["marks"])
    what = "samples seen (all ranks)" if x == "samples" else "step"
    empty = (
        "no runs yet: a %%distributed cell that calls hvdnb.log is a run"
        if not curves
        else "n/a: these runs logged no samples= (hvdnb.log(step, loss, samples=n))"
    )
    svg = line_chart(
        f"runs: mean loss vs {what}" + (" (log)" if log_y else ""),
        lines,
        marks=marks[-12:],
        log_y=log_y,
        empty=empty,
        legend=False,
    )
    note = (
        f"<div style='color:#888;font:11px sans-serif'>runs {', '.join(map(str, missing))}: "
        "n/a (no samples= logged)</div>"
        if missing and lines
        else ""
    )
    return f"<div class='hvdnb-runs'>{svg}{legend_html(labels)}{note}</div>"


def charts_html(
    store: MetricsStore, *, log_y: bool = False, alpha: float = 0.0, runs_x: str | None = "step"
) -> str:
    """The live charts as inline SVG: loss of the current run, allreduce per step, step-time
    breakdown and (``runs_x`` not None) the runs compared."""
    ranks = store.ranks()
    lines = []
    for r in ranks:
        xs, ys, stride = store.thinned("loss", r, LIVE_POINTS)
        if xs:
            lines.append((f"rank {r}", xs, _ema(ys, alpha**stride if alpha else 0.0)))
    band = None
    if len(lines) > MAX_LINES:
        grid, stack = _stack(lines)
        band = _band_of(grid, stack)
        hosts = store.hosts()
        lines_out = []
        if 1 < len(hosts) <= MAX_LINES:  # one median line per host over the band
            row_of = {int(lab.split()[1]): i for i, (lab, _, _) in enumerate(lines)}
            for host, rs in hosts.items():
                rows = [row_of[r] for r in rs if r in row_of]
                if rows:
                    lines_out.append(
                        (f"{host} ({len(rows)})", band[0], _band_of(grid, stack[rows])[3])
                    )
        lines = lines_out
    marks = [(float(st), lab) for st, lab in list(store.marks)[-8:]]
    out = [
        line_chart(
            "loss" + (" (log)" if log_y else ""),
            lines,
            band=band,
            marks=marks,
            log_y=log_y,
            empty="no loss yet: hvdnb.log(step, loss)",
        )
    ]
    comm = []
    shown = ranks if len(ranks) <= MAX_LINES else ranks[:: max(1, len(ranks) // MAX_LINES)]
    total: dict[int, float] = {}
    for per_bucket in store.collective_times(last_steps=LIVE_POINTS).values():
        for st, v in per_bucket.items():
            total[st] = total.get(st, 0.0) + v
    if total:
        st = sorted(total)
        comm.append(
            ("collective (all buckets)", [float(x) for x in st], [1e3 * total[k] for k in st])
        )
    for r in shown[: max(1, MAX_LINES - 1)]:
        per = store.per_step("comm/", r, last_steps=LIVE_POINTS, suffix="/exposed")
        if per:
            st = sorted(per)
            comm.append((f"rank {r} exposed", [float(x) for x in st], [1e3 * per[k] for k in st]))
    backends = sorted({_bk(i.get("backend")) for i in store.rank_info.values() if i.get("backend")})
    out.append(
        line_chart(
            f"allreduce ms per step ({'/'.join(backends) or 'backend n/a'})",
            comm,
            empty="no allreduce timings (hvdnb.torch reports them)",
            clip_spikes=True,
        )
    )
    b = store.breakdown()
    rows = [
        (f"rank {r}", [1e3 * b[r]["data"], 1e3 * b[r]["compute"], 1e3 * b[r]["comm"]])
        for r in sorted(b)
    ]
    hosts = store.hosts()
    if len(rows) > MAX_LINES and len(hosts) > 1:  # one bar per host: the median of its ranks
        import statistics

        rows = []
        for host, rs in list(hosts.items())[:64]:
            mine = [b[r] for r in rs if r in b]
            if mine:
                rows.append(
                    (
                        f"{host} ({len(mine)})",
                        [
                            1e3 * statistics.median(m[k] for m in mine)
                            for k in ("data", "compute", "comm")
                        ],
                    )
                )
    out.append(
        stacked_bars(
            "step time (median of last 50 steps; comm = exposed)",
            rows,
            [("data", "#f2a541"), ("compute", PALETTE[0]), ("comm", "#e45756")],
            empty="no step times yet",
        )
    )
    if runs_x is not None:
        out.append(runs_html(store, runs_x, log_y))
    return "".join(out)


def _stack(lines: list[tuple[str, list[float], list[float]]]) -> tuple[Any, Any]:
    """Every line resampled on one grid of ``LIVE_POINTS`` steps (NaN outside its range)."""
    import numpy as np

    lo = min(xs[0] for _, xs, _ in lines)
    hi = max(xs[-1] for _, xs, _ in lines)
    grid = np.linspace(lo, hi, LIVE_POINTS) if hi > lo else np.array([lo])
    stack = np.vstack([np.interp(grid, xs, ys, left=np.nan, right=np.nan) for _, xs, ys in lines])
    return grid, stack


def _band_of(grid: Any, stack: Any) -> tuple[list[float], list[float], list[float], list[float]]:
    import warnings

    import numpy as np

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mn, mx, med = np.nanmin(stack, 0), np.nanmax(stack, 0), np.nanmedian(stack, 0)
    return grid.tolist(), mn.tolist(), mx.tolist(), med.tolist()


def _band(
    lines: list[tuple[str, list[float], list[float]]],
) -> tuple[list[float], list[float], list[float], list[float]]:
    """(grid, min, max, median) over ``lines``."""
    return _band_of(*_stack(lines))


def _bk(b: Any) -> str:
    return {"nccl": "NCCL", "gloo": "Gloo", "mpi": "MPI"}.get(str(b).lower(), str(b or "n/a"))


def get_panel(create: bool = True) -> Panel | None:
    """The notebook's panel (created on first use, registered as a cell wait hook)."""
    global _PANEL
    if _PANEL is None and create:
        from hvdnb.notebook import cells
        from hvdnb.notebook.panel.liveline import LiveLine

        _PANEL = Panel()
        cells.add_wait_hook(_PANEL.tick)
        if _kernel.kernel() is not None:  # a terminal would print every update
            _PANEL.line = LiveLine(_PANEL.store)
            cells.add_wait_hook(_PANEL.line)
    return _PANEL


def show_panel(
    cluster: Any = None, *, inline: bool | None = None, only_with_frontend: bool = False
) -> Panel | None:
    """Attach the store to ``cluster`` and display the panel.

    Parameters
    ----------
    cluster : the cluster to watch (default: ``hvdnb.current()``)
    inline : True: in this cell's output; False: beside the notebook (JupyterLab); None:
        as configured (``HVDNB_PANEL``: side, inline or off; default side)
    only_with_frontend : do nothing visible outside a Jupyter kernel (plain IPython, tests)
    """
    from hvdnb.config import get_config
    from hvdnb.notebook.metrics.store import attach

    attach(cluster)
    if only_with_frontend and _kernel.kernel() is None:
        return None
    mode = get_config().panel.strip().lower()
    if mode not in ("side", "inline", "off"):
        raise ValueError(f"HVDNB_PANEL={mode!r}: use side, inline or off")
    if inline is None and mode == "off":
        return None
    p = get_panel()
    assert p is not None
    side = not inline if inline is not None else mode == "side"
    if side:
        try:
            import sidecar  # noqa: F401
        except ImportError:
            print(
                "hvdnb: jupyterlab-sidecar is not installed (pip install sidecar); "
                "showing the panel here"
            )
            side = False
    p.show(inline=not side)
    return p
