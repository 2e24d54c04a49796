"""The live panel's widget tree, where it shows, and when it redraws.

How it stays live: ranks flush their points over the side channel into the notebook's
``MetricsStore`` (channel thread). The panel redraws on the notebook's main thread: from
``hvdnb.notebook.cellout.cells``' wait hook while a ``%%distributed`` cell runs (every
~50 ms, with the cell's parent header) and from an idle timer on the kernel's event loop
between cells. A redraw happens only when the store changed and at most every
``render_interval`` seconds, and sends one batched update per widget (``hold_sync``): a
handful of comm messages per tick, far below the Jupyter server's IOPub limit (1000/s).

Controls while a cell runs: the control widgets' comms are routed to a private ipykernel 7
subshell (``hvdnb.notebook.panel.kernel``), so a slider moved during training reaches rank 0 at
once; the handlers (``hvdnb.notebook.panel.controls``) only validate and send (thread-safe),
the main thread draws the result.

Where it shows: by default beside the notebook (JupyterLab's main area split, through
jupyterlab-sidecar's ``Sidecar``), so it stays in view while the user scrolls to the cell
that trains; ``%dist panel --inline`` (or ``HVDNB_PANEL=inline``) shows it in a cell's
output instead, for front ends without a side area (classic Notebook, VS Code). The
``%dist start`` cell keeps a small stand-in: a button that brings the side panel back
after its tab was closed, and a PNG of the charts, so a saved notebook on GitHub or nbviewer
shows the last picture. The PNG (a matplotlib draw: a median 446 ms for 2 ranks' 2,000
steps on a loaded 2-core box, ``bench/bench_png.py``, ``bench/results/png.json``) is never
drawn on a cell's path: when a cell ends the picture is only marked stale; the idle timer
draws it in a background thread once the store changed (at most every
``snapshot_interval`` s) and swaps it into the display handles from the kernel's event loop;
``%dist stop`` draws a stale one at once, so the last cell of a notebook run headless still
leaves it.

What is drawn: the header and tables (``tables``), the live SVG charts (``svg``) and the
saved PNG (``png``), both drawn from the chart models (``charts``).

Owns: the widget tree, the display handles, the sidecar and the redraw schedule. Never:
import torch, run on engines, block the channel thread or the cell, or send a widget
message per data point (everything drawn is one HTML widget: one message per redraw).
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
from hvdnb.notebook.panel.beacon import REPORT_WITHIN, make_beacon
from hvdnb.notebook.panel.controls import Controls
from hvdnb.notebook.panel.liveline import picture_line
from hvdnb.notebook.panel.pins import Pins
from hvdnb.notebook.panel.png import draw, picture, render_png
from hvdnb.notebook.panel.svg import charts_html
from hvdnb.notebook.panel.tables import header_html, tables_html

__all__ = ["Panel"]


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
        import ipywidgets as w  # noqa: PLC0415  widgets: only when the panel is shown

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
        self._handles: list[Any] = []
        self._png = b""
        self._png_version = -1  # the store version the saved picture shows
        self._png_ready: tuple[int, bytes] | None = None  # drawn in the background, unshown
        self._png_thread: threading.Thread | None = None
        self._png_lock = threading.Lock()  # one matplotlib draw at a time
        self._last_snapshot = 0.0
        #: least seconds between two background draws of the saved picture
        self.snapshot_interval = 2.0
        self.snapshots = 0
        self._seen_loss: dict[int, int] = {}
        self.latencies: list[float] = []
        self.measure_latency = False
        self._subshell = _kernel.control_subshell()
        # a page loaded while a cell trains asks for the widgets' state: answered at once
        _kernel.serve_page_loads(self._subshell)
        self.line: Any = None  # the LiveLine under the running cell (with a kernel)

        #: everything drawn (header, charts, hint, tables) is this one widget: one comm
        #: message per redraw
        self.view = w.HTML(value="<b>hvdnb</b>: waiting for data from the ranks")
        self.controls = Controls(self.store, self._subshell, self._lock, self._invalidate)
        #: the runs chart's pin control: earlier runs of the run store (%dist compare)
        self.pins = Pins(self.store, self._subshell, self._lock, self._invalidate)
        c = self.controls
        # the widgets by their old names (bench, tests and users read them off the panel)
        self.log_y, self.smoothing, self.cmp_x = c.log_y, c.smoothing, c.cmp_x
        self.window = c.window
        self.cmp_clear, self.knob_box, self.knob_text = c.cmp_clear, c.knob_box, c.knob_text
        self.knob_apply, self.knob_status = c.knob_apply, c.knob_status
        # the knobs first: tuning is what the panel is for, and a side area is narrow
        self.box = w.VBox(
            [
                c.knob_box,
                w.HBox([c.knob_text, c.knob_apply]),
                c.knob_status,
                self.view,
                w.HBox([c.log_y, c.smoothing, c.window], layout=w.Layout(flex_flow="row wrap")),
                w.HBox([c.cmp_x, c.cmp_clear]),
                self.pins.box,
            ]
        )
        self.box.add_class("hvdnb-panel")
        self.view.add_class("hvdnb-view")
        self._sidecar: Any = None
        self._want_side = False
        #: reports a view of the side area (``beacon``); None: anywidget is not installed
        self._beacon = make_beacon("side")
        if self._beacon is not None:
            _kernel.route_comms([self._beacon], self._subshell)
            self._beacon.listeners.append(self._check_side)  # the stand-in follows at once
        self._side_asked = 0.0  # monotonic time the side area was last opened
        #: training cells that ended and wait for their picture (``cell_ended``)
        self._cell_pics: list[dict[str, Any]] = []
        self._stub: _Stub | None = None
        self._idle = _kernel.IdleTimer(self._idle_tick, 0.5)
        self.render(force=True)

    # -------------------------------------------------------------- display
    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = dict(self.box._repr_mimebundle_(**kwargs) or {})
        if self._png:
            bundle["image/png"] = base64.b64encode(self._png).decode("ascii")
        bundle["text/plain"] = self.text()
        return bundle

    def text(self) -> str:
        """The header and hint as plain text (what a terminal or a saved notebook reads)."""
        head, _ = header_html(self.store)
        return html.unescape(re.sub(r"<[^>]+>", "", head)) + "\n" + self.store.hint()

    @property
    def png(self) -> bytes:
        """The last picture (``snapshot``), empty before the first."""
        return self._png

    def show(self, inline: bool = True) -> None:
        """Display the panel in the current cell's output (``inline``), or beside the
        notebook with a stand-in (button + picture) in the current cell's output."""
        from IPython.display import display  # noqa: PLC0415  IPython: only inside a kernel

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
        from sidecar import Sidecar  # noqa: PLC0415  sidecar is optional: only when the panel is shown beside the notebook

        old, self._sidecar = self._sidecar, None
        if old is not None:
            try:
                old.close()
            except Exception:
                pass
        import ipywidgets as w  # noqa: PLC0415  widgets: only when the panel is shown

        sc = Sidecar(title="hvdnb panel", anchor="split-right")
        # one output: the beacon (no room) over the panel, so only the side area's view of
        # the panel reports (the copy a page without a side area shows in the cell has none)
        beacon = [self._beacon] if self._beacon is not None else []
        sc.append_display_data(w.VBox([*beacon, self.box]))
        self._sidecar = sc
        self._side_asked = time.monotonic()
        if self._stub is not None:
            self._stub.waiting()

    def side_state(self) -> str:
        """Where the side panel is, as the page reported it: "shown" (a view of the side
        area rendered since it was opened), "waiting" (opened less than
        ``REPORT_WITHIN`` s ago, no report yet), "missing" (no report in time: this page
        has no side area, or no sidecar extension) or "closed" (never opened)."""
        if not self._side_asked:
            return "closed"
        b = self._beacon
        if b is not None and b.heard_since(self._side_asked):
            return "shown"
        if time.monotonic() - self._side_asked < REPORT_WITHIN:
            return "waiting"
        return "missing"

    def _check_side(self) -> None:
        """Follow the page's report in the ``%dist start`` cell's stand-in."""
        if self._stub is not None and self._side_asked:
            self._stub.follow(self.side_state())

    def want_side(self) -> None:
        """Open the panel beside the notebook at the next tick (any thread)."""
        self._want_side = True
        if _kernel.kernel() is not None and self._subshell is None:
            self.tick(False)  # no subshell: we are on the main thread already

    # -------------------------------------------------------------- each training cell's picture
    def cell_ended(self, handle: Any, text: str) -> None:
        """A training cell ended with ``text`` as its live line (``handle``): read its run's
        charts now (the models: milliseconds), draw them in a background thread, and put
        the picture under the line once drawn (``deliver_cell_pictures``), so the saved
        notebook shows each run where it trained."""
        try:
            pic = picture(
                self.store,
                log_y=self.log_y.value,
                smoothing=self.smoothing.value,
                window=self.window.value,
            )
        except Exception:
            return
        item: dict[str, Any] = {"handle": handle, "text": text, "png": None}

        def draw_it() -> None:
            try:
                with self._png_lock:
                    item["png"] = draw(pic)
            except Exception:
                item["png"] = b""

        item["thread"] = threading.Thread(target=draw_it, name="hvdnb-cell-picture", daemon=True)
        self._cell_pics.append(item)
        item["thread"].start()

    def deliver_cell_pictures(self, wait: float = 0.0) -> int:
        """Put each drawn cell picture under its cell's line (``update_display``; front ends
        and nbclient apply it to the earlier cell's output by its display id); with
        ``wait``, wait up to that many seconds for each draw. Returns how many were put."""
        put = 0
        for item in list(self._cell_pics):
            if wait:
                item["thread"].join(wait)
            png = item["png"]
            if png is None:
                continue
            self._cell_pics.remove(item)
            if png:
                try:
                    item["handle"].update(picture_line(item["text"], png))
                    put += 1
                except Exception:
                    pass
        return put

    def snapshot(self, if_stale: bool = False) -> None:
        """Draw the PNG kept in every displayed copy (what a saved notebook shows) now, on
        this thread; with ``if_stale``, only when the store changed since the last one, and
        otherwise the one drawn is put in again from here. Cell pictures still drawing are
        waited for and put in first."""
        if self._cell_pics:
            self.deliver_cell_pictures(wait=10.0)
        if not self._handles:
            return
        version = self.store.version
        if if_stale and version == self._png_version and self._png_ready is None:
            # drawn, but put in by the idle timer between cells, whose update a headless
            # run (nbclient reads the running cell's messages only) never saw: the saved
            # start cell kept its first words and no picture. Again, from this cell
            if self._png:
                self._show_png(version, self._png)
            return
        try:
            png = self._draw_png()
        except Exception:  # a missing picture must never break a command
            return
        self._png_ready = None
        self._show_png(version, png)

    def _draw_png(self) -> bytes:
        with self._png_lock:
            self.snapshots += 1
            return render_png(
                self.store,
                log_y=self.log_y.value,
                smoothing=self.smoothing.value,
                window=self.window.value,
                runs=True,  # the %dist start cell's picture: every run since the kernel began
            )

    def _show_png(self, version: int, png: bytes) -> None:
        self._png, self._png_version = png, version
        for h, obj in self._handles:
            try:
                h.update(obj)
            except Exception:
                pass

    def _idle_tick(self) -> None:
        """Between cells (the kernel's event loop): redraw, show a picture drawn in the
        background, and start the next background draw when the store changed."""
        self.tick(False)
        if self._cell_pics:
            self.deliver_cell_pictures()
        ready = self._png_ready
        if ready is not None:
            self._png_ready = None
            self._show_png(*ready)
        busy = self._png_thread is not None and self._png_thread.is_alive()
        now = time.monotonic()
        if (
            busy
            or not self._handles
            or self.store.version == self._png_version
            or now - self._last_snapshot < self.snapshot_interval
        ):
            return
        self._last_snapshot = now
        version = self.store.version

        def draw() -> None:
            try:
                self._png_ready = (version, self._draw_png())
            except Exception:
                pass

        self._png_thread = threading.Thread(target=draw, name="hvdnb-snapshot", daemon=True)
        self._png_thread.start()

    # -------------------------------------------------------------- controls (any thread)
    def request(self, values: dict[str, Any]) -> tuple[bool, str]:
        """Ask for a knob change (validated by the store, scheduled by rank 0)."""
        return self.controls.request(values)

    def _invalidate(self) -> None:
        self._drawn_version = -1  # redraw at the next tick
        self._png_version = -1  # a view control changed: the saved picture follows (idle)

    # -------------------------------------------------------------- drawing (main thread)
    def tick(self, final: bool = False) -> None:
        """Redraw if the store changed (at most every ``render_interval``); the cells'
        wait hook calls it every ~50 ms and once with ``final=True`` when a cell ends
        (then only if the store changed: a no-op cell costs the panel nothing)."""
        self.store.attach_current()
        if self._want_side:  # the stand-in's button, pressed on the control thread
            self._want_side = False
            self.open_side()
        self._check_side()
        if self._cell_pics:
            self.deliver_cell_pictures()
        now = time.monotonic()
        if final:  # the cell's end: draw what changed; the saved picture waits for idle
            self.render()
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
            self.controls.sync()
            self.pins.sync()
            view = self._view_html()
            if view != self.view.value:
                with self.view.hold_sync():
                    self.view.value = view
            status = self.controls.status_html()
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

    def _view_html(self) -> str:
        head, prog = header_html(self.store)
        if prog is not None:
            head += (
                f" <progress max='{prog[1]}' value='{min(prog[0], prog[1])}' "
                "style='width:160px;vertical-align:middle'></progress>"
            )
        charts = charts_html(
            self.store,
            log_y=self.log_y.value,
            alpha=self.smoothing.value,
            runs_x=self.cmp_x.value,
            window=self.window.value,
        )
        hint = html.escape(self.store.hint()) if self.store.ranks() else ""
        return (
            f"<div class='hvdnb-header'>{head}</div>"
            f"<div style='display:flex;flex-wrap:wrap;gap:6px'>{charts}</div>"
            f"<div class='hvdnb-hint'><b>{hint}</b></div>{tables_html(self.store)}"
        )

    def close(self) -> None:
        self._idle.stop()
        if self._sidecar is not None:
            self._sidecar.close()
        self.box.close()


