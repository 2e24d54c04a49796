"""Parameter fingerprints waiting for the recorder's next message.

Owns: ``Fingerprints`` (a bounded queue: a loop that never sends keeps only the newest; its
values read at the pack). Appended from the training thread or DDP's hook thread
(``hvdnb.rank.metrics.fingerprint``), taken by the pack. Never: wait in the step (a CUDA
fingerprint is read at the pack, off the step), import torch.
"""

from __future__ import annotations

from collections import deque
from typing import Any

__all__ = ["Fingerprints"]


class Fingerprints:
    """Fingerprints queued since the last pack (``deque.append`` is atomic: any thread)."""

    __slots__ = ("_q",)

    def __init__(self, maxlen: int = 256) -> None:
        self._q: deque[dict[str, Any]] = deque(maxlen=maxlen)

    def __len__(self) -> int:
        return len(self._q)

    def add(self, entry: dict[str, Any]) -> None:
        """Queue ``entry`` (``sums`` and ``scale``: lists, or tensors read at ``take``)."""
        self._q.append(entry)

    def take(self) -> list[dict[str, Any]]:
        """The queued fingerprints, their values read now as lists of floats (a CUDA
        fingerprint waits for its device here, off the step); one that cannot be read (a
        device gone, a tensor freed) is dropped."""
        out = []
        q = self._q
        while q:
            e = q.popleft()
            try:
                for k in ("sums", "scale"):
                    v = e[k]
                    e[k] = [float(x) for x in (v.tolist() if hasattr(v, "tolist") else v)]
            except Exception:
                continue
            out.append(e)
        return out
