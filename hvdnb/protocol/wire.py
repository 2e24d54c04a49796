"""The side channel's wire format: how a message becomes signed frames and back.

The side channel links the notebook kernel and the ranks and works while cells run.

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

Owns: encoding, signing and decoding. Never: sockets or threads (``hvdnb.protocol.endpoint``),
message kinds (``hvdnb.protocol.kinds``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
from array import array
from typing import Any

__all__ = ["decode", "encode", "pack_columns", "sign", "unpack_columns", "verify"]


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


def _typed(kind: str, values: Any) -> array[Any]:
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

    def put(kind: str, a: array[Any]) -> int:
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

    def get(kind: str, off: Any, n: int) -> array[Any]:
        end = off + n * _ITEMSIZE[kind]
        if type(off) is not int or off < 0 or end > len(blob):
            raise ValueError("packed column out of the blob")
        a = array(kind)
        a.frombytes(view[off:end])
        if sys.byteorder != "little":
            a.byteswap()
        return a

    for name, col in packed.items():
        if not isinstance(col, list) or len(col) != 4 or type(col[0]) is not int or col[0] < 0:
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
