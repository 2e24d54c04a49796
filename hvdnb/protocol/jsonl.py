"""The side channel's messages as JSON lines: the file form of the protocol.

An exported script run with ``HVDNB_METRICS_DIR`` set writes each message its rank would
have sent to the notebook as one line of ``rank<N>.jsonl`` (``hvdnb.rank.script``);
``hvdnb.metrics.load`` reads them back into a store. Both sides use this module, so the
file form is defined once, next to the wire's (``hvdnb.protocol.wire``).

A line is one JSON object: the envelope (``kind``, ``rank``) and the payload, as the wire's
body has them, except that number columns stay inline and readable (``cols``:
``{name: [steps, times, values]}``, e.g. for ``jq``). What JSON has no form for is written
as one: ``array.array``, numpy arrays and scalars and tensors (anything with ``tolist``) as
lists, ``bytes`` as ``{"$bytes": "<base64>"}``, NaN and +-inf as ``NaN``, ``Infinity``,
``-Infinity`` (Python's ``json`` and pandas read them). Python writes every float with the
digits that read back to the same float, and int64 steps as exact integers.

Reading a line gives what the wire's receiver gets: the kind checked against its fields,
number columns as typed arrays (the wire's own ``pack_columns`` and ``unpack_columns``, so
a column means the same in both forms), bytes as bytes.

Owns: ``dumps_line`` and ``loads_line``. Never: files, sockets or threads.
"""

from __future__ import annotations

import base64
import json
from array import array
from typing import Any

from hvdnb.protocol import kinds, wire

__all__ = ["dumps_line", "loads_line"]

_BYTES = "$bytes"


def _plain(o: Any) -> Any:
    """The JSON form of a value ``json`` cannot write (its ``default`` hook)."""
    if isinstance(o, (bytes, bytearray, memoryview)):
        return {_BYTES: base64.b64encode(bytes(o)).decode("ascii")}
    if isinstance(o, array):
        return o.tolist()
    tolist = getattr(o, "tolist", None)  # numpy arrays and scalars, tensors
    if callable(tolist):
        return tolist()
    raise TypeError(f"a {type(o).__name__} cannot be written to a metrics file: {o!r:.80}")


def _restore(d: dict[str, Any]) -> Any:
    """``json``'s ``object_hook``: ``{"$bytes": ...}`` back to bytes."""
    if len(d) == 1 and isinstance(d.get(_BYTES), str):
        return base64.b64decode(d[_BYTES], validate=True)
    return d


def dumps_line(msg: dict[str, Any]) -> str:
    """One message as one JSON line (no newline at its end).

    Raises ``TypeError`` for a value that has no JSON form (see the module docstring)."""
    return json.dumps(msg, separators=(",", ":"), allow_nan=True, default=_plain)


def loads_line(line: str | bytes) -> dict[str, Any]:
    """The message a line holds, as the wire's receiver gets it.

    Raises
    ------
    ValueError
        not a JSON object, an unknown kind or a missing field (``kinds.ProtocolError``),
        or malformed columns; the text says which.
    """
    try:
        msg = json.loads(line, object_hook=_restore)
    except (ValueError, TypeError) as exc:  # binascii.Error is a ValueError
        raise ValueError(f"not a JSON line: {exc}") from None
    if not isinstance(msg, dict):
        raise ValueError(f"not a JSON object but {type(msg).__name__}")
    kinds.check(msg)
    return wire.unpack_columns(*wire.pack_columns(msg))
