"""One ZeroMQ socket owned by one I/O thread: the side channel's transport, on both sides.

The notebook's ``ClientChannel`` (``hvdnb.notebook.cluster.channel``) and a rank's ``EngineChannel``
(``hvdnb.rank.channel``) subclass ``Endpoint``. Messages are typed by ``hvdnb.protocol.kinds``:
``on`` and ``send`` take a ``Kind``, never a bare string; a received message of an unknown
kind or without a required field is dropped and counted (``invalid``), never dispatched.

Owns: the socket, the I/O thread, queued sends and dispatch. Never: block the caller (sends
are queued to the I/O thread), or run handlers on the caller's thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import zmq

from hvdnb.protocol.kinds import Kind, ProtocolError, check, kind_name, outgoing

__all__ = ["Endpoint", "Handler", "outgoing"]

log = logging.getLogger("hvdnb.channel")

Handler = Callable[[dict[str, Any]], None]


class Endpoint:
    """One ZeroMQ socket owned by one I/O thread: queued sends, dispatched receives.

    Subclasses make the socket (``_make_socket``), say how a queued item goes out
    (``_send_item``) and how received frames become a message (``_handle``). ``send`` is
    safe from any thread: it queues and wakes the I/O thread through an inproc pipe.
    """

    def __init__(self, key: bytes, name: str) -> None:
        self.key = key
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._sock = self._make_socket()
        self._wake_addr = f"inproc://hvdnb-{name}-{id(self)}"
        self._wake_recv = self._ctx.socket(zmq.PULL)
        self._wake_recv.bind(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._wake_send = self._ctx.socket(zmq.PUSH)
        self._wake_send.connect(self._wake_addr)
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._handlers: dict[str, list[Handler]] = {}
        self.dropped = 0  # bad signature or not JSON
        self.invalid = 0  # signed, but an unknown kind or a missing field
        self.received = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hvdnb-{name}", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- subclass hooks
    def _make_socket(self) -> zmq.Socket[bytes]:
        raise NotImplementedError

    def _send_item(self, item: Any) -> None:
        raise NotImplementedError

    def _handle(self, frames: list[bytes]) -> None:
        raise NotImplementedError

    # -------------------------------------------------------------- public
    def on(self, kind: Kind, handler: Handler) -> None:
        """Call ``handler(msg)`` (on the I/O thread) for each message of ``kind``."""
        self._handlers.setdefault(kind_name(kind), []).append(handler)

    def off(self, kind: Kind, handler: Handler) -> None:
        try:
            self._handlers.get(kind_name(kind), []).remove(handler)
        except ValueError:
            pass

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake()
        self._thread.join(2)
        with self._wake_lock:
            self._wake_send.close(0)

    # -------------------------------------------------------------- internals
    def _queue(self, item: Any) -> None:
        self._outbox.put(item)
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_send.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:  # closed, or the pipe is full: the thread is awake anyway
                pass

    def _dispatch(self, msg: dict[str, Any]) -> None:
        try:
            check(msg)
        except ProtocolError as exc:
            self.invalid += 1
            log.warning("hvdnb: channel dropped a message: %s", exc)
            return
        self.received += 1
        for handler in list(self._handlers.get(msg["kind"], ())):
            try:
                handler(msg)
            except Exception:  # a broken handler must not kill the channel
                log.exception("hvdnb: channel handler for %r failed", msg["kind"])

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(500))
                if self._wake_recv in events:
                    while True:
                        try:
                            self._wake_recv.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                while True:  # flush the outbox (also the last words before closing)
                    try:
                        item = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    self._send_item(item)
                if self._closed.is_set():
                    return
                if self._sock in events:
                    while True:
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(frames)
        finally:
            self._sock.close()
            self._wake_recv.close(0)
