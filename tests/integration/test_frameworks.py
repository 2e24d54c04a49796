"""The code users already have, pasted unchanged into %%distributed cells: PyTorch's DDP
tutorial, Accelerate, the HF Trainer, Lightning (both packages) and Fabric.

World size is a dimension, as everywhere: one real cluster (mpiexec, gloo) per size 1, 2
and 3, and every framework runs on it in turn. Each case checks what a user relies on:
the framework reports the world size, the data is sharded, the ranks end with identical
weights, the next plain cell's collective works, and the panel's store holds the loss
(every rank's where the framework has it per rank, the main process's where it logs only
there). Bad input: a request the cluster cannot serve raises one clear error on every rank.
"""

from __future__ import annotations

import math

import pytest

import hvdnb
from hvdnb import DistributedCellError
from tests.conftest import hvdnb_export

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(600)]

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
pytest.importorskip("lightning")
pytest.importorskip("pytorch_lightning")

SAMPLES, BATCH, EPOCHS = 96, 8, 2

#: every rank's parameters gathered; True when all ranks hold the same
SAME_WEIGHTS = """
import torch, torch.distributed as dist
_t = torch.cat([w.flatten() for w in W]); _g = [torch.zeros_like(_t) for _ in range(dist.get_world_size())]
dist.all_gather(_g, _t)
all(torch.equal(_g[0], x) for x in _g)
"""

#: a plain collective after the framework's cell: the cluster's group still works
NEXT_CELL = """
import torch, torch.distributed as dist
_x = torch.ones(1) * (dist.get_rank() + 1); dist.all_reduce(_x); int(_x.item())
"""

DDP_TUTORIAL = """
import os, torch, torch.nn as nn, torch.optim as optim
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

def setup(rank, world_size):
    os.environ['MASTER_ADDR'] = 'localhost'
    os.environ['MASTER_PORT'] = '12355'
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

def cleanup():
    dist.destroy_process_group()

class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))

def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    for step in range(6):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10))
        labels = torch.randn(20, 5)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
        hvdnb.log(step, loss)
    global W
    W = [p.detach().clone() for p in model.parameters()]
    cleanup()

def run_demo(demo_fn, world_size):
    mp.spawn(demo_fn, args=(world_size,), nprocs=world_size, join=True)

import hvdnb
torch.manual_seed(dist.get_rank())  # each rank its own start: DDP's broadcast must even them
run_demo(demo_basic, int(os.environ["WORLD_SIZE"]))
"""

DATA = f"""
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
_g = torch.Generator().manual_seed(0)
X = torch.randn({SAMPLES}, 8, generator=_g); Y = X.sum(1, keepdim=True)
"""

ACCELERATE = (
    DATA
    + f"""
from accelerate import Accelerator
import hvdnb
accelerator = Accelerator(log_with=hvdnb.accelerate_tracker())
accelerator.init_trackers("frameworks")
torch.manual_seed(accelerator.process_index)
model = nn.Linear(8, 1); opt = torch.optim.SGD(model.parameters(), lr=0.05)
dl = DataLoader(TensorDataset(X, Y), batch_size={BATCH}, shuffle=True)
model, opt, dl = accelerator.prepare(model, opt, dl)
step = 0
for epoch in range({EPOCHS}):
    for xb, yb in dl:
        loss = nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        opt.step(); opt.zero_grad()
        accelerator.log({{"loss": loss.item()}}, step=step); step += 1
idx = accelerator.gather_for_metrics(torch.arange({SAMPLES})[accelerator.process_index::accelerator.num_processes])
accelerator.end_training()
W = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
(accelerator.num_processes, str(accelerator.distributed_type), len(dl), sorted(idx.tolist()))
"""
)

