"""Live metrics: rank-side recording (``log``, ``phase``, ``knobs``) and the notebook's store.

Engine side (imported on ranks, no torch import, no collectives): ``recorder`` (ring buffer,
flusher, allreduce listener, memory sampling) and ``knobs`` (values changed from the panel,
applied on every rank at one step). Notebook side: ``store`` (every point, exports, the
breakdown and hints the panel shows). Widgets live in ``hvdnb.widgets``, never here.

The package itself is callable: ``hvdnb.metrics()`` is ``hvdnb.metrics.store.metrics()``
(every point as rows), while ``hvdnb.metrics.store`` etc. stay importable.
"""

from __future__ import annotations

import sys
import types

from .knobset import Knobs, knobs
from .recorder import ddp_comm_hook, get_recorder, log, phase, set_enabled
from .store import MetricRow, MetricRows, MetricsStore, attach, get_store, metrics, set_knobs

__all__ = [
    "Knobs",
    "MetricRow",
    "MetricRows",
    "MetricsStore",
    "attach",
    "ddp_comm_hook",
    "get_recorder",
    "get_store",
    "knobs",
    "log",
    "metrics",
    "phase",
    "set_enabled",
    "set_knobs",
]


class _CallableModule(types.ModuleType):
    """``hvdnb.metrics(name=None, rank=None)``: see ``hvdnb.metrics.store.metrics``."""

    def __call__(self, name: str | None = None, rank: int | None = None,
                 run: int | None = None) -> MetricRows:
        return metrics(name, rank, run)

    def __repr__(self) -> str:
        return "<module 'hvdnb.metrics' (callable: hvdnb.metrics() returns every point)>"


sys.modules[__name__].__class__ = _CallableModule
