"""``%dist start --launcher slurm`` on a Slurm of two nodes: slurmctld on the login node, a
slurmd on each namespace host (``tests/multihost/hosts.py``: ``TwoNodeSlurm``, with its own
``SLURM_CONF``, ports, spool and pid files beside ``tests/slurm/setup_slurm.sh``'s one-node
Slurm, whose munged it shares). The notebook kernel runs on the login node, started from
its kernelspec with ``SLURM_CONF`` in its environment and driven over jupyter_client.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from hvdnb.notebook.headless.runner import Kernel
from tests.multihost.hosts import (
    MACHINES,
    TwoNodeSlurm,
    check_numbering,
    two_node_slurm,
    where,
)

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(300)]

LOGIN = MACHINES["login"]
START = f"%dist start --launcher slurm -n 4 --ip {LOGIN} --time 10 --timeout 120"


@pytest.fixture(scope="module")
def slurm():
    yield from two_node_slurm()


def _kernel(slurm: TwoNodeSlurm) -> Kernel:
    env = {**slurm.env(), "HVDNB_PANEL": "inline"}
    return Kernel(env, prefix=slurm.hosts.on("login", []), reach=LOGIN)


def _jobs(slurm: TwoNodeSlurm) -> list[str]:
    got = slurm.run(["squeue", "-h", "-o", "%i %j %T %N"])
    return [line for line in got.stdout.splitlines() if line.strip()]


def _wait_no_jobs(slurm: TwoNodeSlurm, timeout: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while _jobs(slurm) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _jobs(slurm)


TRAIN = r"""%%distributed
import torch, torch.distributed as dist, hvdnb
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(dist.get_rank())
for step in range(20):
    x = torch.randn(32, 16, generator=g)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    hvdnb.log(step, loss.item())
w = torch.cat([p.detach().flatten() for p in model.parameters()])
ws = [torch.zeros_like(w) for _ in range(dist.get_world_size())]
dist.all_gather(ws, w)
import pathlib, socket
same = all(torch.equal(ws[0], v) for v in ws)
print("trained on", socket.gethostname(), "in sync:", same)
# one file per rank (the exported job's ranks share one output file, where their lines mix)
pathlib.Path("MARKS", f"rank{dist.get_rank()}").write_text(f"{socket.gethostname()} {same}")
"""


def _marks(folder) -> dict[str, str]:
    """What each rank wrote at the end of TRAIN (``rankN`` -> "host in-sync"), then cleared."""
    got = {p.name: p.read_text() for p in sorted(folder.iterdir())}
    for p in folder.iterdir():
        p.unlink()
    return got


#: four ranks, two on each node, each in sync
TRAINED = {"rank0": "h1 True", "rank1": "h1 True", "rank2": "h2 True", "rank3": "h2 True"}


def test_slurm_spreads_the_ranks_over_both_nodes_and_an_export_trains_across_them(slurm):
    marks = slurm.dir / "marks"
    marks.mkdir()
    train = TRAIN.replace("MARKS", str(marks))
    with _kernel(slurm) as k:
        got = k.run(START, timeout=180)
        assert got.error is None and "4 ranks ready" in got.text, got.text + got.traceback
        jobs = _jobs(slurm)
        assert len(jobs) == 1 and "RUNNING" in jobs[0] and jobs[0].endswith("h[1-2]"), jobs
        check_numbering(where(k))
        got = k.run(train, timeout=180)
        assert got.error is None, got.traceback[-2000:]
        for host in ("h1", "h2"):
            assert f"trained on {host} in sync: True" in got.text, got.text
        assert _marks(marks) == TRAINED
        out = slurm.dir / "export"
        out.mkdir()
        got = k.run(f"%dist export {out / 'train.py'} --launcher slurm")
        assert "train.sbatch" in got.text, got.text
        k.run("%dist stop", timeout=60)
        assert _wait_no_jobs(slurm) == [], "the engines' job is still in squeue"
    # the exported job, submitted as a user would, trains across both nodes
    script = (out / "train.sbatch").read_text()
    try:
        submitted = slurm.run(
            ["sh", "-c", f"cd {out} && sbatch --wait --time=10 train.sbatch"], timeout=180
        )
    except Exception:
        seen = {p.name: p.read_text(errors="replace")[-3000:] for p in out.iterdir()}
        raise AssertionError(f"the exported job did not end: {seen}") from None
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr + script
    logs = "".join(p.read_text(errors="replace") for p in out.glob("*.out"))
    assert _marks(marks) == TRAINED, (logs[-3000:], script)


def test_a_killed_notebook_kernels_watchdog_cancels_the_job(slurm):
    k = _kernel(slurm)
    try:
        got = k.run(START, timeout=180)
        assert got.error is None and "4 ranks ready" in got.text, got.text + got.traceback
        assert len(_jobs(slurm)) == 1
        os.kill(k.km.provisioner.pid, signal.SIGKILL)  # no atexit, no %dist stop
        assert _wait_no_jobs(slurm, 60) == [], "the dead kernel's job is still in squeue"
    finally:
        k.kc.stop_channels()
        k.km.cleanup_resources()
