"""The server takes over a running cell's output when the page that ran it goes away.

JupyterLab runs a cell from the page: the page sends the request and writes what comes
back into the notebook, which jupyter-collaboration shares through the server. While
that page lives, it is the one writer, and its outputs are trusted (widgets draw). When
it goes (a reload, a closed tab or browser, a laptop lid), nobody writes the rest: the
kernel's messages answer a request no page knows.

:class:`TakeOver` watches, in the server, what every page sends to a kernel and what the
kernel publishes:

- each ``execute_request`` a page sends (its message id, the page's session, the cell id
  JupyterLab puts in its metadata), and every output message answering it, kept in order
  until the request's kernel is idle again;
- when a page's kernel connection closes while one of its requests runs, and the page has
  not come back within :data:`GRACE` seconds (JupyterLab reconnects a dropped socket with
  the same session, and the server replays what it buffered), the server puts a new copy
  of the shared cell in its place (:func:`rebuilt_cell`: a page that stayed open draws it
  afresh) and writes the request's whole output into it, from the first message, with
  jupyter-server-nbmodel's own output hook (and hvdnb's in-place updates,
  :func:`hvdnb.server.with_display_updates`), then each new message as it comes, and
  marks the cell running, then done with its execution count.

Every page that opens the notebook then draws the server's copy, live, and the server
saves it: a reload, a second tab, or a browser opened after the cell ended shows the whole
output. The cells stay trusted as the page left them (JupyterLab keeps a cell's trust in
its shared metadata), so widgets draw too.

Owns: the watch (three wrapped methods of jupyter_server's kernel websocket connection,
one IOPub subscription per running kernel a page connected to, let go once the server no
longer runs that kernel) and the take-over. Never: a write while
the page that ran the cell is connected, or a message the page did not ask for.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GRACE", "TakeOver", "rebuilt_cell"]

#: seconds a page may be gone before the server writes its running cells: JupyterLab
#: reconnects a dropped socket with the same session within this, and the server replays
#: what it buffered to it
GRACE = 2.0

#: the messages that change a cell's outputs
OUTPUTS = frozenset(
    {"stream", "display_data", "update_display_data", "execute_result", "error", "clear_output"}
)


@dataclass
class Request:
    """One ``execute_request`` a page sent, and what answered it so far."""

    msg_id: str
    kernel_id: str
    session: str
    cell_id: str | None
    messages: list[dict[str, Any]] = field(default_factory=list)
    execution_count: int | None = None
    #: set once the server writes this request's outputs: the shared cell, its outputs
    #: and nbmodel's stream state
    ycell: Any = None
    outputs: list[Any] = field(default_factory=list)
    state: Any = None
    taking: bool = False


class TakeOver:
    """The server's watch over pages and their running cells (module docstring).

    Parameters
    ----------
    serverapp : the Jupyter server
    hook : the output hook that writes one message into a shared cell (nbmodel's, wrapped
        by :func:`hvdnb.server.with_display_updates`)
    grace : seconds a page may be gone before its running cells are taken over
    """

    def __init__(self, serverapp: Any, hook: Any, grace: float = GRACE) -> None:
        self.app = serverapp
        self.hook = hook
        self.grace = grace
        self.requests: dict[str, Request] = {}
        self._iopub: dict[str, Any] = {}
        #: (kernel id, session) -> when its last connection closed
        self._gone: dict[tuple[str, str], float] = {}
        self.taken = 0
        self._tasks: set[asyncio.Future[None]] = set()

    # -- what pages send ----------------------------------------------------------------

    def page_sent(self, connection: Any, ws_msg: Any) -> None:
        """A page sent ``ws_msg`` on ``connection``: note an ``execute_request``."""
        header, metadata = _shell_request(connection, ws_msg)
        if header is None or header.get("msg_type") != "execute_request":
            return
        kernel_id = connection.kernel_id
        self.listen(kernel_id)
        self.requests[header["msg_id"]] = Request(
            msg_id=header["msg_id"],
            kernel_id=kernel_id,
            session=header.get("session", ""),
            cell_id=(metadata or {}).get("cellId"),
        )

    def page_connected(self, connection: Any) -> None:
        self._gone.pop((connection.kernel_id, connection.session.session), None)
        self.listen(connection.kernel_id)

    def page_left(self, connection: Any) -> None:
        """A page's kernel connection closed: after the grace, take over its running cells
        unless it came back."""
        key = (connection.kernel_id, connection.session.session)
        self._gone[key] = time.monotonic()
        self.prune()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.call_later(self.grace, self._maybe_take, key)

    def _maybe_take(self, key: tuple[str, str]) -> None:
        if key not in self._gone:  # it came back
            return
        for req in list(self.requests.values()):
            if (req.kernel_id, req.session) == key and req.ycell is None and not req.taking:
                req.taking = True
                self._start(req)

    # -- what kernels publish -------------------------------------------------------------

    def listen(self, kernel_id: str) -> None:
        """Subscribe to the kernel's IOPub once (the server's own socket); first let go of
        kernels the server no longer runs."""
        if kernel_id in self._iopub:
            return
        self.prune()
        try:
            km = self.app.kernel_manager.get_kernel(kernel_id)
            stream = km.connect_iopub()
        except Exception:
            return
        stream.on_recv(lambda msg_list: self._published(km.session, msg_list))
        self._iopub[kernel_id] = stream

    def forget(self, kernel_id: str) -> None:
        """Close the kernel's IOPub subscription and drop its requests."""
        stream = self._iopub.pop(kernel_id, None)
        if stream is not None:
            stream.close()
        for msg_id in [m for m, r in self.requests.items() if r.kernel_id == kernel_id]:
            del self.requests[msg_id]

    def prune(self) -> None:
        """Forget every kernel the server has shut down (or lost)."""
        try:
            running = set(self.app.kernel_manager.list_kernel_ids())
        except Exception:
            return
        for kernel_id in [k for k in self._iopub if k not in running]:
            self.forget(kernel_id)

    def _published(self, session: Any, msg_list: list[Any]) -> None:
        """One message of a kernel's IOPub. Read as little as decides it: the parent
        header first (most messages answer no running cell, or one whose page is there
        and only needs them kept); the signature is not checked again (the server's own
        socket to the kernel; the copy it forwards to pages is checked)."""
        try:
            _, parts = session.feed_identities(msg_list)
            # [signature, header, parent header, metadata, content, buffers...]
            parent = session.unpack(parts[2])
            header = session.unpack(parts[1])
        except Exception:
            return
        kind = header.get("msg_type")
        msg: dict[str, Any] = {"header": header, "parent_header": parent, "content": parts[4]}
        if kind == "update_display_data" and self._server_display(session, msg):
            return
        req = self.requests.get((parent or {}).get("msg_id", ""))
        if req is None or (kind not in OUTPUTS and kind not in ("status", "execute_input")):
            return
        if not isinstance(msg["content"], dict):
            msg["content"] = session.unpack(msg["content"])
        msg["metadata"] = session.unpack(parts[3])
        content = msg["content"]
        if kind == "status":
            if content.get("execution_state") == "idle":
                self._ended(req)
            return
        if kind == "execute_input":
            req.execution_count = content.get("execution_count")
            return
        req.messages.append(msg)
        if req.ycell is not None:
            self._write(req, msg)

    def _server_display(self, session: Any, msg: dict[str, Any]) -> bool:
        """An update of a display the server wrote (whatever request it answers: hvdnb
        puts a training cell's picture in with the next cell's messages, or when the
        kernel is idle). No page can apply it: a page knows only the display ids of the
        messages it received itself."""
        places = getattr(self.hook, "places", None)
        if not places:
            return False
        content = session.unpack(msg["content"])
        display_id = (content.get("transient") or {}).get("display_id")
        if display_id not in places:
            msg["content"] = content
            return False
        msg["content"] = content
        self.hook([], None, _Scratch(), msg)
        return True

    # -- the take-over --------------------------------------------------------------------

    def _start(self, req: Request) -> None:
        task = asyncio.ensure_future(self._take(req))
        self._tasks.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._tasks.discard)

    async def _take(self, req: Request) -> None:
        from jupyter_server_nbmodel import actions  # noqa: PLC0415  the durable extra

        path = await self._path(req.kernel_id)
        ydoc = _ydoc_extension(self.app)
        if path is None or ydoc is None or req.cell_id is None:
            return
        ycell = await actions._get_ycell(ydoc, {"document_path": path, "cell_id": req.cell_id})
        if ycell is None:
            return
        req.state = actions._StreamState()
        notebook = await ydoc.get_document(
            path=path, content_type="notebook", file_format="json", copy=False
        )
        fresh = rebuilt_cell(notebook, req.cell_id, req.execution_count) if notebook else None
        if fresh is None:  # not found by id: empty it in place
            with ycell.doc.transaction():
                del ycell["outputs"][:]
                ycell["execution_state"] = "running"
                if req.execution_count is not None:
                    ycell["execution_count"] = req.execution_count
            fresh = ycell
        req.ycell = fresh
        for msg in list(req.messages):
            self._write(req, msg)
        self.taken += 1
        self.app.log.info(
            "hvdnb: the page that ran cell %s of %s left; the server writes its output",
            req.cell_id,
            path,
        )
        if req.msg_id not in self.requests:  # it ended while we looked the cell up
            self._finish(req)

    def _write(self, req: Request, msg: dict[str, Any]) -> None:
        try:
            self.hook(req.outputs, req.ycell, req.state, msg)
        except Exception as exc:  # one bad message must not stop the rest
            self.app.log.warning("hvdnb: could not write an output of %s: %s", req.cell_id, exc)

    def _ended(self, req: Request) -> None:
        self.requests.pop(req.msg_id, None)
        if req.ycell is not None:
            self._finish(req)
        elif (req.kernel_id, req.session) in self._gone and not req.taking:
            # the page left and the cell ended within the grace: its end is the server's
            req.taking = True
            self._start(req)

    def _finish(self, req: Request) -> None:
        with req.ycell.doc.transaction():
            req.ycell["execution_state"] = "idle"
            if req.execution_count is not None:
                req.ycell["execution_count"] = req.execution_count

    async def _path(self, kernel_id: str) -> str | None:
        try:
            sessions = await self.app.session_manager.list_sessions()
        except Exception:
            return None
        for s in sessions:
            if (s.get("kernel") or {}).get("id") == kernel_id and s.get("type") == "notebook":
                return str(s.get("path"))
        return None


