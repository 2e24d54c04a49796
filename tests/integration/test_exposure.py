"""What a cluster exposes: listening sockets on loopback only, 0600 files, a killed kernel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import alive

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


def test_everything_listens_on_loopback_and_files_are_private(dist2, shell):
    shell.run_cell_magic(
        "distributed",
        "-q",
        "import torch, torch.distributed as dist\nx = torch.ones(1); dist.all_reduce(x)",
    )
    listeners = []
    for pid in dist2.pids() + [os.getpid()]:
        try:
            for c in psutil.Process(pid).net_connections("tcp"):
                if c.status == psutil.CONN_LISTEN:
                    listeners.append((pid, c.laddr.ip, c.laddr.port))
        except psutil.NoSuchProcess:
            pass
    ours = [
        entry for entry in listeners if entry[0] != os.getpid() or entry[2] == dist2.channel.port
    ]
    assert len(ours) >= 6  # controller, engines, rendezvous store, side channel
    assert all(ip == "127.0.0.1" for _, ip, _ in ours), ours
    sec = Path(dist2._ipp.profile_dir) / "security"
    files = list(sec.glob(f"*{dist2.cluster_id}*"))
    assert len(files) >= 3
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files), [
        (f.name, oct(f.stat().st_mode)) for f in files
    ]
    assert oct(Path(dist2.state_dir).stat().st_mode & 0o777) == "0o700"


def test_killed_kernel_leaves_nothing_running_or_on_disk():
    script = textwrap.dedent(
        """
        import os, signal, hvdnb
        c = hvdnb.Cluster(n=2, timeout=120).start()
        print(c._ipp.profile_dir, c.cluster_id, c.state_dir, flush=True)
        print(*c.pids(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no atexit runs: the watchdog must clean up
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == -signal.SIGKILL
    head, tail = proc.stdout.splitlines()
    profile, cluster_id, state_dir = head.split()
    assert Path(state_dir).is_dir() and Path(state_dir).name.startswith("hvdnb-state-")
    pids = [int(p) for p in tail.split()]
    assert len(pids) >= 4
    assert alive(pids, within=60.0) == []
    # connection files (with the session key), cluster file, logs, state dir: gone too
    left = [p for sub in ("security", "log") for p in (Path(profile) / sub).glob(f"*{cluster_id}*")]
    left.append(Path(state_dir))  # and the state directory (hvdnb.State's commits)
    deadline = time.monotonic() + 60  # returns as soon as they are gone
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if p.exists()]
    assert left == []
