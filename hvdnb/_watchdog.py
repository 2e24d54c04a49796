"""``python -m hvdnb._watchdog KERNEL_PID PID...``: stop a cluster whose notebook died.

A kernel killed with SIGKILL (or by the OOM killer) runs no atexit hook, and ipyparallel
leaves its controller, mpiexec and the engines running. Each started cluster gets one of
these tiny processes (stdlib only, in its own session): it polls the kernel twice a second
and, once the kernel is gone, terminates the process groups it was given (SIGTERM, then
SIGKILL after 2 s). It exits by itself when the cluster stops first.

Never: touch processes it was not given, or outlive both the kernel and the cluster.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _signal(pid: int, sig: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, sig)
            return
        except (ProcessLookupError, PermissionError):
            continue


def main(argv: list[str]) -> int:
    kernel, pids = int(argv[0]), [int(p) for p in argv[1:]]
    while _alive(kernel) and os.getppid() == kernel:
        if not any(_alive(p) for p in pids):
            return 0  # the cluster stopped first: nothing to guard
        time.sleep(0.5)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            _signal(pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
