"""Round axis ticks and how the charts print a number: one format for the live panel's
SVG, its hover readouts and the saved picture's clipped-value note.

Owns: the tick rule (d3's 1, 2, 5 x 10^k steps; decades on a log axis) and number
formats. Never: read the store or draw.
"""

from __future__ import annotations

import math

__all__ = ["fmt_value", "nice_ticks"]


def fmt_value(v: float) -> str:
    """A number as the charts print it (axis ticks, the clipped maximum)."""
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e4 or a < 1e-3:
        return f"{v:.1e}"
    return f"{v:.4g}"


# ------------------------------------------------------------------ ticks
_SI = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def _nice_step(span: float, n: int) -> float:
    """The 1, 2 or 5 x 10^k step nearest (on a log scale) to ``span / n``, as d3's ticks
    pick it: ``n`` = 5 gives 3 to 9 ticks."""
    raw = span / max(1, n)
    mag = 10.0 ** math.floor(math.log10(raw))
    err = raw / mag
    if err >= math.sqrt(50):
        return 10 * mag
    if err >= math.sqrt(10):
        return 5 * mag
    if err >= math.sqrt(2):
        return 2 * mag
    return mag


def _decimals(step: float) -> int:
    """Decimals that tell ticks ``step`` apart (0.05: 2; 0.5: 1; 20: 0)."""
    return max(0, -math.floor(math.log10(step) + 1e-9))


def _fmt_ticks(values: list[float], step: float) -> list[str]:
    """Labels for ticks ``step`` apart, one format for all of them: ``0.05``, ``1,500``,
    ``20k`` (10^4 and more: k, M, G, T), ``2.5e-4`` (values under 10^-3 whose steps need
    more than 4 decimals), ``0.693102`` (a narrow range: the decimals it takes)."""
    big = max(abs(v) for v in values)
    if big >= 1e4:
        unit, suffix = next((u, s) for u, s in _SI if big >= u)
        d = _decimals(step / unit)
        return ["0" if v == 0 else f"{v / unit:,.{d}f}{suffix}" for v in values]
    d = _decimals(step)
    if d > 4 and 0 < big < 1e-3:  # tiny: a mantissa and the exponent of the largest
        e = math.floor(math.log10(big))
        dm = max(0, e - math.floor(math.log10(step) + 1e-9))
        return ["0" if v == 0 else f"{v / 10.0**e:.{dm}f}e{e}" for v in values]
    return [f"{0.0 if v == 0 else v:,.{d}f}" for v in values]


def _fmt_round(v: float) -> str:
    """One round value (a decade, or 1, 2, 5 x 10^k) on its own: ``0.002``, ``50``,
    ``2,000``, ``20k``, ``2e-4``."""
    if v >= 1e4:
        unit, suffix = next((u, s) for u, s in _SI if v >= u)
        return f"{v / unit:g}{suffix}"
    if v < 1e-3:
        e = math.floor(math.log10(v) + 1e-9)
        return f"{v / 10.0**e:g}e{e}"
    return f"{v:,.{_decimals(v)}f}"


def nice_ticks(
    lo: float, hi: float, *, log: bool = False, integer: bool = False, n: int = 5
) -> list[tuple[float, str]]:
    """Round ticks inside ``lo``..``hi``, as (position, label), the labels formatted for
    the range. Linear: about ``n`` ticks 1, 2 or 5 x 10^k apart (``integer``: never less
    than 1 apart: steps). ``log``: ``lo`` and ``hi`` are log10 units and so are the
    positions; decades where three or more fit (every 2nd, 3rd... when many do), else the
    1, 2, 5 x 10^k values when three fit, else two decades, else round values as on a
    linear axis."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [(lo, _fmt_round(10.0**lo) if log else _fmt_ticks([lo], 1.0)[0])]
    if log:
        k0, k1 = math.ceil(lo - 1e-9), math.floor(hi + 1e-9)
        if k1 - k0 >= 2:  # three decades or more
            every = max(1, math.ceil((k1 - k0) / n))
            ks = [k for k in range(k0, k1 + 1) if k % every == 0]
            return [(float(k), _fmt_round(10.0**k)) for k in ks]
        vals = [
            m * 10.0**k
            for k in range(math.floor(lo) - 1, math.ceil(hi) + 1)
            for m in (1, 2, 5)
            if lo - 1e-9 <= math.log10(m) + k <= hi + 1e-9
        ]
        if len(vals) >= 3:
            return [(math.log10(v), _fmt_round(v)) for v in vals]
        if k1 > k0:  # two decades
            return [(float(k), _fmt_round(10.0**k)) for k in (k0, k1)]
        a, b = 10.0**lo, 10.0**hi
        lin = nice_ticks(a, b, n=max(2, n - 1))
        return [(math.log10(v), lab) for v, lab in lin if v > 0]
    step = _nice_step(hi - lo, n)
    if integer:
        step = max(step, 1.0)
    first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    values = [k * step for k in range(first, last + 1)]
    if not values:
        values = [lo]
    return list(zip(values, _fmt_ticks(values, step)))
