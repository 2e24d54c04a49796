"""The code users already have: PyTorch's DDP tutorial, Accelerate, the HF Trainer and
Lightning, run unchanged on hvdnb's ranks, over the cluster's process group.

One module per framework, each meeting it at its own seam where it has one:

============================  =============================================================
``torch_hooks``               ``init_process_group`` / ``destroy_process_group`` in a cell
                              keep the cluster's group; ``torch.multiprocessing.spawn``
                              runs its function once per rank (torch has no seam: a patch)
``ddp_hooks``                 every DDP model's collective timings reach the panel, a
                              user's own comm hook kept (a patch of DDP's constructor)
``accelerate_hooks``          ``ACCELERATE_USE_CPU`` and ``FORK_LAUNCHED`` (Accelerate's own
                              switches), ``notebook_launcher`` once per rank, a tracker
``transformers_hooks``        a ``TrainerCallback`` in the Trainer's default callbacks:
                              the logged loss and the panel's learning-rate knobs
``lightning_hooks``           the ranks are torchrun's (``TORCHELASTIC_RUN_ID``: Lightning's
                              ``TorchElasticEnvironment``), ``devices="auto"`` is the
                              cluster's ranks (Lightning's connectors, a patch),
                              ``ddp_notebook`` / ``ddp_fork`` re-registered in Lightning's
                              strategy registry, a callback from Lightning's callbacks
                              entry point
============================  =============================================================

``install`` runs once per rank, in the engine's bootstrap and an exported script's
``init``, so a ``%dist restart`` (fresh engines) installs again. Outside a rank nothing is
installed: the Lightning entry point returns no callback there. A framework's hooks are
placed when it is first imported (``wrapt``'s post-import hooks), so a rank that never
imports Accelerate never pays for it.

Owns: the table of tested versions (``TESTED``) and the one warning for another version.
Never: import a framework before the user does, or change anything outside a rank.
"""

from __future__ import annotations

import sys

from hvdnb.config import get_config
from hvdnb.rank.frameworks import (
    accelerate_hooks,
    ddp_hooks,
    lightning_hooks,
    torch_hooks,
    transformers_hooks,
)
from hvdnb.rank.frameworks.common import Place, installed, new_cell, replace_place, set_place

__all__ = ["Place", "install", "installed", "move", "new_cell"]


def install(p: Place) -> None:
    """Install every framework's hooks on this rank (once per process; none with
    ``HVDNB_FRAMEWORKS=0``)."""
    if not get_config().frameworks or not set_place(p):
        return
    torch_hooks.install(p)
    ddp_hooks.install(p)
    accelerate_hooks.install(p)
    transformers_hooks.install(p)
    lightning_hooks.install(p)


def move(p: Place) -> None:
    """This rank's place after an elastic cluster formed a new generation: the hooks'
    checks (``init_process_group``'s world size, ``notebook_launcher``'s count) and the
    torchrun-style variables follow it. Accelerate's shared state is forgotten, so the
    next ``Accelerator()`` reads the new world (objects it prepared hold the old group:
    the training function makes them again, as Horovod's elastic rule asks)."""
    if installed() is None:
        return
    replace_place(p)
    torch_hooks.move(p)
    accelerate_hooks.move(p)
    acc_state = sys.modules.get("accelerate.state")
    if acc_state is not None:
        for name in ("AcceleratorState", "PartialState"):
            cls = getattr(acc_state, name, None)
            reset = getattr(cls, "_reset_state", None)
            if reset is not None:
                try:
                    reset(True) if name == "AcceleratorState" else reset()
                except Exception:  # a version without the flag: forget it all the same
                    pass
