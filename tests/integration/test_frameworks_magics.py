"""The frameworks through the magics a user types: ``%%distributed`` cells in a session,
the hooks surviving ``%dist restart`` (fresh engines install them again), and nothing
of them in the notebook kernel itself."""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(300)]

pytest.importorskip("accelerate")
pytest.importorskip("lightning")

ACCELERATE = """
from accelerate import Accelerator, PartialState
PartialState._reset_state()  # a fresh state per cell, as a new Accelerator in a new kernel
acc = Accelerator()
(acc.num_processes, str(acc.distributed_type))
"""

LIGHTNING = """
import torch, torch.nn as nn, lightning as L
from torch.utils.data import DataLoader, TensorDataset
class Lit(L.LightningModule):
    def __init__(self):
        super().__init__(); self.lin = nn.Linear(4, 1)
    def training_step(self, batch, i):
        return nn.functional.mse_loss(self.lin(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
X = torch.randn(32, 4)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_notebook", max_epochs=1,
                    enable_progress_bar=False, logger=False, enable_checkpointing=False,
                    enable_model_summary=False)
trainer.fit(Lit(), DataLoader(TensorDataset(X, X.sum(1, keepdim=True)), batch_size=4))
trainer.world_size
"""


def test_frameworks_in_cells_survive_restart_and_stay_off_the_kernel(dist2, shell, capsys):
    for _ in range(2):  # before and after %dist restart
        shell.run_cell_magic("distributed", "-q -o r", ACCELERATE)
        assert shell.user_ns["r"] == dict.fromkeys((0, 1), (2, "DistributedType.MULTI_CPU"))
        shell.run_cell_magic("distributed", "-q -o r", LIGHTNING)
        assert shell.user_ns["r"] == {0: 2, 1: 2}
        shell.run_line_magic("dist", "restart")
    capsys.readouterr()
    # the kernel is no rank: none of the ranks' switches, no Lightning callback
    for var in ("TORCHELASTIC_RUN_ID", "ACCELERATE_USE_CPU", "FORK_LAUNCHED"):
        assert var not in os.environ, var
    from lightning.fabric.utilities.registry import _load_external_callbacks

    assert _load_external_callbacks("lightning.pytorch.callbacks_factory") == []
