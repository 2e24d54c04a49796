"""What ``hvdnb.log`` accepts: a step, and numbers. A value that is not one is refused at the
user's call, with what was wrong and what is accepted, never turned into NaN.

A number is a Python ``int``, ``float`` or ``bool``, a numpy scalar, or a tensor or array of
one element (a torch tensor on any device, a numpy array, a TensorFlow tensor). A CPU value
is read at once (``ring.scalar``); a device tensor of one element is kept and read off the
step (``ring.as_float``). ``None`` means "no value this step" for the loss and for a keyword;
for ``total_steps`` it means "the loop's length is unknown".

Owns: ``step_of``, ``number``, ``total_of`` (their refusals are ``hvdnb.protocol.errors``'s
``InputError``, which the public function re-raises from the user's frame). Called only
where the hot path meets a value that is not a float already (a plain float costs nothing
here). Never: wait for a device, import torch or numpy, or keep a reference to the value.
"""

from __future__ import annotations

import math
from typing import Any

from hvdnb.protocol.errors import InputError, InputTypeError, InputValueError
from hvdnb.rank.metrics.ring import scalar

__all__ = ["InputError", "InputTypeError", "InputValueError", "number", "step_of", "total_of"]

ACCEPTED = (
    "a Python int, float or bool, a numpy scalar, or a tensor or array of one element "
    "(e.g. loss.item(), loss.mean())"
)


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _elements(v: Any) -> int | None:
    """How many elements an array-like ``v`` holds (metadata only: never reads a device);
    None when ``v`` is not one."""
    numel = getattr(v, "numel", None)
    if callable(numel):  # torch
        try:
            return int(numel())
        except Exception:
            return None
    size = getattr(v, "size", None)
    if isinstance(size, int) and hasattr(v, "shape"):  # numpy, jax
        return size
    shape = getattr(v, "shape", None)
    if shape is None:
        return None
    try:  # TensorFlow's TensorShape, a tuple: the product of known dimensions
        dims = [int(d) for d in shape]
    except (TypeError, ValueError):
        return None
    return math.prod(dims)


def number(name: str, v: Any, read: bool = True) -> Any:
    """``v`` (not a float already) as ``log`` keeps it: a float, or a one-element device
    tensor read later. Raises ``InputTypeError`` / ``InputValueError`` for anything else.
    ``read`` False: ``v`` is ``ring.scalar``'s answer already (the hot path's)."""
    s = scalar(v) if read else v
    if type(s) is float:
        return s
    n = _elements(s)
    if n == 1:  # a device tensor of one element: read off the step (``as_float``)
        return s
    if n is None and callable(getattr(s, "item", None)):  # a one-value reader (a timing span)
        return s
    if n is not None:
        shape = tuple(getattr(v, "shape", ()))
        raise InputValueError(
            f"hvdnb.log: {name} is {type(v).__name__} of shape {shape} ({n} elements); "
            f"log one number per name: {ACCEPTED}"
        )
    if isinstance(v, int):  # an int too large for a float
        raise InputValueError(f"hvdnb.log: {name}={_show(v)} is too large for a float")
    raise InputTypeError(
        f"hvdnb.log: {name} must be a number, not {type(v).__name__} ({_show(v)}); "
        f"it takes {ACCEPTED}"
    )


def step_of(v: Any) -> int:
    """The step ``v`` as an int: an int, a numpy integer, a float or tensor holding a whole
    number. Raises ``InputTypeError`` / ``InputValueError`` for anything else."""
    if isinstance(v, bool):
        raise InputTypeError(f"hvdnb.log: step must be a whole number, not {v!r}")
    if isinstance(v, int):
        return int(v)
    s = scalar(v) if not isinstance(v, (str, bytes)) else v
    if type(s) is float and s.is_integer():
        return int(s)
    if type(s) is float:
        raise InputValueError(f"hvdnb.log: step must be a whole number, not {_show(v)}")
    raise InputTypeError(
        f"hvdnb.log: step must be a whole number (the step that just finished), "
        f"not {type(v).__name__} ({_show(v)})"
    )


def total_of(v: Any) -> int | None:
    """``total_steps`` as an int, or None (the loop's length is unknown)."""
    if v is None:
        return None
    try:
        total = step_of(v)
    except InputError:
        raise InputTypeError(
            f"hvdnb.log: total_steps must be a whole number of steps, or None when the "
            f"loop's length is unknown; not {type(v).__name__} ({_show(v)})"
        ) from None
    if total < 0:
        raise InputValueError(f"hvdnb.log: total_steps must be >= 0, not {total}")
    return total
