"""Engine side of hvdnb's side channel (``hvdnb.protocol`` holds the kinds and the wire).

A rank connects lazily, the first time something sends or listens: ``get()`` returns the
process's channel, or None when this engine was not started by hvdnb (no
``HVDNB_CHANNEL``) so callers degrade to doing nothing. Sends are queued and written by
one I/O thread; handlers for incoming messages run on that thread and must be quick
(they typically store a value that the training loop reads at its next step).

Never: block the training step, issue a collective, or listen on a port (ranks only
connect out to the notebook).
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any

import zmq

from hvdnb.protocol import kinds
from hvdnb.protocol.endpoint import Endpoint, outgoing
from hvdnb.protocol.kinds import Kind
from hvdnb.protocol.wire import decode, encode

__all__ = ["EngineChannel", "get"]

_LOCK = threading.Lock()
_CHANNEL: EngineChannel | None = None


def _session_key() -> bytes:
    """The ipyparallel session key this engine signs with (from the connection file)."""
    key = os.environ.get("HVDNB_CHANNEL_KEY")
    if key:
        return key.encode()
    try:
        from IPython import get_ipython  # noqa: PLC0415  IPython: only inside a kernel

        ip = get_ipython()
        return bytes(ip.kernel.session.key)
    except Exception:
        return b""


class EngineChannel(Endpoint):
    """One DEALER socket connected to the notebook's ROUTER (says hello on connect)."""

    def __init__(self, endpoint: str, key: bytes, rank: int) -> None:
        self.endpoint = endpoint
        self.rank = rank
        #: messages queued so far, in the order the socket sends them: the recorder's
        #: cell-end message must come after all of them (see ``Flusher.flush``); counted
        #: with ``itertools.count``, whose ``next`` no other thread's send can interleave
        self.queued = 0
        self._counter = itertools.count(1)
        super().__init__(key, "engine-channel")
        self.send(kinds.HELLO, pid=os.getpid())

    def _make_socket(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 500)  # last metrics still go out at exit
        sock.setsockopt(zmq.SNDHWM, 10000)
        sock.connect(self.endpoint)
        return sock

    def send(self, kind: Kind, **payload: Any) -> None:
        """Queue a message to the notebook; returns at once."""
        msg = outgoing(kind, payload)
        msg["rank"] = self.rank
        self.queued = next(self._counter)
        self._queue(msg)

    def _send_item(self, msg: dict[str, Any]) -> None:
        self._sock.send_multipart(encode(self.key, msg))

    def _handle(self, frames: list[bytes]) -> None:
        msg = decode(self.key, frames)
        if msg is None:
            self.dropped += 1
            return
        self._dispatch(msg)


def get(rank: int | None = None, key: bytes | None = None) -> EngineChannel | None:
    """This rank's channel (connected on first call), or None outside an hvdnb cluster.

    ``rank`` and ``key`` are for the rendezvous, which connects before ``RANK`` is set and
    before the engine holds its session key; later calls return the same channel.
    """
    global _CHANNEL
    if _CHANNEL is not None:
        return _CHANNEL
    endpoint = os.environ.get("HVDNB_CHANNEL")
    if not endpoint:
        return None
    with _LOCK:
        if _CHANNEL is None:
            r = int(os.environ.get("RANK", "0")) if rank is None else rank
            _CHANNEL = EngineChannel(endpoint, _session_key() if key is None else key, r)
    return _CHANNEL
