"""Adasum's combination of rank vectors (Horovod's ``op=hvd.Adasum``).

Owns: ``adasum_tree``, the pairwise combination in the order of Horovod's recursive
halving, computed locally on every rank from the gathered vectors (``reduce.py`` gathers
them). Never: communicate, or depend on anything but torch.
"""

from __future__ import annotations

import torch

__all__ = ["adasum_tree"]


def adasum_tree(parts: torch.Tensor) -> torch.Tensor:
    """Horovod's Adasum of rank vectors (rows of ``parts``, a power-of-two count).

    Pairs at distance 1, 2, 4, ... combine as ``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b``
    (dot products in float64), the order Horovod's recursive halving uses.
    """
    v: list[torch.Tensor] = list(parts)
    d = 1
    while d < len(v):
        for i in range(0, len(v), 2 * d):
            a, b = v[i], v[i + d]
            a64, b64 = a.double(), b.double()
            dot = float(torch.dot(a64, b64))
            na, nb = float(torch.dot(a64, a64)), float(torch.dot(b64, b64))
            ca = 1.0 - dot / (2 * na) if na >= 1e-8 else 1.0
            cb = 1.0 - dot / (2 * nb) if nb >= 1e-8 else 1.0
            v[i] = (a64 * ca + b64 * cb).to(a.dtype)
        d *= 2
    return v[0]