HF_TRAINER = f"""
import torch, torch.nn as nn
from transformers import Trainer, TrainingArguments

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x, labels=None):
        out = self.lin(x)
        return {{"loss": nn.functional.mse_loss(out, labels), "logits": out}}

class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn({SAMPLES}, 8, generator=g); self.y = self.x.sum(1, keepdim=True)
    def __len__(self):
        return {SAMPLES}
    def __getitem__(self, i):
        return {{"x": self.x[i], "labels": self.y[i]}}

import tempfile
args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size={BATCH},
                         num_train_epochs={EPOCHS}, logging_steps=1, report_to="none",
                         save_strategy="no", learning_rate=0.05, disable_tqdm=True)
trainer = Trainer(model=Tiny(), args=args, train_dataset=Data())
trainer.train()
W = [p.detach().clone() for p in trainer.model.parameters()]
(args.world_size, str(args.parallel_mode), type(trainer.model_wrapped).__name__, len(trainer.get_train_dataloader()))
"""


#: the LightningModule of every Lightning cell (``L`` is the package the cell imported)
LIT = """
class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.mse_loss(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
"""


def lightning_cell(pkg: str, devices: str, strategy: str | None) -> str:
    strat = f", strategy={strategy!r}" if strategy else ""
    return (
        DATA
        + f"""
import {pkg} as L
{LIT}
class Seen(L.Callback):  # the losses as the user sees them, to check the panel's against
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

lit, seen = Lit(), Seen()
trainer = L.Trainer(accelerator="cpu", devices={devices}{strat}, max_epochs={EPOCHS},
                    enable_progress_bar=False, logger=False, enable_checkpointing=False,
                    enable_model_summary=False, callbacks=[seen])
trainer.fit(lit, DataLoader(TensorDataset(X, Y), batch_size={BATCH}))
W = [p.detach().clone() for p in lit.parameters()]
(trainer.world_size, type(trainer.strategy).__name__, trainer.num_training_batches)
"""
    )


FABRIC = (
    DATA
    + """
import lightning as L
fabric = L.Fabric(accelerator="cpu", devices=DEVICES, strategy="ddp")
fabric.launch()
model = nn.Linear(8, 1); opt = torch.optim.SGD(model.parameters(), lr=0.05)
model, opt = fabric.setup(model, opt)
dl = fabric.setup_dataloaders(DataLoader(TensorDataset(X, Y), batch_size=8))
for xb, yb in dl:
    loss = nn.functional.mse_loss(model(xb), yb)
    fabric.backward(loss); opt.step(); opt.zero_grad()
W = [p.detach().clone() for p in model.parameters()]
(fabric.world_size, fabric.global_rank, len(dl))
"""
)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}rank")
def cluster(request, shell):
    """One real cluster per world size; every framework runs on it in turn."""
    running = hvdnb.current()
    if running is not None and running.running:
        running.stop()
    n = request.param
    c = hvdnb.Cluster(n=n, oversubscribe=True, timeout=180)
    c.start()
    yield c
    c.stop()


def run(cluster, code: str, timeout: float = 300) -> hvdnb.CellResult:
    return hvdnb.run_cell(cluster, code, stream=False, quiet=True, timeout=timeout)


def out(r: hvdnb.CellResult) -> str:
    return "".join(r.stdout.values())


def expect_error(cluster, code: str) -> DistributedCellError:
    """The cell raises on every rank, one error group."""
    with pytest.raises(DistributedCellError) as e:
        run(cluster, code)
    assert e.value.failed_ranks == list(range(cluster.n)), str(e.value)
    return e.value


