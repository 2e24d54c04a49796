"""The watchdog knows each process by its start time, not by its number alone: a pid the
kernel reused for another process is never signalled. With a pid_max of 32,768 the suite
wraps around within minutes; a watchdog whose kernel died sent SIGTERM to another
cluster's controller (that cluster's engines lost their heartbeat and exited)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hvdnb.notebook.cluster import watchdog

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_process_given_is_signalled(sleeper, monkeypatch):
    monkeypatch.setattr(watchdog, "_STARTED", {sleeper.pid: watchdog._start_time(sleeper.pid)})
    assert watchdog._alive(sleeper.pid)
    watchdog._signal(sleeper.pid, signal.SIGTERM)
    assert sleeper.wait(10) == -signal.SIGTERM


def test_a_reused_pid_is_neither_alive_nor_signalled(sleeper, monkeypatch):
    """The number is the sleeper's, the start time another's: as if the cluster's process
    had ended and the kernel had given its number to a new one."""
    was = int(watchdog._start_time(sleeper.pid) or 0)
    monkeypatch.setattr(watchdog, "_STARTED", {sleeper.pid: str(was - 1)})
    assert not watchdog._alive(sleeper.pid)
    watchdog._signal(sleeper.pid, signal.SIGTERM)
    watchdog._signal(sleeper.pid, signal.SIGKILL)
    time.sleep(0.2)
    assert sleeper.poll() is None  # still running: not the cluster's process


def test_a_dead_kernels_watchdog_ends_its_processes_only(sleeper):
    """End to end: a kernel (here a shell) that dies takes the processes it named with it,
    and a pid it named that had already ended is left out."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    kernel = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            f"w = subprocess.Popen([sys.executable, '-m', 'hvdnb.notebook.cluster.watchdog', "
            f"str(__import__('os').getpid()), '{sleeper.pid}', '{gone.pid}'])\n"
            "time.sleep(1.0)\n",
        ]
    )
    kernel.wait(30)
    assert sleeper.wait(30) in (-signal.SIGTERM, -signal.SIGKILL)
