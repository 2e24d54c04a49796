"""A side channel between the notebook kernel and the ranks that works while cells run.

ipyparallel's own channels are busy while a cell executes (a knob change would wait for
the cell to end) and its ``publish_data`` keeps only the latest value per engine. This
channel carries hvdnb's own traffic: metrics from ranks, knob changes to ranks, "where are
you" answers for the stall detector.

Protocol: the client binds one ZeroMQ ROUTER socket (127.0.0.1 unless a multi-host
launcher asks for more); each rank connects a DEALER lazily, on first use. A message is
``[signature, body]``, or ``[signature, body, blob]`` when it carries number columns:
``body`` is UTF-8 JSON with at least ``kind`` and ``rank``, ``signature`` the hex
HMAC-SHA256 of ``body`` followed by ``blob``, keyed with the ipyparallel session key (from
the 0600 connection file). Messages with a bad signature, a non-JSON body or a malformed
blob are dropped and counted; nothing is ever unpickled.

Metrics columns (``cols``: ``{name: [steps, times, values]}``) travel as raw
little-endian int64 / float64 in the blob; the body keeps ``colsx``
(``{name: [n, steps offset, times offset, values offset]}``) and ``blob`` (its length).
Equal arrays are stored once: every metric logged in a step shares its steps column. The
receiver gets ``array.array`` columns. A column that is not all numbers stays in ``cols``
as JSON. ``python bench/bench_channel.py`` compares this with the earlier encodings.

Owns: the socket, the receive thread and the signing. Never: block the caller (sends are
queued to the I/O thread), or run handlers on the caller's thread.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import sys
import threading
from array import array
from collections.abc import Callable
from typing import Any

import zmq

__all__ = ["ClientChannel", "Endpoint", "sign", "verify", "encode", "decode", "pack_columns",
           "unpack_columns"]

log = logging.getLogger("hvdnb.channel")

Handler = Callable[[dict[str, Any]], None]


def sign(key: bytes, body: bytes, blob: bytes = b"") -> bytes:
    """Hex HMAC-SHA256 of ``body`` followed by ``blob`` (the body states the blob's
    length, so the boundary between them is signed too)."""
    mac = hmac.new(key, body, hashlib.sha256)
    if blob:
        mac.update(blob)
    return mac.hexdigest().encode("ascii")


def verify(key: bytes, signature: bytes, body: bytes, blob: bytes = b"") -> bool:
    return hmac.compare_digest(sign(key, body, blob), signature)


_ITEMSIZE = {"q": 8, "d": 8}


def _typed(kind: str, values: Any) -> array:
    """``values`` as an ``array(kind)``; the array itself when it already is one."""
    if type(values) is array and values.typecode == kind:
        return values
    return array(kind, values)


def pack_columns(msg: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """Split ``msg``'s number columns into a binary blob (see the module docstring).

    Returns the message to send as JSON (with ``colsx`` describing the columns and
    ``blob`` its length) and the blob. A column whose arrays equal one already packed
    (the steps shared by every metric of a step, usually) points at the same bytes."""
    cols = msg.get("cols")
    if not isinstance(cols, dict) or not cols:
        return msg, b""
    parts: list[bytes] = []
    where: dict[tuple[str, bytes], int] = {}  # (kind, bytes) -> offset in the blob
    size = 0

    def put(kind: str, a: array) -> int:
        nonlocal size
        if sys.byteorder != "little":
            a = array(kind, a)
            a.byteswap()
        raw = a.tobytes()
        off = where.get((kind, raw))
        if off is None:
            off = where[(kind, raw)] = size
            parts.append(raw)
            size += len(raw)
        return off

    packed: dict[str, list[int]] = {}
    rest: dict[str, Any] = {}
    for name, col in cols.items():
        try:
            steps, times, values = col
            n = len(steps)
            if not n == len(times) == len(values):
                raise ValueError
            st, ti, va = _typed("q", steps), _typed("d", times), _typed("d", values)
        except (TypeError, ValueError, OverflowError):
            rest[name] = col
            continue
        packed[name] = [n, put("q", st), put("d", ti), put("d", va)]
    out = dict(msg, colsx=packed, cols=rest)
    out["blob"] = size
    return out, b"".join(parts)


def unpack_columns(msg: dict[str, Any], blob: bytes) -> dict[str, Any]:
    """The inverse of ``pack_columns`` (columns come back as typed arrays); raises
    ValueError on a malformed ``colsx`` or a blob of the wrong length."""
    packed = msg.pop("colsx", None)
    if packed is None:
        if blob:
            raise ValueError("a blob without colsx")
        return msg
    cols = msg.get("cols")
    if not isinstance(packed, dict) or not isinstance(cols, dict):
        raise ValueError("colsx and cols must be objects")
    if msg.pop("blob", None) != len(blob):
        raise ValueError("the blob has the wrong length")
    view = memoryview(blob)

    def get(kind: str, off: Any, n: int) -> array:
        end = off + n * _ITEMSIZE[kind]
        if type(off) is not int or off < 0 or end > len(blob):
            raise ValueError("packed column out of the blob")
        a = array(kind)
        a.frombytes(view[off:end])
        if sys.byteorder != "little":
            a.byteswap()
        return a

    for name, col in packed.items():
        if (not isinstance(col, list) or len(col) != 4 or type(col[0]) is not int
                or col[0] < 0):
            raise ValueError(f"bad packed column {name!r}")
        n = col[0]
        cols[name] = [get("q", col[1], n), get("d", col[2], n), get("d", col[3], n)]
    return msg


def encode(key: bytes, msg: dict[str, Any]) -> list[bytes]:
    """``[signature, body]``, or ``[signature, body, blob]`` when ``msg`` has number
    columns; the signature covers the body and the blob."""
    wire, blob = pack_columns(msg)
    body = json.dumps(wire, separators=(",", ":"), allow_nan=True).encode("utf-8")
    if not blob:
        return [sign(key, body), body]
    return [sign(key, body, blob), body, blob]


def decode(key: bytes, frames: list[bytes]) -> dict[str, Any] | None:
    """The message, or None when it is not a correctly signed JSON object."""
    if len(frames) not in (2, 3) or not key:
        return None
    signature, body = frames[0], frames[1]
    blob = frames[2] if len(frames) == 3 else b""
    if not verify(key, signature, body, blob):
        return None
    try:
        msg = json.loads(body.decode("utf-8"))
        if not isinstance(msg, dict) or "kind" not in msg:
            return None
        return unpack_columns(msg, blob)
    except (UnicodeDecodeError, ValueError, TypeError):
        return None


class Endpoint:
    """One ZeroMQ socket owned by one I/O thread: queued sends, dispatched receives.

    Subclasses make the socket (``_make_socket``), say how a queued item goes out
    (``_send_item``) and how received frames become a message (``_handle``). ``send`` is
    safe from any thread: it queues and wakes the I/O thread through an inproc pipe.
    """

    def __init__(self, key: bytes, name: str) -> None:
        self.key = key
        self._ctx = zmq.Context.instance()
        self._sock = self._make_socket()
        self._wake_addr = f"inproc://hvdnb-{name}-{id(self)}"
        self._wake_recv = self._ctx.socket(zmq.PULL)
        self._wake_recv.bind(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._wake_send = self._ctx.socket(zmq.PUSH)
        self._wake_send.connect(self._wake_addr)
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._handlers: dict[str, list[Handler]] = {}
        self.dropped = 0
        self.received = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hvdnb-{name}", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- subclass hooks
    def _make_socket(self) -> zmq.Socket:
        raise NotImplementedError

    def _send_item(self, item: Any) -> None:
        raise NotImplementedError

    def _handle(self, frames: list[bytes]) -> None:
        raise NotImplementedError

    # -------------------------------------------------------------- public
    def on(self, kind: str, handler: Handler) -> None:
        """Call ``handler(msg)`` (on the I/O thread) for each message of ``kind``."""
        self._handlers.setdefault(kind, []).append(handler)

    def off(self, kind: str, handler: Handler) -> None:
        try:
            self._handlers.get(kind, []).remove(handler)
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

    def _make_socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted rank takes over its slot
        self.port = sock.bind_to_random_port(f"tcp://{self._bind_ip}")
        return sock

    @property
    def ranks(self) -> list[int]:
        """Ranks that have connected (said hello) so far."""
        return sorted(self._idents)

    def send(self, rank: int, kind: str, **payload: Any) -> None:
        """Queue a message for ``rank`` (dropped with a warning if it never connected)."""
        self._queue((rank, {"kind": kind, **payload}))

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
