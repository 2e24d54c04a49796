"""Before an MPI job across hosts starts: does every host of the hostfile answer ssh?

MPICH's hydra starts a proxy on each host of the hostfile over ssh. When one host does not
answer (no sshd, a host key or password prompt, a cut link), hydra prints ssh's complaint
amid its own stack of errors, or waits as long as ssh does (a dropped SYN: two minutes
with ssh's defaults), and the start fails after its timeout with no host named. So, as
``horovodrun`` does before it launches, hvdnb first runs ``ssh HOST true`` on every other
host at once, with the launcher hydra will use (``HYDRA_LAUNCHER_EXEC``, else ``ssh``) and
no prompt (``BatchMode``), and names in one line each host that did not answer and why.

Owns: that check. Never: a check for a host that is this one, for a launcher other than
ssh (``-launcher slurm`` / ``HYDRA_LAUNCHER``), or one that outlasts the start's timeout.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence

__all__ = ["unreachable", "verdict"]


def _local_names() -> set[str]:
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname()}
    try:
        names.add(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    return names


def _uses_ssh(mpi_args: Sequence[str]) -> bool:
    args = list(mpi_args)
    for i, a in enumerate(args):
        if a in ("-launcher", "--launcher", "-bootstrap") and i + 1 < len(args):
            return args[i + 1] in ("ssh", "rsh")
    return os.environ.get("HYDRA_LAUNCHER", os.environ.get("HYDRA_BOOTSTRAP", "ssh")) == "ssh"


def unreachable(
    hosts: Sequence[str], timeout: float, mpi_args: Sequence[str] = ()
) -> dict[str, str]:
    """Host -> what ssh said, for each of ``hosts`` that did not run ``true`` within
    ``timeout`` seconds (all at once; empty when every one did, or the launcher is not
    ssh)."""
    if not _uses_ssh(mpi_args):
        return {}
    exe = os.environ.get("HYDRA_LAUNCHER_EXEC") or shutil.which("ssh")
    if not exe:
        return {}
    local = _local_names()
    todo = sorted({h for h in hosts if h not in local})
    wait = max(1, int(min(timeout, 30)))
    procs = {
        h: subprocess.Popen(
            [exe, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={wait}", h, "true"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for h in todo
    }
    deadline = time.monotonic() + timeout
    bad: dict[str, str] = {}
    for host, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            bad[host] = f"no answer within {timeout:.0f} s"
            continue
        if proc.returncode != 0:
            lines = [ln.strip() for ln in (err or "").splitlines() if ln.strip()]
            bad[host] = lines[-1] if lines else f"ssh exited with {proc.returncode}"
    return bad


def verdict(bad: dict[str, str], hostfile: str) -> str:
    """The one line that names the hosts that did not answer, and what to do."""
    which = ", ".join(bad)
    why = "; ".join(f"{h}: {w}" for h, w in bad.items())
    first = next(iter(bad))
    return (
        f"host{'s' if len(bad) > 1 else ''} {which} did not answer ssh ({why}). MPI's launcher "
        f"starts the ranks there over ssh: check that `ssh {first} true` works from this host "
        f"without a prompt, or take {which} out of {hostfile}; then `%dist start` again."
    )
