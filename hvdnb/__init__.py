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
"""

from __future__ import annotations

from typing import Any

from .cells import CellResult, DistributedCellError, run_cell
from .cluster import Cluster, ClusterError, current
from .config import Config, get_config
from . import metrics  # a callable module: hvdnb.metrics() returns every point as rows
from .metrics import ddp_comm_hook, knobs, log, phase, set_knobs
from .state import State

__version__ = "0.1.0"

__all__ = [
    "CellResult",
    "Cluster",
    "ClusterError",
    "Config",
    "DistributedCellError",
    "State",
    "current",
    "get_config",
    "load_ipython_extension",
    "run_cell",
    "unload_ipython_extension",
    "ddp_comm_hook",
    "knobs",
    "log",
    "metrics",
    "phase",
    "set_knobs",
]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext hvdnb``: register ``%dist`` and ``%%distributed``."""
    from .magics import DistMagics

    ipython.register_magics(DistMagics)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext hvdnb``: stop the running cluster so nothing is left behind."""
    c = current()
    if c is not None:
        c.stop()
