"""Lightning's defaults on hvdnb's ranks (issue 46, item 4): ``devices="auto"`` (a bare
``Trainer()``, ``Fabric(devices="auto")``) is the cluster's ranks, as under torchrun on a GPU
node it is every GPU of the node, so one model trains over the cluster at any size; a count
the user gives keeps Lightning's own behaviour.

One real cluster (mpiexec, gloo) at 2 ranks, restarted at 3 and 1 (``%dist restart``) to
show that nothing is hard-coded. The hooks' pure part: tests/unit/test_lightning_devices.py.
"""

from __future__ import annotations

import math

import pytest

import hvdnb
from hvdnb import DistributedCellError
from tests.integration.test_frameworks import LIT

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(300)]

pytest.importorskip("lightning")
pytest.importorskip("pytorch_lightning")

SAMPLES, BATCH = 48, 8

#: a bare Trainer (devices left out); the tuple each rank answers
TRAINER = f"""
import torch, torch.nn as nn, torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
import PKG as L
_g = torch.Generator().manual_seed(0)
X = torch.randn({SAMPLES}, 8, generator=_g); Y = X.sum(1, keepdim=True)

{LIT}
torch.manual_seed(dist.get_rank())  # each rank its own start: DDP must even them
lit = Lit()
trainer = L.Trainer(max_epochs=1EXTRA, enable_progress_bar=False, logger=False,
                    enable_checkpointing=False, enable_model_summary=False)
trainer.fit(lit, DataLoader(TensorDataset(X, Y), batch_size={BATCH}))
_t = torch.cat([p.detach().flatten() for p in lit.parameters()])
_all = [torch.zeros_like(_t) for _ in range(dist.get_world_size())]
dist.all_gather(_all, _t)
(trainer.world_size, trainer.num_devices, trainer.num_nodes, type(trainer.strategy).__name__,
 trainer.num_training_batches, all(torch.equal(_all[0], w) for w in _all))
"""

FABRIC = """
import torch, lightning as L
fabric = L.Fabric(accelerator="cpu", devices=DEVICES)
fabric.launch()
(fabric.world_size, fabric.global_rank, int(fabric.all_reduce(torch.ones(1), reduce_op="sum").item()))
"""


def distributed(shell, code: str) -> dict:
    """The cell's value on each rank, as ``%%distributed -o`` keeps it."""
    shell.run_cell_magic("distributed", "-q -o _r", code)
    return shell.user_ns["_r"]


def restart(shell, n: int) -> None:
    over = " --oversubscribe" if n > 2 else ""
    shell.run_line_magic("dist", f"restart -n {n}{over} --timeout 120")
    c = hvdnb.current()
    assert c is not None and c.running and c.n == n


def bare_trainer(shell, capsys, n: int, pkg: str = "lightning", extra: str = "") -> None:
    capsys.readouterr()
    r = distributed(shell, TRAINER.replace("PKG", pkg).replace("EXTRA", extra))
    batches = math.ceil(SAMPLES / BATCH / n)
    strategy = "DDPStrategy" if n > 1 else "SingleDeviceStrategy"
    assert r == dict.fromkeys(range(n), (n, n, 1, strategy, batches, True)), r
    assert "trains a model of its own" not in capsys.readouterr().out


def fabric_auto(shell, n: int) -> None:
    r = distributed(shell, FABRIC.replace("DEVICES", "'auto'"))
    assert r == {rank: (n, rank, n) for rank in range(n)}, r


@pytest.mark.parametrize("pkg", ["lightning", "pytorch_lightning"])
def test_a_bare_trainer_trains_one_model_over_the_cluster(shell, dist2, capsys, pkg):
    bare_trainer(shell, capsys, 2, pkg)
    bare_trainer(shell, capsys, 2, pkg, extra=", devices='auto', strategy='ddp'")


def test_fabric_auto_is_the_cluster(shell, dist2):
    fabric_auto(shell, 2)


def test_an_explicit_count_is_lightnings_own(shell, dist2, capsys):
    # Trainer(devices=1): Lightning's one device, each rank alone, said in one line
    capsys.readouterr()
    r = distributed(
        shell,
        TRAINER.replace("PKG", "lightning").replace("EXTRA", ", devices=1")
        + "\n(trainer.world_size, type(trainer.strategy).__name__)",
    )
    assert r == dict.fromkeys(range(2), (1, "SingleDeviceStrategy")), r
    text = capsys.readouterr().out
    assert "each of the 2 ranks trains a model of its own" in text
    assert "leave devices out" in text and "devices=2" not in text
    # Fabric(devices=1) with DDP: Lightning's own check, on every rank
    with pytest.raises(DistributedCellError) as e:
        distributed(shell, FABRIC.replace("DEVICES", "1, strategy='ddp'"))
    assert e.value.failed_ranks == [0, 1], str(e.value)
    assert "the product (1 * 1) does not match the world size (2)" in str(e.value)


def test_auto_follows_a_restart(shell, dist2, capsys):
    """Nothing hard-coded: the same cells at 3 ranks and at 1."""
    restart(shell, 3)
    bare_trainer(shell, capsys, 3)
    fabric_auto(shell, 3)
    restart(shell, 1)
    bare_trainer(shell, capsys, 1)
    fabric_auto(shell, 1)