def rebuilt_cell(notebook: Any, cell_id: str, execution_count: int | None) -> Any:
    """Put a new copy of the shared cell ``cell_id`` in its place, with no outputs and
    running, and return it (None when no cell has that id).

    Emptying the cell's outputs in place is not enough for a page that stayed open: while
    the page that ran the cell drew, each display it updated in place reached the other
    pages as "remove at i, insert at i", which JupyterLab 4 applies as "remove at i,
    *append*" (the module docstring of :mod:`hvdnb.server`), so their outputs drifted from
    the server's copy (a live line at the bottom, stream text appended to it). A page
    applies "delete every output" as "delete as many as the server's copy holds", and kept
    what drifted beyond: a stale live line above the server's. A cell deleted and inserted
    again is drawn by every page from the server's copy."""
    cells = notebook.ycells
    at = next((i for i, c in enumerate(cells) if c.get("id") == cell_id), None)
    if at is None:
        return None
    value = cells[at].to_py()
    value["outputs"] = []
    fresh = notebook.create_ycell(value)
    with cells.doc.transaction():
        del cells[at]
        cells.insert(at, fresh)
        fresh["execution_state"] = "running"
        if execution_count is not None:
            fresh["execution_count"] = execution_count
    return fresh


class _Scratch:
    """The per-execution state the hook keeps, for an update that belongs to no request
    the server writes."""


