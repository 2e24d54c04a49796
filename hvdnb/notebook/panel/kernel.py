"""How the panel's controls stay live while a blocking ``%%distributed`` cell runs.

The notebook's main thread is blocked inside ``hvdnb.notebook.cellout.cells.run_cell`` for
the whole cell, and the kernel handles the front end's widget messages on that thread: a
slider moved during training would wait for the cell to end (ipywidgets #3468). ipykernel 7 can run
shell messages on *subshells* (one thread each) and routes a comm's messages to the
subshell named by the comm's ``_reply_subshell_for`` (``ipykernel.kernelbase.
shell_channel_thread_main``). So the panel creates one private subshell and points its
control widgets' comms at it: their messages are handled on that thread at once, with
their own parent header, while the main thread trains. Redraws happen on the main
thread (the cell's wait hook, or an idle timer between cells), never on a bare thread
(ipykernel #1450).

Where this is unavailable (ipykernel < 7, no front end) the controls still work between
cells; a change made during a cell is applied when the cell ends.

Owns: the subshell, the comm routing, the idle timer. Never: handle execute requests,
touch the main shell's queue, or run user code off the main thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["IdleTimer", "control_subshell", "kernel", "route_comms"]

_SUBSHELL: dict[int, str] = {}


def kernel() -> Any:
    """The ipykernel kernel of this process, or None (plain IPython, scripts, tests)."""
    try:
        from IPython import get_ipython  # noqa: PLC0415  IPython: only inside a kernel

        ip = get_ipython()
        return getattr(ip, "kernel", None)
    except Exception:
        return None


def control_subshell(timeout: float = 5.0) -> str | None:
    """The id of hvdnb's private subshell (created once per kernel), or None."""
    k = kernel()
    if k is None or not getattr(k, "_supports_kernel_subshells", False):
        return None
    if id(k) in _SUBSHELL:
        return _SUBSHELL[id(k)]
    sct = getattr(k, "shell_channel_thread", None)
    if sct is None:
        return None
    try:
        mgr = sct.manager  # first access must be on the main thread: we are
        done = threading.Event()
        box: dict[str, Any] = {}

        def create() -> None:
            try:
                box["id"] = mgr._create_subshell()
            except Exception as exc:  # pragma: no cover - depends on ipykernel internals
                box["error"] = exc
            finally:
                done.set()

        sct.io_loop.add_callback(create)
        if not done.wait(timeout) or "id" not in box:
            return None
    except Exception:
        return None
    sid = str(box["id"])
    _SUBSHELL[id(k)] = sid
    return sid


def route_comms(widgets: list[Any], subshell_id: str | None) -> int:
    """Send the front end's messages for these widgets to ``subshell_id``; returns how many
    comms were routed."""
    if subshell_id is None:
        return 0
    n = 0
    for w in widgets:
        comm = getattr(w, "comm", None)
        if comm is None:
            continue

        def route(data: Any, default: Any, _sid: str = subshell_id) -> str:
            return _sid

        try:
            comm._reply_subshell_for = route
            n += 1
        except Exception:
            pass
    return n


class IdleTimer:
    """Call ``fn()`` every ``period`` seconds on the kernel's main event loop (so between
    cells: while a cell blocks the main thread it does not fire)."""

    def __init__(self, fn: Callable[[], None], period: float) -> None:
        self._pc: Any = None
        k = kernel()
        loop = getattr(k, "io_loop", None)
        if loop is None:
            return
        from tornado.ioloop import PeriodicCallback  # noqa: PLC0415  tornado: only inside a kernel

        def safe() -> None:
            try:
                fn()
            except Exception:
                pass

        def start() -> None:
            self._pc = PeriodicCallback(safe, period * 1000)
            self._pc.start()

        try:
            start()
        except Exception:
            self._pc = None

    @property
    def running(self) -> bool:
        return self._pc is not None

    def stop(self) -> None:
        if self._pc is not None:
            self._pc.stop()
            self._pc = None
