"""Rank labels: ``[0]``, ``[0,1]``, ``[0-3]``, ``[0,2,4-7]``, written and read back.

Owns: the one way the notebook names a set of ranks (merged output, errors, knob changes,
``%dist status``). Pure. Never: import another part of hvdnb (every package of the notebook
side reads it).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["format_ranks", "parse_ranks"]


def format_ranks(ranks: Iterable[int]) -> str:
    """A compact label for a set of ranks: ``0``, ``0,1``, ``0-3``, ``0,2,4-7``."""
    rs = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{rs[i]}-{rs[j]}")
        else:
            parts.extend(str(r) for r in rs[i : j + 1])
        i = j + 1
    return ",".join(parts)


def parse_ranks(label: str) -> list[int]:
    """The inverse of ``format_ranks``: ``0,2,4-7`` as ``[0, 2, 4, 5, 6, 7]``."""
    out: list[int] = []
    for part in label.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out
