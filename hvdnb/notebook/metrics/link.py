"""The cluster a ``MetricsStore`` is fed from, and what its ranks said of themselves.

Owns: the cluster handle and its side channel (``MetricsStore.attach`` sets them; tests
and benches hand it a channel of their own), which cluster this is (``number``: how many
were attached, 0: none yet; ``info``: ``{"n", "backend", "device"}`` as the cluster said),
what each of its ranks said of itself (``rank_info``: host, local_rank and pid once; the
loop's step, step time, backend, idle and when it was seen, with every message), the
ranks a plan is forwarded to (``targets``) and sending to them.

Its fields change under the point store's lock, taken by the caller (``begin`` and
``note`` are *lock held*). Never: import the cluster's modules (a cluster is read for
``channel``, ``client.ids``, ``hosts_seen`` and ``n`` / ``backend`` / ``device`` only),
block, or raise on a cluster that is going away.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["Link"]


class Link:
    """The store's side of one cluster: its channel, its number and its ranks' words."""

    def __init__(self) -> None:
        self.cluster: Any = None
        self.channel: Any = None
        self.number = 0
        self.info: dict[str, Any] = {}
        #: per rank: what it said of itself (host, local_rank, pid) and of its loop
        #: (step, step_time, backend, idle, seen)
        self.rank_info: dict[int, dict[str, Any]] = {}
        #: when this cluster's start began (``time.time()``; None: not known): readings of
        #: a rank of the same number taken before it are an earlier cluster's
        self.began: float | None = None

    def begin(self, cluster: Any) -> None:
        """A new cluster (a start or a restart: a new channel), lock held: its ranks are
        the ones it has, known by the hello each sent before its start returned."""
        self.rank_info.clear()
        for r, host in dict(getattr(cluster, "hosts_seen", None) or {}).items():
            self.rank_info[r] = {"host": host}
        self.number += 1
        self.info = {k: getattr(cluster, k, None) for k in ("n", "backend", "device")}
        at, took = getattr(cluster, "started_at", None), getattr(cluster, "start_seconds", None)
        if isinstance(at, (int, float)) and isinstance(took, (int, float)):
            self.began = float(at) - float(took)
        else:  # a stand-in cluster (tests, benches): nothing to tell apart
            self.began = None

    def note(self, rank: int, fields: dict[str, Any]) -> None:
        """What ``rank`` just said of itself (lock held)."""
        info = self.rank_info.get(rank)
        if info is None:
            info = self.rank_info[rank] = {}
        info.update(fields)

    def heard(self) -> set[int]:
        """The ranks connected to the side channel, and any that said where they run
        (read on the channel's thread: the cluster's client is not asked)."""
        return {*self.rank_info, *getattr(self.channel, "ranks", ())}

    def targets(self) -> list[int]:
        """The ranks a plan goes to: the cluster's engines, else the channel's ranks."""
        c = self.cluster
        try:
            ids = list(c.client.ids) if c is not None and c.client is not None else None
        except Exception:  # a cluster going away: fall back on the channel
            ids = None
        if ids:
            return sorted(ids)
        ch = self.channel
        return list(ch.ranks) if ch is not None else []

    def forward(self, kind: Any, payload: Mapping[str, Any]) -> None:
        """Send ``payload`` as ``kind`` to every rank of ``targets``."""
        ch = self.channel
        if ch is not None:
            for r in self.targets():
                ch.send(r, kind, **payload)
