"""Lightning (``lightning`` and ``pytorch_lightning``, Trainer and Fabric) on the ranks.

- The ranks are torchrun's: hvdnb sets torchrun's variables, and ``TORCHELASTIC_RUN_ID``
  too, so Lightning picks its own ``TorchElasticEnvironment``, whose processes are created
  outside Lightning: ``strategy="ddp"`` with ``devices`` the ranks on each host (and
  ``num_nodes`` the hosts) trains over the cluster's ranks and its group, spawning nothing.
- An engine runs IPython, so Lightning takes it for an interactive session (``sys.ps1``)
  and refuses DDP there. A rank's processes are made by mpiexec, not by the session, so its
  flag ``_IS_INTERACTIVE`` is set to False when ``lightning.fabric.utilities.imports`` (or
  ``lightning_fabric``'s) loads, before any other Lightning module reads it. (A patch of
  one module constant, written for Lightning 2.6.)
- ``ddp_notebook``, ``ddp_fork`` and ``ddp_spawn`` (the strategies Lightning's own error
  message recommends in a notebook) are re-registered in Lightning's strategy registry as
  the same DDP with ``start_method="popen"``: on a rank they train over the existing ranks
  like ``ddp`` and never fork.
- ``devices="auto"`` (the default of ``Trainer`` and ``Fabric``) is the cluster's ranks:
  ``devices`` the ranks on this host (``LOCAL_WORLD_SIZE``) and ``num_nodes`` the hosts
  (``WORLD_SIZE // LOCAL_WORLD_SIZE``), as under torchrun on a GPU node "auto" is every GPU
  of the node, so a bare ``Trainer()`` trains one model over the cluster. Lightning turns
  "auto" into a count in one method of its connectors (``_AcceleratorConnector`` for the
  Trainer, ``_Connector`` for Fabric), ``_set_devices_flag_if_auto_passed``; on a rank that
  method is replaced (a patch of a private method, written for Lightning 2.6). A count the
  user gives is Lightning's own, its checks and errors included; so is a ``num_nodes``
  other than 1.
- ``lightning_callbacks`` / ``pytorch_lightning_callbacks`` are Lightning's callbacks entry
  points (``pyproject.toml``): on a rank every Trainer gets ``HvdnbCallback`` (each rank's
  loss every step, the learning-rate knobs, and the check that ``devices`` x
  ``num_nodes`` are the cluster's ranks); outside a rank they return no callback.

An explicit ``Trainer(devices=1)`` on several ranks keeps Lightning's choice, one device:
each rank trains a model of its own. hvdnb says so in one line (and that leaving
``devices`` out trains over the cluster).

Never: import Lightning before the user does; add a callback or change "auto" outside an
hvdnb rank.
"""

from __future__ import annotations

import sys
from typing import Any

from hvdnb.rank.frameworks.common import (
    Place,
    installed,
    note,
    on_import,
    setdefault_env,
    warn_version,
)

__all__ = ["install", "lightning_callbacks", "pytorch_lightning_callbacks"]

_FORKING = ("spawn", "fork", "forkserver")


def install(p: Place) -> None:
    """Make the ranks torchrun's in Lightning's eyes; hook its modules as they load."""
    setdefault_env(
        TORCHELASTIC_RUN_ID="hvdnb",
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        GROUP_WORLD_SIZE=str(p.nodes),
        ROLE_NAME="default",
        ROLE_RANK=str(p.rank),
        ROLE_WORLD_SIZE=str(p.size),
    )
    for pkg in ("lightning.fabric", "lightning_fabric"):
        on_import(f"{pkg}.utilities.imports", _not_interactive)
        on_import(f"{pkg}.strategies", lambda m: _no_forking(m.STRATEGY_REGISTRY))
        on_import(f"{pkg}.connector", lambda m: _auto_is_the_cluster(m._Connector, "Fabric"))
    for pkg in ("lightning.pytorch", "pytorch_lightning"):
        on_import(f"{pkg}.strategies", lambda m: _no_forking(m.StrategyRegistry))
        on_import(
            f"{pkg}.trainer.connectors.accelerator_connector",
            lambda m: _auto_is_the_cluster(m._AcceleratorConnector, "Trainer"),
        )


def _not_interactive(mod: Any) -> None:
    warn_version("lightning" if mod.__name__.startswith("lightning.") else "pytorch-lightning")
    mod._IS_INTERACTIVE = False


def _no_forking(registry: Any) -> None:
    for name, data in list(registry.items()):
        params = dict(data.get("init_params", {}))
        if params.get("start_method") not in _FORKING:
            continue
        params["start_method"] = "popen"
        registry.register(
            name,
            data["strategy"],
            description=f"{data.get('description', '')}; on an hvdnb rank: the cluster's ranks",
            override=True,
            **params,
        )


