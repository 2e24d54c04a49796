"""``hvdnb.metrics``: the live panel's data, from both sides.

Rank side (imported at once; no torch import, no collectives): ``log``, ``phase``,
``set_enabled``, ``get_recorder``, ``ddp_comm_hook`` and the knobs a loop reads (``knobs``,
``Knobs``), from ``hvdnb.rank.metrics``. Notebook side (imported on first use, so a rank
never loads it): ``metrics()`` and the store's types, ``set_knobs``, from
``hvdnb.notebook.metrics``.

The module itself is callable: ``hvdnb.metrics()`` returns every point as rows (see
``hvdnb.notebook.metrics.store.metrics``). ``hvdnb.metrics.load(DIR)`` returns the same
rows for a batch run: what an exported script wrote with ``HVDNB_METRICS_DIR=DIR`` (see
``hvdnb.notebook.metrics.files``)::

    df = hvdnb.metrics.load("out").to_pandas()

``hvdnb.metrics(run="a3f9c1-2")`` reads a run of the run store (``hvdnb.runs()``), from
any session; ``.to_tensorboard(DIR)`` writes rows as TensorBoard event files.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from hvdnb.rank.metrics.ddp import ddp_comm_hook
from hvdnb.rank.metrics.knobs import Knobs, knobs
from hvdnb.rank.metrics.recorder import get_recorder, log, phase, set_enabled

if TYPE_CHECKING:
    from hvdnb.notebook.metrics.files import load, load_store
    from hvdnb.notebook.metrics.store import (
        MetricRow,
        MetricRows,
        MetricsStore,
        attach,
        get_store,
        metrics,
        set_knobs,
    )

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
    "load",
    "load_store",
    "log",
    "metrics",
    "phase",
    "set_enabled",
    "set_knobs",
]

_LAZY = {
    "MetricRow": "hvdnb.notebook.metrics.store",
    "MetricRows": "hvdnb.notebook.metrics.store",
    "MetricsStore": "hvdnb.notebook.metrics.store",
    "attach": "hvdnb.notebook.metrics.store",
    "get_store": "hvdnb.notebook.metrics.store",
    "load": "hvdnb.notebook.metrics.files",
    "load_store": "hvdnb.notebook.metrics.files",
    "metrics": "hvdnb.notebook.metrics.store",
    "set_knobs": "hvdnb.notebook.metrics.store",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hvdnb.metrics' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


class _CallableModule(types.ModuleType):
    """``hvdnb.metrics(name=None, rank=None, run=None)``: every point as rows; ``run`` an id
    of ``hvdnb.runs()``: that run of the run store, whichever session logged it."""

    def __call__(
        self, name: str | None = None, rank: int | None = None, run: int | str | None = None
    ) -> MetricRows:
        rows: MetricRows = __getattr__("metrics")(name, rank, run)
        return rows

    def __getattr__(self, name: str) -> Any:
        return __getattr__(name)

    def __repr__(self) -> str:
        return "<module 'hvdnb.metrics' (callable: hvdnb.metrics() returns every point)>"


sys.modules[__name__].__class__ = _CallableModule