def _ydoc_extension(serverapp: Any) -> Any:
    apps = serverapp.extension_manager.extension_apps.get("jupyter_server_ydoc") or ()
    return next(iter(apps), None)


def _shell_request(connection: Any, ws_msg: Any) -> tuple[Any, Any]:
    """The header and metadata of a shell message a page sent, or (None, None)."""
    try:
        if connection.subprotocol == "v1.kernel.websocket.jupyter.org":
            from jupyter_server.services.kernels.connection.base import (  # noqa: PLC0415
                deserialize_msg_from_ws_v1,
            )

            channel, msg_list = deserialize_msg_from_ws_v1(ws_msg)  # type: ignore[no-untyped-call]
            if channel != "shell":
                return None, None
            unpack = connection.session.unpack
            return unpack(msg_list[0]), unpack(msg_list[2])
        msg = json.loads(ws_msg) if isinstance(ws_msg, str) else None
        if not msg or msg.get("channel", "shell") != "shell":
            return None, None
        return msg.get("header"), msg.get("metadata")
    except Exception:
        return None, None


def install(serverapp: Any, hook: Any) -> TakeOver:
    """Wrap jupyter_server's kernel websocket connection so that ``TakeOver`` sees what
    pages send, when they connect and when they leave."""
    from jupyter_server.services.kernels.connection.channels import (  # noqa: PLC0415
        ZMQChannelsWebsocketConnection as Connection,
    )

    watch = TakeOver(serverapp, hook)
    incoming, connect, disconnect = (
        Connection.handle_incoming_message,
        Connection.connect,
        Connection.disconnect,
    )

    def handle_incoming_message(self: Any, incoming_msg: Any) -> None:
        if self.channels:
            watch.page_sent(self, incoming_msg)
        incoming(self, incoming_msg)

    def connect_(self: Any) -> Any:
        got = connect(self)
        watch.page_connected(self)
        return got

    def disconnect_(self: Any) -> None:
        watch.page_left(self)
        disconnect(self)  # type: ignore[no-untyped-call]

    Connection.handle_incoming_message = handle_incoming_message  # type: ignore[method-assign]
    Connection.connect = connect_  # type: ignore[method-assign]
    Connection.disconnect = disconnect_  # type: ignore[method-assign]
    return watch