def _auto_is_the_cluster(connector: type, who: str) -> None:
    """Replace ``connector._set_devices_flag_if_auto_passed`` (Lightning 2.6: the one place
    its Trainer's and Fabric's connectors turn ``devices="auto"`` into a count, after the
    accelerator is made and before ``parse_devices``) with ``auto_devices`` on a rank."""
    own = connector._set_devices_flag_if_auto_passed  # type: ignore[attr-defined]
    if getattr(own, "__hvdnb__", False):
        return

    def _set_devices_flag_if_auto_passed(self: Any) -> None:
        p = installed()
        if p is None or not isinstance(self._devices_flag, str) or self._devices_flag != "auto":
            own(self)
            return
        acc = self.accelerator
        cpu = any(c.__name__ == "CPUAccelerator" for c in type(acc).__mro__)
        self._devices_flag, self._num_nodes_flag = auto_devices(
            p,
            self._num_nodes_flag,
            None if cpu else int(acc.auto_device_count()),
            f"{who}(devices='auto')",
        )

    _set_devices_flag_if_auto_passed.__hvdnb__ = True  # type: ignore[attr-defined]
    connector._set_devices_flag_if_auto_passed = _set_devices_flag_if_auto_passed  # type: ignore[attr-defined]


def auto_devices(p: Place, num_nodes: int, available: int | None, call: str) -> tuple[int, int]:
    """``(devices, num_nodes)`` for ``devices="auto"`` on a rank: the ranks on this host, and
    the hosts (a ``num_nodes`` other than 1, given by the user, is kept: Lightning checks it).

    ``available`` is how many devices of its kind the accelerator sees on this host (None on
    the CPU, where any count goes); Lightning gives each rank of a host a device of its own,
    so more ranks than devices on a host raise, naming what would fit."""
    if available is not None and p.local_size > available:
        raise ValueError(
            f"{call} on rank {p.rank}: this host runs {p.local_size} ranks and Lightning gives "
            f"each rank a device of its own, but it sees {available} device(s) here: start "
            f"{available} rank(s) per host (%dist restart -n {max(available, 1) * p.nodes}), "
            "or pass accelerator='cpu'"
        )
    return p.local_size, p.nodes if num_nodes == 1 else num_nodes


def lightning_callbacks() -> list[Any]:
    """Entry point ``lightning.pytorch.callbacks_factory``: hvdnb's callback on a rank."""
    return _callbacks("lightning.pytorch")


def pytorch_lightning_callbacks() -> list[Any]:
    """Entry point ``pytorch_lightning.callbacks_factory``: hvdnb's callback on a rank."""
    return _callbacks("pytorch_lightning")


def _callbacks(pkg: str) -> list[Any]:
    p = installed()
    if p is None:
        return []
    base = sys.modules.get(f"{pkg}.callbacks")
    if base is None:
        return []
    return [_callback_class(base.Callback, p)()]


def _callback_class(base: type, p: Place) -> Any:
    from hvdnb.rank.frameworks.lrknobs import LrKnobs  # noqa: PLC0415  knobs: with the framework only
    from hvdnb.rank.metrics.recorder import log  # noqa: PLC0415  the recorder, with the framework only

    class HvdnbCallback(base):  # type: ignore[misc]
        """hvdnb's panel for a Lightning Trainer: each rank's loss, the learning-rate
        knobs, and the cluster check."""

        def __init__(self) -> None:
            self.lr: LrKnobs | None = None
            self.batches = 0

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            check_trainer(trainer, p)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.batches = 0
            opts = list(getattr(trainer, "optimizers", []) or [])
            self.lr = LrKnobs(opts[0]) if opts else None

        def on_train_batch_start(
            self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
        ) -> None:
            opts = list(getattr(trainer, "optimizers", []) or [])
            if self.lr is not None and opts:
                self.lr.at_step(self.batches, opts[0])

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if loss is not None and hasattr(loss, "detach"):
                loss = loss.detach()
            n = batch_len(batch)
            if n is None:
                log(self.batches, loss)
            else:
                log(self.batches, loss, samples=n)
            self.batches += 1

    return HvdnbCallback


def batch_len(batch: Any) -> int | None:
    """Samples in a batch: the length of its first tensor (a tensor, or the first of a
    tuple, list or dict of them); None when it has none."""
    first = batch
    for _ in range(3):
        if isinstance(first, dict):
            first = next(iter(first.values()), None)
        elif isinstance(first, (list, tuple)):
            first = first[0] if first else None
        else:
            break
    shape = getattr(first, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) > 0 else None


def check_trainer(trainer: Any, p: Place) -> None:
    """Raise when the Trainer's ``devices`` x ``num_nodes`` are not the cluster's ranks;
    say in one line what a one-device Trainer on several ranks does."""
    devices, nodes = int(trainer.num_devices), int(trainer.num_nodes)
    if devices * nodes == 1 and p.size > 1:
        note(
            f"this Trainer uses one device per rank, so each of the {p.size} ranks trains a "
            "model of its own; to train one model over the cluster, leave devices out "
            "(devices='auto' is the cluster's ranks)"
        )
        return
    if devices * nodes != p.size or devices != p.local_size:
        raise ValueError(
            f"Trainer(devices={devices}, num_nodes={nodes}) on rank {p.rank}: the cluster has "
            f"{p.local_size} rank(s) on this host and {p.size} in all ({p.nodes} host(s)); "
            "Lightning trains over the cluster's ranks. Leave devices"
            + (" and num_nodes" if nodes > 1 else "")
            + f" out (devices='auto' is the cluster's ranks), or %dist restart -n {devices * nodes}"
        )