#: the stand-in's line in each state of the side panel (``Panel.side_state``)
_STUB_LINES = {
    "waiting": "hvdnb: the live panel, here until the page shows it beside the notebook...",
    "shown": "hvdnb: the live panel is open beside the notebook.",
    "missing": (
        "hvdnb: this page has no side area for the live panel (Jupyter Notebook 7, VS Code, "
        "or no jupyterlab-sidecar on the server): it is here."
    ),
}


class _Stub:
    """What the ``%dist start`` cell shows when the panel is beside the notebook: a button
    that brings the panel back, a line saying where the panel is (as the page reported it),
    the panel itself where the page has no side area, and the panel's last picture for
    saved notebooks."""

    def __init__(self, panel: Panel) -> None:
        import ipywidgets as w  # noqa: PLC0415  widgets: only when the panel is shown

        self.panel = panel
        self.button = w.Button(
            description="show the panel",
            icon="columns",
            tooltip="open the live panel beside the notebook (again)",
            layout=w.Layout(width="180px"),
        )
        self.button.add_class("hvdnb-show-panel")
        self.button.on_click(self._on_click)
        self.state = "waiting"
        self.note = w.HTML(self._line(self.state))
        self.line = w.HBox([self.button, self.note])
        # the panel is in the cell at once, until the page reports its view beside the
        # notebook: a page with no side area (Notebook 7, no sidecar) never reports, and
        # would otherwise show nothing for ``REPORT_WITHIN`` seconds
        self.box = w.VBox([self.line, panel.box], _dom_classes=("hvdnb-stub-box",))
        _kernel.route_comms([self.button], panel._subshell)

    @staticmethod
    def _line(state: str) -> str:
        return f"<span class='hvdnb-stub hvdnb-stub-{state}'>{_STUB_LINES[state]}</span>"

    def waiting(self) -> None:
        """The side area was opened (again): wait for the page's report."""
        self.follow("waiting")

    def follow(self, state: str) -> None:
        """Show ``state``'s line, and the panel itself below it unless it is "shown"
        beside the notebook."""
        if state == self.state or state not in _STUB_LINES:
            return
        self.state = state
        self.note.value = self._line(state)
        here = state != "shown"
        self.box.children = (self.line, self.panel.box) if here else (self.line,)

    def _on_click(self, *_: Any) -> None:
        self.panel.want_side()  # opened on the main thread (tick), never here

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = dict(self.box._repr_mimebundle_(**kwargs) or {})
        text = self.panel.text()
        png = self.panel.png
        img = (
            f"<img src='data:image/png;base64,{base64.b64encode(png).decode('ascii')}'/>"
            if png
            else ""
        )
        bundle["text/html"] = (
            # where the live panel was is for the page to say (the stand-in's line); the
            # picture says what it showed: every run since the kernel started
            f"<div><b>hvdnb live panel</b> (its last picture: every run since the kernel "
            f"started)<pre>{html.escape(text)}</pre>"
            f"{img}</div>"
        )
        if png:
            bundle["image/png"] = base64.b64encode(png).decode("ascii")
        bundle["text/plain"] = text
        return bundle
