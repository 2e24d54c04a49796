"""Knob rules both sides apply: the spec of a knob set, the one validator, the one text parser.

The notebook validates a change before sending it (``%dist knobs``, the panel's sliders and
text box, ``hvdnb.set_knobs``) and rank 0 validates it again when it plans the step (a
request may come from anywhere that holds the key): both call ``validate`` here, so a value
is refused with the same words in both places. ``parse`` reads ``name=value`` text for the
magic and the panel alike.

Owns: spec, validation, coercion, parsing. Never: send, plan or apply a change
(``hvdnb.rank.metrics.knobs``, ``hvdnb.notebook.metrics``).
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["KnobTextError", "coerce", "make_spec", "parse", "validate"]

Spec = dict[str, dict[str, Any]]

#: default ranges for the well-known knobs (others: ints >= 0, floats finite >= 0)
_DEFAULT_RANGES: dict[str, tuple[float, float]] = {
    "batch_size": (1, 65536),
    "warmup_steps": (0, 1_000_000),
    "lr": (1e-8, 10.0),
}


def make_spec(values: dict[str, Any], ranges: dict[str, tuple[float, float]] | None = None) -> Spec:
    """The spec of a knob set: ``{name: {"kind": "int"|"float", "min", "max", "value"}}``."""
    spec: dict[str, dict[str, Any]] = {}
    if ranges is not None and not isinstance(ranges, dict):
        raise TypeError(
            f"ranges must be a dict of {{name: (min, max)}}, not {type(ranges).__name__}"
        )
    ranges = dict(ranges or {})
    if not values:
        raise ValueError("no knobs given: name at least one, e.g. hvdnb.knobs(lr=0.1)")
    unknown = sorted(set(ranges) - set(values))
    if unknown:
        raise ValueError(
            f"ranges names {', '.join(unknown)}, which is not among the knobs given "
            f"({', '.join(values)}): give its starting value too"
        )
    for name, v in values.items():
        if not name.isidentifier() or name.startswith("_") or name in _RESERVED:
            raise ValueError(f"knob name {name!r} is not allowed: use a plain identifier")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(
                f"knob {name}={v!r} is {type(v).__name__}: a knob's value is an int or a "
                f"float, e.g. {name}=64"
            )
        kind = "int" if isinstance(v, int) else "float"
        lo, hi = _range(name, ranges.get(name, _DEFAULT_RANGES.get(name, (0, math.inf))))
        if kind == "int" and math.isinf(hi):
            hi = 2**31 - 1
        if kind == "float" and math.isinf(hi):
            hi = 1e12
        spec[name] = {"kind": kind, "min": lo, "max": hi, "value": v}
        err = validate(spec, {name: v})
        if err:
            raise ValueError(f"initial value: {err}")
    return spec


_RESERVED = {"step", "values", "spec", "pending", "history"}


def _range(name: str, r: Any) -> tuple[float, float]:
    """A knob's ``(min, max)``, checked: two numbers, min <= max."""
    try:
        lo, hi = r
    except (TypeError, ValueError):
        raise TypeError(f"ranges[{name!r}] must be (min, max), not {r!r}") from None
    for v in (lo, hi):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            raise TypeError(f"ranges[{name!r}] must be two numbers (min, max), not {r!r}")
    if lo > hi:
        raise ValueError(f"ranges[{name!r}] = {r!r}: min is above max")
    return lo, hi


def validate(spec: dict[str, dict[str, Any]], values: dict[str, Any]) -> str | None:
    """None when every value is acceptable, else a message saying what is wrong."""
    if not isinstance(values, dict) or not values:
        return "no values given"
    for name, v in values.items():
        s = spec.get(name)
        if s is None:
            return f"unknown knob {name!r} (known: {', '.join(sorted(spec)) or 'none'})"
        if isinstance(v, bool):
            return f"{name}: {v!r} is a bool, not a number"
        if s["kind"] == "int":
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            if not isinstance(v, int):
                return f"{name} must be a whole number, not {v!r}"
        else:
            if not isinstance(v, (int, float)):
                return f"{name} must be a number, not {v!r}"
            if not math.isfinite(v):
                return f"{name} must be finite, not {v!r}"
        if not s["min"] <= v <= s["max"]:
            return f"{name}={v!r} is out of range [{s['min']:g}, {s['max']:g}]"
    return None


def at_step_error(at_step: Any) -> str | None:
    """None when ``at_step`` is absent (None) or a step number >= 0, else what is wrong. The
    one rule: the notebook refuses a request with it, and rank 0 re-checks a request with
    the same words (a plan with this error) instead of ignoring the value."""
    if at_step is None:
        return None
    if isinstance(at_step, bool) or not isinstance(at_step, int) or at_step < 0:
        return f"at_step must be a step number >= 0, not {at_step!r}"
    return None


def coerce(spec: dict[str, dict[str, Any]], values: dict[str, Any]) -> dict[str, Any]:
    """Values converted to the knob's kind (after ``validate`` accepted them)."""
    return {k: (int(v) if spec[k]["kind"] == "int" else float(v)) for k, v in values.items()}


class KnobTextError(ValueError):
    """Knob text that cannot be read; the message says how to write it."""


_INT = re.compile(r"[-+]?\d+")


def parse(text: str | list[str]) -> dict[str, int | float]:
    """``"lr=0.1, batch_size=64"`` (or ``["lr=0.1", "batch_size=64"]``) as
    ``{"lr": 0.1, "batch_size": 64}``: whole numbers become ints, others floats. Pairs are
    separated by commas or spaces. Raises ``KnobTextError`` saying what could not be read.
    """
    items = text if isinstance(text, list) else re.split(r"[,\s]+", re.sub(r"\s*=\s*", "=", text))
    out: dict[str, int | float] = {}
    for item in (i.strip() for i in items):
        if not item:
            continue
        name, eq, raw = (p.strip() for p in item.partition("="))
        if not eq or not name.isidentifier():
            raise KnobTextError(f"cannot read {item!r}: write name=value, e.g. warmup_steps=200")
        try:
            out[name] = int(raw) if _INT.fullmatch(raw) else float(raw)
        except ValueError:
            raise KnobTextError(f"{name}: {raw!r} is not a number") from None
    if not out:
        raise KnobTextError("no values given: write name=value, e.g. warmup_steps=200")
    return out
