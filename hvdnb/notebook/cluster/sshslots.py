"""An elastic cluster across hosts: one engine per slot, each started over ssh.

An elastic cluster has no MPI job (a death would end it), so ``--hosts FILE --min-np M``
starts every slot's engine through ipyparallel's own ``SSHEngineSetLauncher``, one engine
set per slot, on the host the hostfile gives it: the first generation fills the hosts in
order, as ``mpiexec -f`` does, and ``%dist scale`` puts a new slot on the first host with a
free slot that answers ssh (the host that was lost, once it is back).

ipyparallel's launcher runs a few short ``ssh HOST python ...`` commands per engine and
keeps one ``ssh HOST python -c 'waitpid'`` per engine, which returns when the engine's
process ends: that is how the notebook learns of a killed rank on another host, within a
round trip. A host that stops answering (a cut link) is found by the controller's
heartbeat, as on one host. Every ssh here is given ``BatchMode`` and a connect timeout, and
a kill of a lost host's engine runs on a thread of its own: nothing waits on a host that
is gone.

As for ``--hosts`` with MPI, the hosts share the notebook's home (the profile's connection
files are read, not copied) and its Python environment at the same path.

Owns: the ssh settings of those engine sets, where each slot runs, and which slots' engines
ended. Never: start an engine itself, or block on a host.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

__all__ = [
    "SSH_OPTIONS",
    "Placement",
    "configure",
    "forwarded",
    "kill",
    "launcher_class",
    "open_shared",
    "slot_launchers",
    "ssh_options",
]

#: what every ssh to a host is given: never a prompt; a dead link found within seconds
SSH_OPTIONS = [
    "-o",
    "BatchMode=yes",
    "-o",
    "ConnectTimeout=5",
    "-o",
    "ServerAliveInterval=2",
    "-o",
    "ServerAliveCountMax=3",
]


#: seconds a shared ssh connection to a host stays open after its last session ends
MUX_PERSIST_S = 60


def ssh_options() -> list[str]:
    """``SSH_OPTIONS`` plus OpenSSH's connection sharing: the first ssh to a host opens a
    connection the next ones reuse (``ControlMaster=auto``), as Ansible does. ipyparallel's
    launcher runs a few ssh calls per engine; each new connection costs a key exchange
    (0.3-1.0 s across the namespace hosts, 0.1-0.5 s shared). The sockets live in a 0700
    directory of this user's, one per kernel (a master of another kernel's, for hosts of the
    same name elsewhere, is never reused); where it cannot be made so, each ssh connects afresh. The
    check that a host answers (``sshcheck``) never shares: it must see the link as it is."""
    d = os.path.join(tempfile.gettempdir(), f"hvdnb-ssh-{os.getuid()}")
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        st = os.stat(d)
    except OSError:
        return list(SSH_OPTIONS)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:  # another user's, or open to others
        return list(SSH_OPTIONS)
    mux = [
        "ControlMaster=auto",
        f"ControlPath={d}/{os.getpid()}-%C",
        f"ControlPersist={MUX_PERSIST_S}",
    ]
    return [*SSH_OPTIONS, *(w for o in mux for w in ("-o", o))]


def open_shared(hosts: list[str], timeout: float = 15.0) -> None:
    """Open the shared connection to each of ``hosts`` at once (``ssh HOST true``, side by
    side), before slots start side by side: their first calls would each try to become
    the host's master, and all but one say "ControlSocket ... already exists, disabling
    multiplexing" and connect afresh. Never raises: a host that does not answer is the
    launcher's to report."""
    argv = [*ssh_command(), *ssh_options()]
    procs = []
    for host in dict.fromkeys(hosts):
        try:
            procs.append(
                subprocess.Popen(
                    [*argv, host, "true"],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        except OSError:
            return
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def ssh_command() -> list[str]:
    """The ssh hvdnb reaches the hosts with: hydra's (``HYDRA_LAUNCHER_EXEC``), else ssh."""
    return shlex.split(os.environ.get("HYDRA_LAUNCHER_EXEC") or "ssh")


#: the notebook's variables an engine on another host is not given: they describe this
#: host or this login session, not the job (the rest travel, as hydra's and srun's do)
NOT_FORWARDED = frozenset(
    {"HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "DISPLAY", "XAUTHORITY", "TMUX", "TERM"}
)


def forwarded(environ: dict[str, str]) -> dict[str, str]:
    """The notebook's environment as an engine on another host gets it: ipyparallel's ssh
    launcher sends only the variables it is given, where hydra (``-genvall``) and ``srun``
    (``--export=ALL``) send them all; hvdnb sends them all too, but this host's own."""
    return {
        k: v
        for k, v in environ.items()
        if k not in NOT_FORWARDED and not k.startswith(("SSH_", "JPY_"))
    }


def launcher_class() -> type:
    """The engine set launcher of an elastic cluster across hosts (``sshlauncher``)."""
    from hvdnb.notebook.cluster.sshlauncher import (  # noqa: PLC0415  ipyparallel is heavy: loaded where used
        HostEngineSetLauncher,
    )

    return HostEngineSetLauncher


def configure(c: Any) -> None:
    """Set up ipyparallel cluster ``c``'s ``SSHEngineSetLauncher`` for hvdnb's hosts."""
    cfg = c.config.SSHEngineSetLauncher
    cfg.remote_python = sys.executable  # the same environment, at the same path
    ssh = ssh_command()
    cfg.ssh_cmd = ssh
    options = ssh_options()
    cfg.ssh_args = options
    # the engine's log is fetched with scp when it ends: through the same ssh
    cfg.scp_cmd = ["scp", "-q", "-S", ssh[0], *options]
    cfg.remote_profile_dir = c.profile_dir  # a shared home: the same directory


class Placement:
    """Which host each slot of an elastic cluster runs on.

    Parameters
    ----------
    entries : the hostfile's ``(host, slots)``, in order (``spec.hostfile_entries``)
    """

    def __init__(self, entries: list[tuple[str, int]]) -> None:
        self.entries = list(entries)
        self.host_of: dict[int, str] = {}

    def first(self, n: int) -> list[str]:
        """The hosts of slots ``0..n-1``: the hostfile's slots filled in order (past its
        last slot, round again)."""
        order = [h for h, k in self.entries for _ in range(k)] or ["localhost"]
        return [order[i % len(order)] for i in range(n)]

    def free(self, members: list[int], n: int, answers: Any) -> list[str]:
        """Hosts for ``n`` new slots beside ``members``: each on the first host of the
        hostfile with a slot no member holds and that ``answers(host)`` (ssh); a host is
        filled before the next. Raises ``LookupError`` naming the hosts when too few."""
        used: dict[str, int] = {}
        for s in members:
            h = self.host_of.get(s, "")
            used[h] = used.get(h, 0) + 1
        out: list[str] = []
        silent: list[str] = []
        for host, k in self.entries:
            room = k - used.get(host, 0)
            if room <= 0:
                continue
            if not answers(host):
                silent.append(host)
                continue
            out += [host] * min(room, n - len(out))
            if len(out) == n:
                return out
        why = f" ({', '.join(silent)} did not answer ssh)" if silent else ""
        raise LookupError(
            f"the hostfile has room for {len(out)} more rank(s), not {n}{why}: free a host's "
            "slot, or bring the host back"
        )

    def env(self, slot: int, hosts: list[str]) -> dict[str, str]:
        """Slot ``slot``'s place among the first generation's ``hosts`` (one per slot)."""
        mine = hosts[slot]
        order = list(dict.fromkeys(hosts))
        local = [s for s, h in enumerate(hosts) if h == mine]
        return {
            "HVDNB_LOCAL_RANK": str(local.index(slot)),
            "HVDNB_LOCAL_SIZE": str(len(local)),
            "HVDNB_CROSS_RANK": str(order.index(mine)),
            "HVDNB_CROSS_SIZE": str(len(order)),
        }


def slot_launchers(launchers: list[Any]) -> dict[int, Any]:
    """The engine launcher of each slot (engine set ``slot<N>``) started over ssh."""
    out: dict[int, Any] = {}
    for es in launchers:
        sid = str(getattr(es, "engine_set_id", ""))
        if not sid.startswith("slot") or not hasattr(es, "engines"):  # local: no ``engines``
            continue
        for el in list(getattr(es, "launchers", {}).values()):
            try:
                out[int(sid[4:])] = el
            except ValueError:
                pass
    return out


#: seconds a lost slot's kill keeps trying a host that does not answer (a cut link that
#: comes back must not bring a stale rank back with it)
KILL_FOR = 600.0


def kill(el: Any, tries_for: float = KILL_FOR) -> None:
    """Kill a slot's engine over ssh, on a thread of its own: a lost host does not answer
    (ssh gives up after its connect timeout), so it is tried again every few seconds for
    ``tries_for`` seconds, until ssh reaches the host (the engine is then killed, or had
    ended)."""

    def run() -> None:
        deadline = time.monotonic() + tries_for
        # a killed engine's ssh waitpid returns within a round trip: an engine seen ended
        # is not signalled (the host would print a ProcessLookupError traceback for it)
        time.sleep(1.0)
        while getattr(el, "state", "running") == "running":
            try:
                el.signal(signal.SIGKILL)
                return
            except subprocess.CalledProcessError as exc:
                if exc.returncode != 255 or time.monotonic() > deadline:
                    return  # 255: ssh's own failure; else the host answered
            except Exception:
                return
            time.sleep(2.0)

    threading.Thread(target=run, name="hvdnb-ssh-kill", daemon=True).start()
