"""A cell trains on 2 ranks submitted through a real one-node Slurm (slurmctld + slurmd +
munge, set up by ``tests/slurm/setup_slurm.sh``), then the job is cancelled and nothing is
left in squeue.

Engines run as one Slurm job (ipyparallel's ``SlurmEngineSetLauncher``: sbatch + srun).
This Slurm's default ``--mpi=none`` gives MPICH no world, so the ranks come from
``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` and rendezvous through the notebook:
the path a site without PMI takes. Skips, saying why, where Slurm is not running and
cannot be started (not root, no packages, a foreign slurm.conf).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import hvdnb

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(240)]

SETUP = Path(__file__).with_name("setup_slurm.sh")


def _slurm_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    return out.returncode == 0 and any(
        s.strip().rstrip("*") in ("idle", "mixed", "allocated") for s in out.stdout.splitlines()
    )


@pytest.fixture(scope="module")
def slurm():
    if not _slurm_up():
        if os.geteuid() != 0:
            pytest.skip(
                "Slurm is not running and starting it needs root: sudo tests/slurm/setup_slurm.sh"
            )
        # start what is installed; installing is the CI set-up's job (.ci/run)
        subprocess.run(["bash", str(SETUP), "--no-install"], capture_output=True, timeout=90)
        if not _slurm_up():
            pytest.skip(
                "Slurm is not running and could not be started: run "
                "tests/slurm/setup_slurm.sh as root (it installs slurm-wlm + munge)"
            )
    return True


def _jobs(name_part: str) -> list[str]:
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i %j %T"], capture_output=True, text=True, timeout=20
    ).stdout
    return [line for line in out.splitlines() if name_part in line]


def test_cell_trains_on_two_ranks_through_slurm(slurm, shell, capsys):
    running = hvdnb.current()
    if running is not None and running.running:
        running.stop()
    shell.run_line_magic(
        "dist", "start -n 2 --launcher slurm --ip 127.0.0.1 --time 10 --timeout 120"
    )
    c = hvdnb.current()
    try:
        assert c is not None and c.launcher == "slurm"
        jobs = _jobs(c.cluster_id)
        assert len(jobs) == 1 and "RUNNING" in jobs[0], jobs
        job_id = jobs[0].split()[0]
        shell.run_cell_magic(
            "distributed",
            "-o res -q",
            r"""
import os, torch, torch.distributed as dist
import hvdnb.torch as hvd
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
torch.manual_seed(1 + hvd.rank())
X = torch.randn(64, 8); Y = X.sum(1, keepdim=True)
losses = []
for step in range(30):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(X), Y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
w = torch.cat([p.detach().flatten() for p in model.parameters()])
ws = [torch.zeros_like(w) for _ in range(hvd.size())]
dist.all_gather(ws, w)
dict(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(),
     env=(os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"]),
     slurm=(os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_PROCID")),
     first=losses[0], last=losses[-1], same=all(torch.equal(ws[0], x) for x in ws))
""",
        )
        res = shell.user_ns["res"]  # {rank: value}
        assert sorted(res) == [0, 1]
        for rank, r in res.items():
            assert r["rank"] == rank
            assert r["size"] == 2 and r["same"], r
            assert r["env"][0] == str(r["rank"]) and r["env"][1] == str(r["local_rank"])
            assert r["slurm"] == (job_id, str(r["rank"])), r  # really a task of the job
            assert r["last"] < 0.5 * r["first"], r
        rows = c.status()
        assert [row["rank"] for row in rows] == [0, 1]
        assert all(row["host"] not in ("?", "") for row in rows)
    finally:
        shell.run_line_magic("dist", "stop")
    deadline = time.monotonic() + 30
    while _jobs(c.cluster_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _jobs(c.cluster_id) == [], "the engines' Slurm job is still in squeue"
    # the sbatch script, the job's output and ipyparallel's files went with the cluster
    import glob

    from IPython.paths import get_ipython_dir

    profile = os.path.join(get_ipython_dir(), "profile_default")
    assert [
        p
        for sub in ("security", "log")
        for p in glob.glob(os.path.join(profile, sub, f"*{c.cluster_id}*"))
    ] == []


def test_killed_kernel_cancels_its_slurm_job(slurm, tmp_path):
    """No atexit runs for a SIGKILLed kernel: the watchdog must scancel the job."""
    import signal
    import sys
    import textwrap
    import time

    script = textwrap.dedent(
        """
        import os, signal, hvdnb
        c = hvdnb.Cluster(n=2, launcher="slurm", ip="127.0.0.1", time_limit="10", timeout=120)
        c.start()
        print(c.cluster_id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    cluster_id = proc.stdout.split()[-1]
    assert cluster_id.startswith("hvdnb-")
    deadline = time.monotonic() + 30
    while _jobs(cluster_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _jobs(cluster_id) == [], "the dead kernel's Slurm job is still in squeue"
