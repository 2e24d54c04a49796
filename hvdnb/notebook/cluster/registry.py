"""Which cluster ``%dist``, ``%%distributed`` and ``hvdnb.current()`` act on.

Owns: one reference, set by a cluster when it has started and cleared when it stops; read
by ``hvdnb.notebook.cluster.lifecycle.current`` and, handed to it by ``lifecycle`` through
``metrics.store.follow``, by the metrics store (to follow a restarted cluster's new side
channel): the store never imports the cluster's modules.

Never: import anything of hvdnb (both sides of the store/cluster pair read it), start,
stop or inspect a cluster.
"""

from __future__ import annotations

from typing import Any

__all__ = ["current", "forget", "set_current"]

_CURRENT: Any = None


def current() -> Any:
    """The current ``hvdnb.Cluster`` (None before ``%dist start`` and after a stop)."""
    return _CURRENT


def set_current(cluster: Any) -> None:
    """``cluster`` has started: it is the one the notebook acts on now."""
    global _CURRENT
    _CURRENT = cluster


def forget(cluster: Any) -> None:
    """``cluster`` has stopped: no current cluster, unless another has started since."""
    global _CURRENT
    if _CURRENT is cluster:
        _CURRENT = None
