"""The runs chart's pin control: earlier runs of the run store, pinned beside the current ones.

A list of the run store's runs, newest first, each labelled with its id, date and knobs
(``runlog.pin_label``, the legend's words), and three buttons: "list runs" reads the
store into the list, "pin" pins the selected runs to the runs chart and "unpin all" takes
them off. Pinning is ``%dist compare ID ...``'s code path (``history.compare``), so the
chart, its legend and the error for an unknown run are the same either way.

The handlers run on the control subshell's thread while a cell trains, or on the main
thread between cells (``hvdnb.notebook.panel.kernel``). They read the store (the user's
own action, as ``%dist runs`` is) and leave the new list and a note for ``sync``, which
the panel calls on the main thread when it draws.

Owns: the pin widgets, their note. Never: read the run store on the panel's drawing
path (``sync`` only shows what a handler read), or draw.
"""

from __future__ import annotations

import html
import threading
from collections.abc import Callable
from typing import Any

from hvdnb.notebook.metrics.history import compare
from hvdnb.notebook.metrics.runlog import pin_label
from hvdnb.notebook.metrics.runstore import StoreUnavailable
from hvdnb.notebook.metrics.store import MetricsStore
from hvdnb.notebook.panel import kernel as _kernel

__all__ = ["Pins"]

#: at most this many of the newest runs in the list (``hvdnb.runs()`` has them all)
LISTED = 200

IDLE = "earlier runs: 'list runs' reads the run store, 'pin' puts the selected on the runs chart"


class Pins:
    """The pin control of one panel.

    Parameters
    ----------
    store : the store whose run log pins the runs
    subshell : the kernel subshell the widgets' comms are routed to (None: main shell)
    lock : the panel's drawing lock
    changed : called (any thread) when the panel should redraw at its next tick
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
        self._lock = lock
        self._changed = changed
        self._options: list[tuple[str, str]] | None = None  # read by a handler, unshown
        self.note = IDLE
        self.runs = w.SelectMultiple(options=[], rows=4, layout=w.Layout(width="100%"))
        self.list = w.Button(description="list runs", layout=w.Layout(width="90px"))
        self.pin = w.Button(
            description="pin",
            tooltip="pin the selected runs to the runs chart (%dist compare ID ...)",
            layout=w.Layout(width="90px"),
        )
        self.unpin = w.Button(description="unpin all", layout=w.Layout(width="90px"))
        self.status = w.HTML(value=html.escape(IDLE, quote=False))
        for ctl, cls in ((self.runs, "runs"), (self.list, "list"), (self.pin, "pin")):
            ctl.add_class(f"hvdnb-pins-{cls}")
        self.unpin.add_class("hvdnb-pins-unpin")
        self.status.add_class("hvdnb-pins-status")
        self.list.on_click(self._on_list)
        self.pin.on_click(self._on_pin)
        self.unpin.on_click(self._on_unpin)
        _kernel.route_comms([self.runs, self.list, self.pin, self.unpin], subshell)
        self.box = w.VBox(
            [
                self.status,
                w.HBox(
                    [self.runs, w.VBox([self.list, self.pin, self.unpin])],
                    layout=w.Layout(width="100%", max_width="760px"),
                ),
            ]
        )

    # -------------------------------------------------------------- handlers (any thread)
    def _on_list(self, *_: Any) -> None:
        try:
            recs = self.store.run_log.store().runs()
        except StoreUnavailable as exc:
            self._say(f"no run store: {exc}")
            return
        mine = f"{self.store.run_log.session}-"
        opts = [
            # this session's runs are on the chart already (run N): say so in the list
            (
                pin_label(r) + (" · this session" if str(r["id"]).startswith(mine) else ""),
                str(r["id"]),
            )
            for r in reversed(recs[-LISTED:])
        ]
        more = f" (the newest {LISTED}; hvdnb.runs() has all)" if len(recs) > LISTED else ""
        with self._lock:
            self._options = opts
        self._say(f"{len(recs)} run{'s' if len(recs) != 1 else ''} in the run store{more}")

    def _on_pin(self, *_: Any) -> None:
        ids = [str(i) for i in self.runs.value]
        if not ids:
            self._say("select runs in the list first (list runs fills it)")
            return
        try:
            self._say(compare(ids, self.store))
        except (KeyError, StoreUnavailable) as exc:
            self._say(f"refused: {exc.args[0] if exc.args else exc}")

    def _on_unpin(self, *_: Any) -> None:
        try:
            self._say(compare([], self.store))
        except StoreUnavailable as exc:
            self._say(f"no run store: {exc}")

    def _say(self, text: str) -> None:
        with self._lock:
            self.note = text
        self._changed()

    # -------------------------------------------------------------- drawing (main thread)
    def sync(self) -> None:
        """Show the list a handler read and the latest note (sends only what changed)."""
        with self._lock:
            opts, self._options = self._options, None
            note = html.escape(self.note, quote=False)
        if opts is not None and opts != list(self.runs.options):
            keep = tuple(v for v in self.runs.value if v in {o[1] for o in opts})
            with self.runs.hold_sync():
                self.runs.options = opts
                self.runs.value = keep
        if note != self.status.value:
            self.status.value = note
