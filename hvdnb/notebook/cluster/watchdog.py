"""Stop a cluster whose notebook died:
``python -m hvdnb.notebook.cluster.watchdog KERNEL_PID PID... [--cancel CMD...] [--files GLOB...]``.

A kernel killed with SIGKILL (or by the OOM killer) runs no atexit hook, and ipyparallel
leaves its controller, mpiexec and the engines running. Each started cluster gets one of
these tiny processes (stdlib only, in its own session): it polls the kernel ten times a second
and, once the kernel is gone, terminates the process groups it was given (SIGTERM, then
SIGKILL after 2 s), runs the given cancel commands (``scancel JOBID`` for a Slurm
cluster, whose ranks run on other machines) and removes the files the cluster would have
removed on a clean stop (its connection files, cluster file and logs, and its state
directory: ``--files``; a directory is removed with what it holds).
It exits by itself when the cluster stops first.

Never: touch processes or files it was not given, or outlive both the kernel and the cluster.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

#: pid -> its start time (``/proc/PID/stat``'s 22nd field) when the watchdog began, so that a
#: pid the kernel reused for another process is never taken for the cluster's: with a
#: pid_max of 32,768 a long session (or the suite) wraps around within minutes, and a
#: watchdog whose kernel died sent SIGTERM to another cluster's controller
_STARTED: dict[int, str | None] = {}


def _start_time(pid: int) -> str | None:
    """``pid``'s start time in clock ticks since boot (None: no /proc, or no such pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[19]
    except (OSError, IndexError):
        return None


def _same(pid: int) -> bool:
    """Is ``pid`` still the process the watchdog was given (not a reuse of its number)?"""
    was = _STARTED.get(pid)
    return was is None or _start_time(pid) == was


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not _same(pid):
        return False  # gone; its number now names another process
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _signal(pid: int, sig: int) -> None:
    if not _same(pid):
        return  # not the cluster's process any more: never signal it, nor its group
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, sig)
            return
        except (ProcessLookupError, PermissionError):
            continue


_OPTIONS = ("--cancel", "--files")


def _parse(argv: list[str]) -> tuple[int, list[int], list[list[str]], list[str]]:
    """``KERNEL PID... [--cancel CMD ARG...]... [--files GLOB...]``: the cancel commands
    end a batch job; the globs name the files to remove once everything is stopped."""
    kernel, rest = int(argv[0]), argv[1:]
    pids: list[int] = []
    cancels: list[list[str]] = []
    files: list[str] = []
    while rest and rest[0] not in _OPTIONS:
        pids.append(int(rest.pop(0)))
    while rest:
        opt = rest.pop(0)
        args = []
        while rest and rest[0] not in _OPTIONS:
            args.append(rest.pop(0))
        if opt == "--cancel":
            cancels.append(args)
        else:
            files += args
    return kernel, pids, cancels, files


def cluster_files(profile: str, cluster_id: str) -> list[str]:
    """Glob patterns of every file a cluster writes in its ipyparallel profile: connection
    files (with the session key) in security/, logs, the hub's engine-state file and a
    Slurm script and job output in log/. Each name carries the cluster id."""
    return [os.path.join(profile, sub, f"*{cluster_id}*") for sub in ("security", "log")]


def remove_files(patterns: list[str]) -> None:
    """Remove the files matching ``patterns`` (a directory with what it holds); one
    already gone is fine."""
    for pattern in patterns:
        for path in glob.glob(pattern):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
                continue
            try:
                os.unlink(path)
            except OSError:
                pass


def watch(pids: list[int], launchers: list[Any], files: list[str]) -> subprocess.Popen[bytes]:
    """Start the watchdog of this kernel's cluster: its processes ``pids``, the batch
    jobs of its engine ``launchers`` (Slurm, PBS...: cancelled, not killed) and its
    ``files``."""
    cancel: list[str] = []
    for es in launchers:
        job, delete = getattr(es, "job_id", None), getattr(es, "delete_command", None)
        if job and delete:
            cancel += ["--cancel", *map(str, delete), str(job)]
    return subprocess.Popen(
        [sys.executable, "-m", "hvdnb.notebook.cluster.watchdog", str(os.getpid())]
        + [str(pid) for pid in pids]
        + cancel
        + ["--files", *files],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def retire(proc: subprocess.Popen[bytes] | None) -> None:
    """End a watchdog (SIGTERM: it leaves the cluster alone) and reap it: until reaped it
    stays the kernel's zombie, one per ``scale`` that replaced it."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv: list[str]) -> int:
    kernel, pids, cancels, files = _parse(argv)
    if os.path.isdir("/proc/self"):  # where /proc tells, know each process by its start
        for pid in pids:  # started a moment ago by the kernel: these are the cluster's
            _STARTED[pid] = _start_time(pid)
        pids = [p for p in pids if _STARTED[p] is not None]  # gone already: never signalled
    while _alive(kernel) and os.getppid() == kernel:
        if not any(_alive(p) for p in pids):
            return 0  # the cluster stopped first: nothing to guard
        time.sleep(0.1)
    for cmd in cancels:  # e.g. scancel JOBID: the ranks run on other machines
        try:
            subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            pass
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            _signal(pid, signal.SIGKILL)
    remove_files(files)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
