"""One host's standby pool (``hvdnb.rank.standby_pool``), spoken to as the notebook speaks to
it over ssh, here over a plain pipe: its lines, its standby processes, and what its stdin
closing ends. The ssh path itself (a ``--hosts`` cluster's warm restart on each host) is
``tests/multihost/test_hosts_ssh.py``."""

from __future__ import annotations

import os
import queue
import socket
import stat
import subprocess
import sys
import threading
import time

import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


class Pool:
    def __init__(self, template: str) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "hvdnb.rank.standby_pool", template],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line.strip())

    def say(self, line: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def expect(self, prefix: str, timeout: float = 120) -> str:
        """The first line starting with ``prefix`` (the lines before it are dropped)."""
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line.startswith(prefix):
                return line
            seen.append(line)
        raise AssertionError(f"no line {prefix!r} in {timeout} s; saw {seen}")


def test_a_pool_starts_its_standby_relays_its_state_and_ends_with_its_stdin(tmp_path):
    pool = Pool(str(tmp_path / "pool-{host}"))
    try:
        folder = tmp_path / f"pool-{socket.gethostname()}"  # the host's own name, filled in
        assert pool.expect("listening ") == f"listening {folder / 'standby.sock'}"
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700  # only this user hands over
        pool.say("spawn")
        pid = int(pool.expect("0 pid ").split()[2])
        assert pool.expect("0 ready ") == f"0 ready {pid}"  # torch and the engine imported
        pool.say("import json")  # a rank imported it: so does every standby
        assert pool.expect("0 imported ") == "0 imported json"
        pool.say("spawn")
        second = int(pool.expect("1 pid ").split()[2])
        pool.say("end 1")  # not a rank: it ends, and the pool says so
        assert pool.expect("1 exit ").startswith("1 exit ")
        assert not psutil.pid_exists(second) or psutil.Process(second).status() == "zombie"
        assert psutil.Process(pid).is_running()
        # the ssh session ends (the notebook closed it, or the link was cut): so does all
        assert pool.popen.stdin is not None
        pool.popen.stdin.close()
        assert pool.popen.wait(30) == 0
        left = psutil.wait_procs([psutil.Process(pid)], timeout=30)[1]
        assert not left, f"an idle standby outlived its pool: {left}"
        assert not folder.exists(), "the pool left its directory"
    finally:
        if pool.popen.poll() is None:
            pool.popen.kill()
