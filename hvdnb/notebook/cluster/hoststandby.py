"""The warm standby on other hosts: one pool per host of a ``--hosts`` cluster, over ssh.

A cluster started with ``--hosts FILE`` (hydra over ssh) keeps, on each of its hosts, as
many standby processes as that host has ranks. Each host's pool is
``hvdnb.rank.standby_pool``, run over one ssh session held open by the notebook (the same
ssh as hydra's, ``sshslots.ssh_command``, with its ``BatchMode`` and timeouts); it starts
the processes there and reports their state line by line. A warm restart's stand-in on a
host finds its pool's socket from a path template with ``{host}`` in it, which both sides
fill with that host's own name.

Owns: the ssh sessions of the pools and what each says of its standby processes. Never:
read or signal a process id of another host as if it were this one's (the notebook's
watchdog and memory figures use this host's processes only).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import threading
from typing import Any

from hvdnb.notebook.cluster import sshslots

__all__ = ["HostPool", "RemoteProc", "launch_env"]


class RemoteProc:
    """One standby process on another host, as its pool reports it (``standby.Proc``'s
    interface)."""

    def __init__(self, pool: HostPool, index: int) -> None:
        self.pool, self.index = pool, index
        self.host = pool.host
        self.remote_pid = 0
        self.ready = False
        self.adopted = False
        self.exited = False
        self.modules: list[str] = []

    @property
    def pid(self) -> int:
        """Its process id on its own host (never this host's)."""
        return self.remote_pid

    def poll(self) -> None:
        """Nothing to read: the pool's reader thread keeps the state."""

    def alive(self) -> bool:
        return not self.exited and self.pool.alive()

    def memory(self) -> tuple[int, int]:
        return 0, 0  # another host's memory is not read from here

    def send(self, line: str) -> None:
        self.pool.send(line)

    def end(self) -> None:
        self.pool.send(f"end {self.index}")


class HostPool:
    """The ssh session of one host's ``standby_pool``.

    Parameters
    ----------
    host : the host's name as the hostfile gives it
    template : the pool's directory, with ``{host}`` for the host's own name
    env : the environment its standby processes start with (the ranks' import-time one)
    """

    def __init__(self, host: str, template: str, env: dict[str, str]) -> None:
        self.host = host
        words = ["env", *(f"{k}={v}" for k, v in env.items())]
        words += [sys.executable, "-m", "hvdnb.rank.standby_pool", template]
        self.popen = subprocess.Popen(
            [*sshslots.ssh_command(), *sshslots.ssh_options(), host, shlex.join(words)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # an interrupt of the kernel is not for it
        )
        self.procs: list[RemoteProc] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name=f"hvdnb-standby-{host}", daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            words = raw.decode(errors="replace").split()
            if len(words) < 2 or not words[0].isdigit():
                continue
            with self._lock:
                index = int(words[0])
                p = self.procs[index] if index < len(self.procs) else None
            if p is None:
                continue
            what = words[1]
            if what in ("pid", "ready") and len(words) > 2 and words[2].isdigit():
                p.remote_pid = int(words[2])
                p.ready = p.ready or what == "ready"
            elif what == "taken":
                p.adopted = True
            elif what == "imported" and len(words) > 2 and words[2] not in p.modules:
                p.modules.append(words[2])
            elif what == "exit":
                p.exited = True

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, line: str) -> None:
        try:
            assert self.popen.stdin is not None
            self.popen.stdin.write(line.encode() + b"\n")
            self.popen.stdin.flush()
        except (OSError, ValueError):
            pass  # the session is gone: its standby ended with it

    def spawn(self) -> RemoteProc:
        """One more standby process on this host (it reports itself once started)."""
        with self._lock:
            p = RemoteProc(self, len(self.procs))
            self.procs.append(p)
        self.send("spawn")
        return p

    def close(self) -> None:
        """End the pool: its idle standby processes end with its stdin."""
        try:
            if self.popen.stdin is not None:
                self.popen.stdin.close()
        except OSError:
            pass
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(2)

    def __repr__(self) -> str:
        return f"<HostPool {self.host} {len(self.procs)} processes>"


def launch_env(environ: dict[str, Any]) -> dict[str, str]:
    """The environment a pool's processes start with: what a rank on that host gets."""
    return {**sshslots.forwarded(dict(environ)), "PYTHONUNBUFFERED": "1"}
