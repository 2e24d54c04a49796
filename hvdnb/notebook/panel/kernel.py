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

__all__ = ["IdleTimer", "control_subshell", "kernel", "route_comms", "serve_page_loads"]

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


#: the shell messages a page sends when it loads (or reloads) that hvdnb answers on its
#: subshell while a cell runs: its kernel info, and ipywidgets' state request (the
#: ``jupyter.widget.control`` comm, opened by each page that loads, and that comm's
#: ``request_states``). Queued behind a training cell on the main thread, a reloaded page
#: drew no widget until the cell ended.
PAGE_LOAD_TYPES = frozenset({"kernel_info_request", "comm_info_request"})
WIDGET_CONTROL_TARGET = "jupyter.widget.control"
_SERVING: set[int] = set()


def serve_page_loads(subshell_id: str | None) -> bool:
    """Answer a loading page's kernel info and widget-state requests on ``subshell_id``
    (ipykernel 7), so that a page reloaded while a cell trains draws the kernel's widgets
    (the panel, the cell's live view) at once. Every other message goes the way ipykernel
    sends it. Returns whether the routing is in place."""
    k = kernel()
    if subshell_id is None or k is None or id(k) in _SERVING:
        return id(k) in _SERVING if k is not None else False
    sct = getattr(k, "shell_channel_thread", None)
    stream = getattr(k, "shell_stream", None)
    if sct is None or stream is None:
        return False
    ipykernel_route = k.shell_channel_thread_main  # ipykernel's router, bound
    routed: set[str] = set()  # control comms opened on the subshell

    def ours(msg: Any) -> bool:
        _, rest = k.session.feed_identities(msg, copy=False)
        head = k.session.deserialize(rest, content=False, copy=False)
        header = head["header"]
        if header.get("subshell_id"):
            return False
        kind = header["msg_type"]
        if kind in PAGE_LOAD_TYPES:
            return True
        if kind not in ("comm_open", "comm_msg", "comm_close"):
            return False
        content = k.session.unpack(head["content"])
        comm_id = content.get("comm_id")
        if kind == "comm_open" and content.get("target_name") == WIDGET_CONTROL_TARGET:
            routed.add(comm_id)
            return True
        if comm_id in routed:
            if kind == "comm_close":
                routed.discard(comm_id)
            return True
        return False

    def addressed(msg: Any) -> list[Any]:
        """The message as the page would have sent it to the subshell: its header names
        the subshell (ipykernel checks that a request other than a comm message carries the
        id of the subshell that runs it), signed again with the kernel's key."""
        idents, rest = k.session.feed_identities(msg, copy=False)
        head = k.session.deserialize(rest, content=False, copy=False)  # a peek: no digest kept
        if head["header"]["msg_type"] in ("comm_msg", "comm_close"):
            return list(msg)  # routed by their comm: as they came
        full = k.session.deserialize(rest, content=True, copy=False)
        full["header"]["subshell_id"] = subshell_id
        return list(k.session.serialize(full, ident=idents))

    async def route(msg: Any) -> None:
        try:
            if ours(msg):
                frames = addressed(msg)
                sock = sct.manager.get_shell_channel_to_subshell_socket(subshell_id)
                async with sct.asyncio_lock:
                    sock.send_multipart(frames, copy=False)
                return
        except Exception:  # an unknown shape: ipykernel's own path decides
            pass
        await ipykernel_route(msg)

    _keep_busy_while_a_cell_runs(k)
    done = threading.Event()

    def install() -> None:
        try:
            stream.on_recv(route, copy=False)
            _SERVING.add(id(k))
        finally:
            done.set()

    sct.io_loop.add_callback(install)
    done.wait(5.0)
    return id(k) in _SERVING


def _keep_busy_while_a_cell_runs(k: Any) -> None:
    """Keep the page's kernel status true while a cell runs. ipykernel publishes busy and
    idle around every shell message, a subshell's too, and a page takes each status as the
    kernel's: every knob moved and every page that loaded turned the status bar to "Idle"
    while the cell trained. The idle itself must stay (ipywidgets sends a widget's next
    change only after the idle of its last; a page's kernel info waits for it), so an idle
    published off the main thread while the main shell runs a cell is followed by that
    cell's "busy" again."""
    publish = k._publish_status
    main: dict[str, Any] = {"status": "idle", "parent": None}
    # one status at a time: a subshell's idle and busy-again must not straddle the main
    # shell's idle at the cell's end (the page would then say "Busy" after the cell)
    order = threading.Lock()

    def truthful(status: str, channel: str, parent: Any = None) -> Any:
        if status not in ("busy", "idle"):
            return publish(status, channel, parent)
        with order:
            if threading.current_thread() is threading.main_thread():
                main.update(status=status, parent=parent or k.get_parent(channel))
                return publish(status, channel, parent)
            out = publish(status, channel, parent)
            if status == "idle" and main["status"] == "busy" and main["parent"] is not None:
                publish("busy", "shell", main["parent"])  # the cell still runs
            return out

    k._publish_status = truthful


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
