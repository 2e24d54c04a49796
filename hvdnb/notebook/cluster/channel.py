"""The notebook's end of the side channel: one ROUTER socket the ranks connect to.

Owns: binding the socket, knowing which rank is which connection, sending to one rank.
Never: block the caller (``hvdnb.protocol.endpoint``), or run on a rank.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from hvdnb.protocol.endpoint import Endpoint, log, outgoing
from hvdnb.protocol.kinds import Kind
from hvdnb.protocol.wire import decode, encode

__all__ = ["ClientChannel"]


class ClientChannel(Endpoint):
    """The notebook side: one ROUTER socket, bound on ``ip`` at a free port.

    Parameters
    ----------
    ip : address to bind (127.0.0.1 for local clusters)
    key : the HMAC key; may be set later (``channel.key = ...``) before engines send
    """

    def __init__(self, ip: str = "127.0.0.1", key: bytes = b"") -> None:
        self._bind_ip = "*" if ip in ("0.0.0.0", "*") else ip
        self._idents: dict[int, bytes] = {}
        super().__init__(key, "channel")
        self.endpoint = f"tcp://{ip if self._bind_ip != '*' else '0.0.0.0'}:{self.port}"

    def _make_socket(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted rank takes over its slot
        self.port = sock.bind_to_random_port(f"tcp://{self._bind_ip}")
        return sock

    @property
    def ranks(self) -> list[int]:
        """Ranks that have connected (said hello) so far."""
        return sorted(self._idents)

    def send(self, rank: int, kind: Kind, **payload: Any) -> None:
        """Queue a message for ``rank`` (dropped with a warning if it never connected)."""
        self._queue((rank, outgoing(kind, payload)))

    def ask(
        self, ranks: list[int], question: Kind, answer: Kind, timeout: float, tag: str
    ) -> dict[int, dict[str, Any]]:
        """Send ``question`` to each of ``ranks`` and collect their ``answer`` messages
        (matched by an ``ask`` field made from ``tag``) until all came or ``timeout``
        seconds passed: rank -> its answer, the ranks that did not answer left out."""
        replies: dict[int, dict[str, Any]] = {}
        ask = f"{tag}-{time.monotonic_ns()}"

        def on_answer(msg: dict[str, Any]) -> None:
            if msg.get("ask") == ask and isinstance(msg.get("rank"), int):
                replies[msg["rank"]] = msg

        self.on(answer, on_answer)
        try:
            for r in ranks:
                self.send(r, question, ask=ask)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and len(replies) < len(ranks):
                time.sleep(0.02)
        finally:
            self.off(answer, on_answer)
        return replies

    def _send_item(self, item: tuple[int, dict[str, Any]]) -> None:
        rank, msg = item
        ident = self._idents.get(rank)
        if ident is None:
            log.warning("hvdnb: rank %s has not connected its channel; dropped %s", rank, msg)
            return
        self._sock.send_multipart([ident, *encode(self.key, msg)])

    def _handle(self, frames: list[bytes]) -> None:
        ident, rest = frames[0], frames[1:]
        msg = decode(self.key, rest)
        if msg is None:
            self.dropped += 1
            return
        rank = msg.get("rank")
        if isinstance(rank, int):
            self._idents[rank] = ident
        self._dispatch(msg)
