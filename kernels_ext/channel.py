"""Engine side of hvdnb's side channel (see ``hvdnb.channel`` for the protocol).

A rank connects lazily, the first time something sends or listens: ``get()`` returns the
process's channel, or None when this engine was not started by hvdnb (no
``HVDNB_CHANNEL``) so callers degrade to doing nothing. Sends are queued and written by
one I/O thread; handlers for incoming messages run on that thread and must be quick
(they typically store a value that the training loop reads at its next step).

Never: block the training step, issue a collective, or listen on a port (ranks only
connect out to the notebook).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import zmq

from hvdnb.channel import decode, encode

__all__ = ["EngineChannel", "get"]

log = logging.getLogger("hvdnb.channel")

_LOCK = threading.Lock()
_CHANNEL: EngineChannel | None = None


def _session_key() -> bytes:
    """The ipyparallel session key this engine signs with (from the connection file)."""
    key = os.environ.get("HVDNB_CHANNEL_KEY")
    if key:
        return key.encode()
    try:
        from IPython import get_ipython

        ip = get_ipython()
        return bytes(ip.kernel.session.key)  # type: ignore[union-attr]
    except Exception:
        return b""


class EngineChannel:
    """One DEALER socket connected to the notebook's ROUTER, and its I/O thread."""

    def __init__(self, endpoint: str, key: bytes, rank: int) -> None:
        self.endpoint = endpoint
        self.key = key
        self.rank = rank
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 500)
        self._sock.setsockopt(zmq.SNDHWM, 10000)
        self._sock.connect(endpoint)
        self._wake_addr = f"inproc://hvdnb-engine-channel-{id(self)}"
        self._wake_recv = self._ctx.socket(zmq.PULL)
        self._wake_recv.bind(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._wake_send = self._ctx.socket(zmq.PUSH)
        self._wake_send.connect(self._wake_addr)
        self._outbox: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._handlers: dict[str, list[Callable[[dict[str, Any]], None]]] = {}
        self.dropped = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hvdnb-channel", daemon=True)
        self._thread.start()
        self.send("hello", pid=os.getpid())

    def on(self, kind: str, handler: Callable[[dict[str, Any]], None]) -> None:
        self._handlers.setdefault(kind, []).append(handler)

    def send(self, kind: str, **payload: Any) -> None:
        """Queue a message to the notebook; returns at once."""
        self._outbox.put({"kind": kind, "rank": self.rank, **payload})
        with self._wake_lock:
            self._wake_send.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with self._wake_lock:
            try:
                self._wake_send.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._thread.join(2)

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
                self._flush()
                if self._closed.is_set():
                    return
                if self._sock in events:
                    while True:
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        msg = decode(self.key, frames)
                        if msg is None:
                            self.dropped += 1
                            continue
                        for h in list(self._handlers.get(msg["kind"], ())):
                            try:
                                h(msg)
                            except Exception:
                                log.exception("hvdnb: handler for %r failed", msg["kind"])
        finally:
            self._sock.close()
            self._wake_recv.close(0)

    def _flush(self) -> None:
        while True:
            try:
                msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._sock.send_multipart(encode(self.key, msg))


def get() -> EngineChannel | None:
    """This rank's channel (connected on first call), or None outside an hvdnb cluster."""
    global _CHANNEL
    if _CHANNEL is not None:
        return _CHANNEL
    endpoint = os.environ.get("HVDNB_CHANNEL")
    if not endpoint:
        return None
    with _LOCK:
        if _CHANNEL is None:
            rank = int(os.environ.get("RANK", "0"))
            _CHANNEL = EngineChannel(endpoint, _session_key(), rank)
    return _CHANNEL