def same_weights_and_group_works(cluster) -> None:
    n = cluster.n
    assert run(cluster, SAME_WEIGHTS).values == dict.fromkeys(range(n), True)
    assert run(cluster, NEXT_CELL).values == dict.fromkeys(range(n), n * (n + 1) // 2)


def last_run(name: str) -> dict[int, int]:
    """{rank: points of ``name``} in the newest run of the store."""
    df = hvdnb.metrics().to_pandas()
    df = df[df.run == df.run.max()]
    return df[df.name == name].groupby("rank").size().to_dict()


def last_values(name: str, rank: int) -> list[float]:
    """The values of ``name`` on ``rank`` in the newest run, in step order."""
    df = hvdnb.metrics().to_pandas()
    df = df[(df.run == df.run.max()) & (df.name == name) & (df["rank"] == rank)]
    return df.sort_values("step").value.tolist()


def test_ddp_tutorial_runs_unchanged(cluster):
    n = cluster.n
    r = run(cluster, DDP_TUTORIAL)
    text = out(r)
    for rank in range(n):
        assert f"Running basic DDP example on rank {rank}." in r.stdout[rank]
    assert "fn runs once on each" in text
    assert "init_process_group('gloo'): kept the cluster's group (gloo" in text
    assert "destroy_process_group(): the cluster's group stays" in text
    same_weights_and_group_works(cluster)
    # the panel: every rank's loss, and DDP's bucket timings without hvdnb.ddp_comm_hook
    assert last_run("loss") == dict.fromkeys(range(n), 6)
    timed = last_run("comm/ddp.bucket.0/time")
    assert sorted(timed) == list(range(n)) and min(timed.values()) >= 6, timed


def test_init_process_group_requests(cluster):
    n = cluster.n
    r = run(cluster, "import torch.distributed as dist\ndist.init_process_group('mpi')")
    assert "this torch has no MPI backend" in out(r)
    e = expect_error(
        cluster,
        f"import torch.distributed as dist\ndist.init_process_group('gloo', world_size={n + 1})",
    )
    assert f"the cluster has {n} ranks" in str(e) and f"%dist restart -n {n + 1}" in str(e)
    e = expect_error(cluster, "import torch.distributed as dist\ndist.init_process_group('nccl')")
    assert "this cluster's group is gloo" in str(e) and "its ranks have no GPU" in str(e)
    e = expect_error(
        cluster, f"import torch.multiprocessing as mp\nmp.spawn(print, nprocs={n + 1})"
    )
    assert f"spawn(nprocs={n + 1})" in str(e) and f"nprocs={n})" in str(e)
    assert run(cluster, NEXT_CELL).values == dict.fromkeys(range(n), n * (n + 1) // 2)


def test_user_comm_hook_is_kept_and_timed(cluster):
    n = cluster.n
    code = """
import torch, torch.nn as nn, torch.distributed as dist, hvdnb
from torch.nn.parallel import DistributedDataParallel as DDP
calls = []
def my_hook(state, bucket):
    calls.append(bucket.index())
    return dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future().then(lambda f: f.value()[0])
model = DDP(nn.Linear(4, 2))
model.register_comm_hook(None, my_hook)
for step in range(3):
    model(torch.randn(5, 4)).sum().backward()
    hvdnb.log(step, 0.0)
len(calls)
"""
    assert run(cluster, code).values == dict.fromkeys(range(n), 3)
    assert sorted(last_run("comm/ddp.bucket.0/time")) == list(range(n))


def test_accelerate(cluster):
    n = cluster.n
    r = run(cluster, ACCELERATE)
    per_rank = math.ceil(SAMPLES / BATCH / n)
    kind = "DistributedType.MULTI_CPU"
    for rank in range(n):
        procs, dtype, batches, idx = r.values[rank]
        assert (procs, dtype, batches) == (n, kind, per_rank)
        assert idx == list(range(SAMPLES)), "gather_for_metrics returns each sample once"
    assert last_run("loss_main") == {0: EPOCHS * per_rank}  # accelerator.log: main process
    same_weights_and_group_works(cluster)  # end_training() left the group
    code = f"""
from accelerate import notebook_launcher
import os
hits = []
notebook_launcher(lambda a: hits.append((a, int(os.environ["RANK"]))), args=("x",), num_processes={n})
hits
"""
    r = run(cluster, code)
    assert r.values == {rank: [("x", rank)] for rank in range(n)}
    e = expect_error(
        cluster,
        f"from accelerate import notebook_launcher\nnotebook_launcher(print, num_processes={n + 1})",
    )
    assert f"notebook_launcher(num_processes={n + 1})" in str(e)


def test_hf_trainer(cluster):
    n = cluster.n
    r = run(cluster, HF_TRAINER)
    per_rank = math.ceil(SAMPLES / BATCH / n)
    wrapped = "DistributedDataParallel"  # at 1 rank too: the Trainer's choice in DISTRIBUTED
    assert r.values == dict.fromkeys(
        range(n), (n, "ParallelMode.DISTRIBUTED", wrapped, per_rank)
    ), r.values
    assert "{'loss'" in r.stdout[0] and all("{'loss'" not in r.stdout[k] for k in range(1, n))
    steps = EPOCHS * per_rank
    assert last_run("loss_main") == {0: steps}  # the Trainer's logged loss, rank 0 only
    logged = run(cluster, "[h['loss'] for h in trainer.state.log_history if 'loss' in h]")
    assert last_values("loss_main", 0) == pytest.approx(logged.values[0], rel=1e-6)
    assert last_run("time/step") == dict.fromkeys(range(n), steps - 1)  # every rank's steps
    # samples/s is known: each rank's step took its per-device batch
    assert set(last_values("samples", 0)) == {BATCH}
    from hvdnb.notebook.metrics.store import get_store

    assert get_store().throughput(window=1e9) is not None
    same_weights_and_group_works(cluster)


@pytest.mark.parametrize("pkg", ["lightning", "pytorch_lightning"])
@pytest.mark.parametrize("strategy", ["ddp", "ddp_notebook"])
def test_lightning(cluster, pkg, strategy):
    n = cluster.n
    r = run(cluster, lightning_cell(pkg, str(n), strategy))
    batches = math.ceil(SAMPLES / BATCH / n)
    assert r.values == dict.fromkeys(range(n), (n, "DDPStrategy", batches))
    assert last_run("loss") == dict.fromkeys(range(n), EPOCHS * batches)  # each rank's own
    seen = run(cluster, "seen.losses").values  # what training_step returned, per rank
    for rank in range(n):
        assert last_values("loss", rank) == pytest.approx(seen[rank], rel=1e-6)
    same_weights_and_group_works(cluster)


def test_lightning_against_the_cluster(cluster):
    n = cluster.n
    e = expect_error(cluster, lightning_cell("lightning", str(n + 1), "ddp"))
    # Lightning's own check (its TorchElasticEnvironment), on every rank
    assert f"the product ({n + 1} * 1) does not match the world size ({n})" in str(e)
    if n > 1:  # Trainer(devices=1): one device per rank, said in one line
        r = run(cluster, lightning_cell("lightning", "1", None))
        assert f"each of the {n} ranks trains a model of its own" in out(r)
        assert "leave devices out" in out(r)
    assert run(cluster, NEXT_CELL).values == dict.fromkeys(range(n), n * (n + 1) // 2)


def test_fabric(cluster):
    n = cluster.n
    r = run(cluster, FABRIC.replace("DEVICES", str(n)))
    assert r.values == {rank: (n, rank, math.ceil(SAMPLES / 8 / n)) for rank in range(n)}
    same_weights_and_group_works(cluster)


LIGHTNING_LR = (
    DATA
    + "\nimport lightning as L\n"
    + LIT
    + """
class Seen(L.Callback):
    def __init__(self):
        self.lrs = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append(round(optimizer.param_groups[0]["lr"], 6))

seen = Seen()
trainer = L.Trainer(accelerator="cpu", devices=DEVICES, strategy="ddp", max_steps=10, callbacks=[seen],
                    enable_progress_bar=False, logger=False, enable_checkpointing=False,
                    enable_model_summary=False)
trainer.fit(Lit(), DataLoader(TensorDataset(X, Y), batch_size=4))
seen.lrs
"""
)

HF_LR = (
    HF_TRAINER.replace("logging_steps=1", "logging_steps=1, max_steps=10")
    .replace(
        "trainer = Trainer(model=Tiny(), args=args, train_dataset=Data())",
        """from transformers import TrainerCallback
class Seen(TrainerCallback):
    def __init__(self):
        self.lrs = []
    def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
        self.lrs.append(round(optimizer.param_groups[0]["lr"], 6))
seen = Seen()
trainer = Trainer(model=Tiny(), args=args, train_dataset=Data(), callbacks=[seen])""",
    )
    .replace(
        "(args.world_size, str(args.parallel_mode), type(trainer.model_wrapped).__name__, len(trainer.get_train_dataloader()))",
        "seen.lrs",
    )
)


@pytest.mark.parametrize("cell", [LIGHTNING_LR, HF_LR], ids=["lightning", "hf_trainer"])
def test_the_panels_lr_knobs_drive_the_framework(cluster, cell):
    """The panel's lr and warmup_steps, planned for step 5, drive the learning rate from
    that step on, on every rank alike; before it the framework's own schedule rules."""
    n = cluster.n
    code = cell.replace("DEVICES", str(n))
    before = run(cluster, code).values[0]  # announces the knobs; the framework's own lrs
    hvdnb.set_knobs(lr=0.2, warmup_steps=8, at_step=5)
    r = run(cluster, code)
    want = before[:5] + [round(0.2 * min(1.0, (s + 1) / 8), 6) for s in range(5, 10)]
    assert r.values == dict.fromkeys(range(n), want), (before, r.values)


def test_an_exported_notebook_trains_distributed_under_mpiexec_and_torchrun(tmp_path):
    """``%dist export`` of a notebook made of these cells: the script trains over 2 ranks
    under mpiexec and under torchrun, as the notebook did (the hooks go in at the script's
    ``hvdnb.rank.script.init``)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import nbformat

    # one os.write per line: two ranks' print() calls (text, then newline) can interleave
    def say(expr: str) -> str:
        return f"\nimport os; os.write(1, ({expr} + chr(10)).encode())\n"

    check = say("'same weights ' + str(" + SAME_WEIGHTS.strip().splitlines()[-1] + ")")
    body = [  # each framework checked in its own cell
        DDP_TUTORIAL + SAME_WEIGHTS + check,
        ACCELERATE
        + say("'accelerate sees ' + str(accelerator.num_processes)")
        + SAME_WEIGHTS
        + check,
        lightning_cell("lightning", "2", "ddp_notebook")
        + say("'lightning sees ' + str(trainer.world_size)")
        + SAME_WEIGHTS
        + check,
    ]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("%load_ext hvdnb\n%dist start -n 2")] + [
        nbformat.v4.new_code_cell("%%distributed\n" + code) for code in body
    ]
    path = tmp_path / "frameworks.ipynb"
    nbformat.write(nb, path)
    bin_ = Path(sys.executable).parent
    env = dict(
        os.environ,
        PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=str(Path(__file__).resolve().parents[2]),
        OMP_NUM_THREADS="1",
    )
    res = hvdnb_export(path, env)
    assert res.returncode == 0, res.stderr
    script = str(path.with_suffix(".py"))
    for cmd in (
        [str(bin_ / "mpiexec"), "-n", "2", sys.executable, script],
        [str(bin_ / "torchrun"), "--standalone", "--nproc-per-node", "2", script],
    ):
        run_ = subprocess.run(
            cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path
        )
        assert run_.returncode == 0, f"{cmd[0]}:\n{run_.stdout[-3000:]}\n{run_.stderr[-3000:]}"
        text = run_.stdout
        assert text.count("same weights True") == 6, (cmd[0], text[-3000:])
        assert text.count("accelerate sees 2") == 2 and text.count("lightning sees 2") == 2, text


FSDP2 = """
import torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

mesh = init_device_mesh("cpu", (dist.get_world_size(),))
sharded, plain = make(), make()
for layer in sharded:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(sharded, mesh=mesh)
ddp = DDP(plain)
opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (sharded, ddp)]
torch.manual_seed(1 + dist.get_rank())  # each rank its own batch
for _ in range(3):
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for m, opt in zip((sharded, ddp), opts):
        opt.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
local = sharded[0].weight.to_local().numel()
full = [p.full_tensor() for p in sharded.parameters()]
(local, all(torch.allclose(f, p, atol=1e-6) for f, p in zip(full, plain.parameters())))
"""


def test_fsdp2_shards_over_the_cluster_and_matches_ddp(cluster):
    """FSDP2 (``fully_shard`` over a CPU device mesh) on the cluster's group: each rank
    holds its share of a layer, and three steps give DDP's parameters (gloo's averaging
    of sharded gradients was once wrong: pytorch#162338)."""
    n = cluster.n
    r = run(cluster, FSDP2)
    chunk = math.ceil(32 / n)  # torch.chunk's rows per rank, the last one short
    rows = {k: max(0, min(chunk, 32 - k * chunk)) for k in range(n)}
    assert r.values == {k: (rows[k] * 16, True) for k in range(n)}, r.values
