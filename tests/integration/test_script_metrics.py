"""An exported script's metrics, end to end: a notebook exported with ``hvdnb export``, run
for real under ``mpiexec -n 2`` with ``HVDNB_METRICS_DIR`` set, and every rank's
``rank<N>.jsonl`` read back with ``hvdnb.metrics.load``.

Each rank saves the loss it logged at every step (``repr``: every digit); the files must hold
exactly those values, for every step of every rank. Before the protocol's file form, the
flusher raised on the recorder's array columns and both files stayed empty.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import hvdnb
from hvdnb.protocol import jsonl
from tests.conftest import hvdnb_export

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STEPS = 40

SETUP = """%%distributed
import hvdnb, torch, torch.distributed as dist
torch.set_num_threads(1)
k = hvdnb.knobs(lr=0.1)"""

TRAIN = f"""%%distributed
import time
rank = dist.get_rank()
g = torch.Generator().manual_seed(rank)
X = torch.randn(64, 4, generator=g)
y = X @ torch.tensor([1.0, -2.0, 0.5, 3.0])
w = torch.zeros(4, requires_grad=True)
logged = []
for step in range({STEPS}):
    loss = ((X @ w - y) ** 2).mean()
    loss.backward()
    dist.all_reduce(w.grad)
    with torch.no_grad():
        w -= k.lr * w.grad / dist.get_world_size()
        w.grad.zero_()
    hvdnb.log(step, loss, samples=64)
    logged.append((step, loss.item()))
    if step == {STEPS // 2}:
        time.sleep(0.3)  # a flush interval: the file gets a message mid-run too (not asserted)
with open(f"logged{{rank}}.txt", "w") as f:
    f.write(repr(logged))"""


def _env(metrics: Path) -> dict[str, str]:
    env = dict(
        os.environ,
        PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        HVDNB_METRICS_DIR=str(metrics),
    )
    return env


def test_every_step_of_every_rank_is_in_the_metrics_files(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext hvdnb\n%dist start -n 2"),
        nbformat.v4.new_code_cell(SETUP),
        nbformat.v4.new_code_cell("%dist knobs lr=0.05"),
        nbformat.v4.new_code_cell(TRAIN),
    ]
    path = tmp_path / "train.ipynb"
    nbformat.write(nb, path)
    metrics = tmp_path / "metrics"
    env = _env(metrics)
    res = hvdnb_export(path, env)
    assert res.returncode == 0, res.stderr
    run = subprocess.run(
        [str(BIN / "mpiexec"), "-n", "2", sys.executable, str(path.with_suffix(".py"))],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "flush failed" not in run.stderr, run.stderr[-3000:]

    saved = {r: ast.literal_eval((tmp_path / f"logged{r}.txt").read_text()) for r in (0, 1)}
    assert sorted(p.name for p in metrics.iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
    for r in (0, 1):
        lines = (metrics / f"rank{r}.jsonl").read_text().splitlines()
        msgs = [jsonl.loads_line(line) for line in lines]
        assert {m["rank"] for m in msgs} == {r}
        assert [m["kind"] for m in msgs].count("knobs_spec") == 1
        assert sum(m["kind"] == "metrics" for m in msgs) >= 1

    rows = hvdnb.metrics.load(metrics, "loss")
    for r in (0, 1):
        got = [(row.step, row.value) for row in rows if row.rank == r]
        assert len(saved[r]) == STEPS
        assert got == saved[r], f"rank {r}: the file's losses differ from those logged"
    assert {row.run for row in rows} == {1}
    assert {row.knobs["lr"] for row in rows} == {0.05}  # the value exported with the script
    df = hvdnb.metrics.load(metrics).to_pandas()
    assert df[df.name == "samples"].value.sum() == 2 * STEPS * 64
