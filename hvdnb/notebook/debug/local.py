"""The notebook's own debugpy, started as ipykernel starts it, but with its error kept.

ipykernel's ``Debugger.start`` picks a free port (binding and unbinding a ZMQ socket), runs
``debugpy.listen`` on the kernel's shell thread and answers ``initialize`` with
``success: False`` and no reason when that fails. On a loaded machine the port can be taken
between the unbind and the debugpy adapter's bind (CI saw one such failure). This starts it
the same way, tries a fresh port when the first fails, and returns the error otherwise, so
the page's answer can say what went wrong.

A ``%%distributed`` cell whose ranks failed raises ``DistributedCellError`` in the notebook
(so Run All stops there). With "pause on exceptions" on, the notebook's own debugpy would
stop at that raise, inside hvdnb, and hold the cell until someone pressed Continue: the
rank that raised has already stopped at its own raise. ``spare_cell_errors`` gives the
notebook's exception breakpoints a condition that is false while such an error is raised.

Owns: the notebook's debugpy start, and the flag ``cell_error`` sets. Never: start a
rank's debugpy (``hvdnb.rank.visualdebug``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "cell_error",
    "handle_stopped_event",
    "raising",
    "spare_cell_errors",
    "start_notebook_debugpy",
]

log = logging.getLogger("hvdnb.debug")

#: how many fresh ports are tried before the debugger says it cannot start
ATTEMPTS = 3


def start_notebook_debugpy(debugger: Any) -> str | None:
    """Run ``debugpy.listen`` in the kernel as ipykernel would; None once it listens, else
    the last error ("RuntimeError: ..."). Leaves ``debugger.debugpy_initialized`` set on
    success, so ipykernel's own start skips straight to connecting."""
    if getattr(debugger, "debugpy_initialized", False):
        return None
    import zmq  # noqa: PLC0415  zmq, ipykernel: only inside a kernel
    from ipykernel.compiler import get_tmp_directory  # noqa: PLC0415

    Path(get_tmp_directory()).mkdir(mode=0o700, parents=True, exist_ok=True)  # dumped cells
    client = debugger.debugpy_client
    error = "debugpy.listen did not answer"
    for _ in range(ATTEMPTS):
        host, port = client.get_host_port()
        code = f"import debugpy;debugpy.listen(({host!r},{int(port)}))"
        debugger.session.send(
            debugger.shell_socket,
            "execute_request",
            {"code": code, "silent": True},
            None,
            debugger.shell_socket.getsockopt(zmq.ROUTING_ID),
        )
        _ident, msg = debugger.session.recv(debugger.shell_socket, mode=0)
        content = (msg or {}).get("content") or {}
        if content.get("status") == "ok":
            debugger.debugpy_initialized = True
            return None
        error = f"{content.get('ename', 'error')}: {content.get('evalue', '')}".strip()
        client.debugpy_port = -1  # the next try binds a fresh port
    return error


async def handle_stopped_event(debugger: Any) -> None:
    """ipykernel's handling of the notebook's own "stopped" event, kept alive.

    ipykernel's kernel loops over ``debugger.handle_stopped_event()`` forever: it awaits the
    next event of a stop where every thread stopped, asks debugpy for its threads, records
    them as stopped (what ``debugInfo`` lists, and what a reloaded page follows) and forwards
    the event to the page. debugpy's replies are matched to requests by order alone. One
    exception there (a reply that is not the threads reply) ends the loop, and the notebook
    never shows a stop again. Here the thread that stopped is recorded from the event itself,
    and what goes wrong is logged, not raised."""
    event = await debugger.stopped_queue.get()
    try:
        tid = (event.get("body") or {}).get("threadId")
        if isinstance(tid, int):
            debugger.stopped_threads.add(tid)
        request = {"seq": event["seq"] + 1, "type": "request", "command": "threads"}
        reply = await debugger._forward_message(request)
        for thread in ((reply or {}).get("body") or {}).get("threads") or []:
            if debugger._accept_stopped_thread(thread.get("name")):
                debugger.stopped_threads.add(thread["id"])
    except Exception as exc:
        log.warning("hvdnb: the notebook's stopped threads were not all read: %r", exc)
    finally:
        debugger.event_callback(event)


_RAISING = {"now": False}
#: the condition the notebook's exception breakpoints get, evaluated in the raising frame
CONDITION = "not __import__('hvdnb.notebook.debug.local', fromlist=['raising']).raising()"


def raising() -> bool:
    """True while a ``%%distributed`` cell raises its ranks' errors in the notebook."""
    return _RAISING["now"]


def cell_error(now: bool) -> None:
    """Said by the cell before it raises its ranks' errors (True), and after it (False)."""
    _RAISING["now"] = now


def spare_cell_errors() -> None:
    """The notebook's own exception breakpoints (just set by the page) skip the error a
    ``%%distributed`` cell raises for its ranks; they stop on every other exception."""
    pydevd = sys.modules.get("pydevd")  # the notebook's debugpy, in this process
    db = pydevd.get_global_debugger() if pydevd is not None else None
    if db is None:
        return
    for name in (
        "break_on_caught_exceptions",
        "break_on_uncaught_exceptions",
        "break_on_user_uncaught_exceptions",
    ):
        for bp in (getattr(db, name, None) or {}).values():
            if getattr(bp, "condition", "") is None:
                bp.condition = CONDITION
