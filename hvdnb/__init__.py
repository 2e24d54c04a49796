"""hvdnb: interactive, Horovod-style distributed training driven from JupyterLab.

In a notebook::

    %load_ext hvdnb
    %dist start -n 2

    %%distributed
    import torch, torch.distributed as dist
    ...

From Python::

    import hvdnb
    with hvdnb.Cluster(n=2) as cluster:
        hvdnb.run_cell(cluster, "import torch.distributed as d; print(d.get_rank())")

``hvdnb.torch`` speaks Horovod's torch API (``import hvdnb.torch as hvd``).

This module is the public surface of both sides. What a rank's training loop calls (``log``,
``phase``, ``knobs``, ``State``, ``ddp_comm_hook``, ``keras_callback``, ``TrainingStopped``,
``require_ranks``) is imported at once; what only the notebook kernel uses (``Cluster``,
``run_cell``, ``set_knobs``, ``watch``, the magics) is imported on first use, so
``import hvdnb`` on a rank never loads the notebook side.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from hvdnb import (
    elastic,  # hvdnb.elastic.run: a loop that survives a rank's death
    metrics,  # a callable module: hvdnb.metrics() returns every point as rows
)
from hvdnb.config import Config, get_config
from hvdnb.rank.frameworks.accelerate_hooks import tracker as accelerate_tracker
from hvdnb.rank.keras import keras_callback  # imports keras only when called
from hvdnb.rank.metrics.ddp import ddp_comm_hook
from hvdnb.rank.metrics.knobs import knobs
from hvdnb.rank.metrics.recorder import TrainingStopped, log, phase
from hvdnb.rank.require import NotEnoughRanks, require_ranks
from hvdnb.rank.state import State

if TYPE_CHECKING:
    from hvdnb.notebook.cellout.cells import CellResult, DistributedCellError, run_cell
    from hvdnb.notebook.cluster.lifecycle import Cluster, current
    from hvdnb.notebook.cluster.spec import ClusterError
    from hvdnb.notebook.metrics.history import import_runs, runs
    from hvdnb.notebook.metrics.store import set_knobs, watch
    from hvdnb.notebook.tf.tfcoord import ClusterCoordinator
    from hvdnb.notebook.tf.tfps import tf_cluster_resolver

__version__ = "0.1.0"

__all__ = [
    "CellResult",
    "Cluster",
    "ClusterCoordinator",
    "ClusterError",
    "Config",
    "DistributedCellError",
    "NotEnoughRanks",
    "State",
    "TrainingStopped",
    "accelerate_tracker",
    "current",
    "ddp_comm_hook",
    "elastic",
    "get_config",
    "import_runs",
    "keras_callback",
    "knobs",
    "load_ipython_extension",
    "log",
    "metrics",
    "phase",
    "require_ranks",
    "run_cell",
    "runs",
    "set_knobs",
    "tf_cluster_resolver",
    "unload_ipython_extension",
    "watch",
]

# Notebook-side names, imported when first asked for (PEP 562).
_LAZY = {
    "CellResult": "hvdnb.notebook.cellout.cells",
    "DistributedCellError": "hvdnb.notebook.cellout.cells",
    "run_cell": "hvdnb.notebook.cellout.cells",
    "Cluster": "hvdnb.notebook.cluster.lifecycle",
    "ClusterError": "hvdnb.notebook.cluster.spec",
    "current": "hvdnb.notebook.cluster.lifecycle",
    "set_knobs": "hvdnb.notebook.metrics.store",
    "runs": "hvdnb.notebook.metrics.history",
    "import_runs": "hvdnb.notebook.metrics.history",
    "watch": "hvdnb.notebook.metrics.store",
    "tf_cluster_resolver": "hvdnb.notebook.tf.tfps",
    "ClusterCoordinator": "hvdnb.notebook.tf.tfcoord",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hvdnb' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext hvdnb``: register ``%dist`` and ``%%distributed``, and name the install
    command under a cell's "No module named ..." for hvdnb's optional dependencies."""
    from hvdnb.notebook.cellout import automode, introspect  # noqa: PLC0415  side separation: the facade loads the notebook side lazily (PEP 562)
    from hvdnb.notebook.ipython import importhint  # noqa: PLC0415  side separation: the facade loads the notebook side lazily (PEP 562)
    from hvdnb.notebook.ipython.magics import DistMagics  # noqa: PLC0415  side separation: the facade loads the notebook side lazily (PEP 562)

    # TensorFlow's C++ INFO log at import (a dozen "I0000 ..." lines); the kernel imports
    # TensorFlow when a rank's value of a Keras type is shown here. The user's level is kept
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    ipython.register_magics(DistMagics)
    importhint.install(ipython)
    automode.install(ipython)
    introspect.install(ipython)
    from hvdnb.notebook.debug import router  # noqa: PLC0415  side separation: the facade loads the notebook side lazily (PEP 562)

    router.install(ipython)  # JupyterLab's visual debugger reaches the ranks


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext hvdnb``: stop the running cluster so nothing is left behind."""
    from hvdnb.notebook.cluster.lifecycle import current  # noqa: PLC0415  side separation: the facade loads the notebook side lazily (PEP 562)
    from hvdnb.notebook.ipython import importhint  # noqa: PLC0415  side separation: the facade loads the notebook side lazily (PEP 562)

    importhint.uninstall(ipython)
    c = current()
    if c is not None:
        c.stop()
