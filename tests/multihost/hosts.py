"""Hosts made of namespaces: a login node, two hosts with their own sshd, and an outsider.

Each "machine" is a network namespace on one bridge (203.0.113.0/28, in TEST-NET-3), entered
with ``nsenter --net`` (not ``ip netns exec``: that remounts ``/sys``, which slurmd needs),
plus ``unshare --uts --mount`` for its own hostname and its own ``/etc/hosts`` (a bind
mount inside that mount namespace; the machine's own file is never touched):

============  ==============  =====================================================
name          address         what runs there
============  ==============  =====================================================
(root)        203.0.113.1     the test (jupyter_client, as the browser's server would)
``login``     203.0.113.10    the notebook kernel; mpiexec; the controller
``h1``        203.0.113.11    sshd; the ranks hydra starts there
``h2``        203.0.113.12    sshd; the ranks hydra starts there
``out``       203.0.113.13    nothing: an outsider that tries the cluster's ports
============  ==============  =====================================================

What stays shared, as on a cluster with a shared home: the file system (so the venv,
``/tmp`` and the profile directory), ``/dev/shm`` and process ids. That hides what a real
cluster would show: a Python at another path on a host, files written on one host and
read on another before a shared file system syncs, and MPICH's shared-memory transport
between "hosts" (MPICH still treats each hydra proxy as a node and uses TCP between them).
A process on one host can also see (and signal) another host's processes here.

ssh: the test makes one key, puts it in each sshd's ``AuthorizedKeysFile`` (the test's
own file) and in an ssh config that hydra uses through ``HYDRA_LAUNCHER_EXEC`` (ssh reads
the passwd entry's home, so ``$HOME`` cannot point it elsewhere). Root only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NET = "203.0.113"
ROOT_ADDR = f"{NET}.1"
#: the bridge's prefix: a /28 (.0-.15), never the whole /24, which the root namespace would
#: then route to the bridge: a box may reach real services in that /24 (this one's package
#: registries' proxy is 203.0.113.80; with a /24 every pip install of the suite's other
#: lane failed with "No route to host" while these hosts were up)
PREFIX = 28
#: name -> address of the machines (the bridge's own address is the root namespace's)
MACHINES = {"login": f"{NET}.10", "h1": f"{NET}.11", "h2": f"{NET}.12", "out": f"{NET}.13"}
HOSTS = ("h1", "h2")

SSHD = "/usr/sbin/sshd"
SFTP = "/usr/lib/openssh/sftp-server"

#: ``python -c REAPER ARGV...``: run ARGV as a child subreaper's child, reap every orphan
#: below it, pass SIGTERM on, and end with ARGV
REAPER = r"""
import ctypes, os, signal, subprocess, sys
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
child = subprocess.Popen(sys.argv[1:])
signal.signal(signal.SIGTERM, lambda *_: child.terminate())
while True:
    try:
        pid, status = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    except InterruptedError:
        continue
    if pid == child.pid:
        child.returncode = os.waitstatus_to_exitcode(status)
        break
sys.exit(child.returncode or 0)
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def why_not() -> str:
    """Why namespace hosts cannot be built here ("" when they can)."""
    if os.geteuid() != 0:
        return "namespace hosts need root (network and mount namespaces): run as root"
    for tool in ("ip", "nsenter", "unshare", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2, util-linux, openssh-client)"
    if not os.path.exists(SSHD):
        return "sshd is not installed: apt-get install openssh-server (.ci/run does)"
    if _ip("netns", "list", check=False).returncode != 0:
        return "`ip netns` does not work here (no CAP_SYS_ADMIN / netns support)"
    return ""


class Hosts:
    """The bridge, the four namespaces, their ``/etc/hosts`` and the hosts' sshd."""

    def __init__(self) -> None:
        tag = secrets.token_hex(2)
        self.tag = tag
        self.bridge = f"hvh{tag}"
        self.ns = {name: f"hvdnb-{tag}-{name}" for name in MACHINES}
        self.veth = {name: f"hvh{tag}{name[:3]}" for name in MACHINES}
        self.dir = Path(tempfile.mkdtemp(prefix=f"hvdnb-hosts-{tag}-"))
        self.hosts_file = self.dir / "hosts"
        self.ssh_config = self.dir / "ssh_config"
        self.ssh = self.dir / "ssh"  # what hydra runs (HYDRA_LAUNCHER_EXEC)
        self.sshd: dict[str, subprocess.Popen] = {}

    # -- the network ----------------------------------------------------------------------

    @staticmethod
    def sweep() -> list[str]:
        """Remove what a killed run left (its namespaces, their processes, its bridge):
        another set of these hosts on the box puts the same address on a bridge in the
        root namespace, and its routes then break this one's. Only one set is up at a
        time (the suite runs ``tests/multihost`` in one lane; the bench alone), so any
        left is stale. Returns what was removed."""
        gone = []
        names = _ip("netns", "list", check=False).stdout.split()
        for ns in (n for n in names if re.fullmatch(r"hvdnb-[0-9a-f]{4}-\w+", n)):
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)
            gone.append(ns)
        for line in _ip(
            "-o", "addr", "show", "to", f"{ROOT_ADDR}/32", check=False
        ).stdout.splitlines():
            dev = line.split()[1]
            _ip("link", "del", dev, check=False)
            gone.append(dev)
        return gone

    def up(self) -> None:
        self.sweep()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{ROOT_ADDR}/{PREFIX}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for name, addr in MACHINES.items():
            ns, veth = self.ns[name], self.veth[name]
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/{PREFIX}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        lines = ["127.0.0.1 localhost"] + [f"{a} {n}" for n, a in MACHINES.items() if n != "out"]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        self._keys()
        for name in HOSTS:
            self.start_sshd(name)

    def cut(self, name: str) -> None:
        """Take ``name``'s link down (its processes live on, unreachable)."""
        _ip("link", "set", self.veth[name], "down")

    def mend(self, name: str) -> None:
        _ip("link", "set", self.veth[name], "up", "master", self.bridge)

    def teardown(self) -> None:
        for proc in self.sshd.values():
            proc.terminate()
        for proc in self.sshd.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for name in MACHINES:
            _ip("link", "del", self.veth[name], check=False)
            _ip("netns", "del", self.ns[name], check=False)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- processes on a machine -----------------------------------------------------------

    def on(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run on machine ``name``: its network, hostname and ``/etc/hosts``."""
        return [
            "nsenter",
            f"--net=/run/netns/{self.ns[name]}",
            "unshare",
            "--uts",
            "--mount",
            "--",
            "sh",
            "-c",
            'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"',
            name,
            str(self.hosts_file),
            *argv,
        ]

    # -- ssh ------------------------------------------------------------------------------

    def _keys(self) -> None:
        key = self.dir / "id_ed25519"
        for path in (key, self.dir / "host_key"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)],
                check=True,
                timeout=30,
            )
        shutil.copy(f"{key}.pub", self.dir / "authorized_keys")
        self.ssh_config.write_text(
            f"Host *\n  IdentityFile {key}\n  IdentitiesOnly yes\n  BatchMode yes\n"
            "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
            "  ConnectTimeout 5\n"
        )
        self.ssh.write_text(f'#!/bin/sh\nexec ssh -F {self.ssh_config} "$@"\n')
        self.ssh.chmod(0o755)
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory

    def start_sshd(self, name: str) -> None:
        cfg = self.dir / f"sshd_{name}"
        cfg.write_text(
            f"ListenAddress {MACHINES[name]}\nPort 22\nHostKey {self.dir / 'host_key'}\n"
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}\nPidFile {self.dir}/sshd_{name}.pid\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nUsePAM no\n"
            "StrictModes no\nAcceptEnv *\nPermitUserEnvironment no\nLogLevel ERROR\n"
            f"Subsystem sftp {SFTP}\n"  # scp's protocol (Debian's sshd_config has it too)
        )
        # under a reaper: a process the host's sessions left behind is reaped when it
        # ends, as a real host's init does (this machine's pid 1 reaps nothing, and a
        # zombie looks alive to a waitpid over ssh)
        self.sshd[name] = subprocess.Popen(
            self.on(name, [sys.executable, "-c", REAPER, SSHD, "-D", "-e", "-f", str(cfg)]),
            stdout=subprocess.DEVNULL,
            stderr=open(self.dir / f"sshd_{name}.log", "wb"),  # noqa: SIM115  the daemon's
        )
        self.wait_ssh(name)

    def stop_sshd(self, name: str) -> None:
        proc = self.sshd.pop(name)
        proc.terminate()
        proc.wait(10)

    def wait_ssh(self, name: str, timeout: float = 20.0) -> None:
        """Until ``ssh name true`` works from the login node."""
        deadline = time.monotonic() + timeout
        while True:
            got = subprocess.run(
                self.on("login", [str(self.ssh), name, "true"]),
                capture_output=True,
                text=True,
                timeout=30,
            )
            if got.returncode == 0:
                return
            if time.monotonic() > deadline:
                log = (self.dir / f"sshd_{name}.log").read_text(errors="replace")
                raise RuntimeError(f"ssh to {name} failed: {got.stderr.strip()}\n{log}")
            time.sleep(0.2)

    # -- the outsider ---------------------------------------------------------------------

    def knock(self, addr: str, port: int, payload: bytes = b"GET / HTTP/1.0\r\n\r\n") -> str:
        """From the outsider: connect to ``addr:port`` and send ``payload``; what happened
        (``refused``, ``timeout``, or ``open`` with the bytes it got back)."""
        code = (
            "import socket,sys\n"
            "s=socket.socket(); s.settimeout(3)\n"
            "try:\n"
            f"    s.connect(({addr!r},{port})); s.sendall({payload!r}); s.settimeout(1)\n"
            "    try: got=s.recv(64)\n"
            "    except socket.timeout: got=b''\n"
            "    print('open', got)\n"
            "except ConnectionRefusedError: print('refused')\n"
            "except (socket.timeout, OSError) as e: print('timeout', e)\n"
        )
        import sys

        got = subprocess.run(
            self.on("out", [sys.executable, "-c", code]), capture_output=True, text=True, timeout=30
        )
        return got.stdout.strip() or got.stderr.strip()


def listening(pids: list[int]) -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every TCP socket the processes listen on, each
    read in its own network namespace (``/proc/PID/net/tcp*``: psutil reads the caller's)."""
    import ipaddress

    found = []
    for pid in pids:
        try:
            inodes = set()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            rows = []
            for table in ("tcp", "tcp6"):
                rows += Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:  # gone meanwhile
            continue
        for row in rows:
            f = row.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            addr = ipaddress.ip_address(raw)
            if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
                addr = addr.ipv4_mapped
            found.append((pid, name, str(addr), int(hexport, 16)))
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: the two-node Slurm's ports: beside tests/slurm/setup_slurm.sh's one-node Slurm (6817/6818)
SLURMCTLD_PORT, SLURMD_PORT = 6917, 6918


class TwoNodeSlurm:
    """slurmctld on the login node and a slurmd on each host, with their own ``SLURM_CONF``,
    ports, spool, pid and log files under the hosts' directory (``../shared/FIELD-NOTES.md``:
    slurmd entered with ``nsenter``, its steps inheriting its hostname and ``/etc/hosts``;
    one munged in the root namespace serves every namespace through its socket file)."""

    def __init__(self, hosts: Hosts, cpus: int = 2) -> None:
        self.hosts = hosts
        self.cpus = cpus  # per node: 1 puts one task of a job on each node
        self.dir = hosts.dir / "slurm"
        self.conf = self.dir / "slurm.conf"
        self.procs: list[subprocess.Popen] = []

    @staticmethod
    def why_not() -> str:
        for tool in ("slurmctld", "slurmd", "sbatch", "munged"):
            if shutil.which(tool) is None:
                return f"`{tool}` is not installed (tests/slurm/setup_slurm.sh installs Slurm)"
        if not os.path.exists("/run/munge/munge.socket.2"):
            return "munged is not running (tests/slurm/setup_slurm.sh starts it)"
        return ""

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def up(self, timeout: float = 60.0) -> None:
        d = self.dir
        (d / "ctld").mkdir(parents=True)
        nodes = "\n".join(
            f"NodeName={h} NodeAddr={MACHINES[h]} CPUs={self.cpus} RealMemory=2000 State=UNKNOWN"
            for h in HOSTS
        )
        self.conf.write_text(
            f"""# written by tests/multihost/hosts.py: two nodes, for tests only
ClusterName=hvdnb-two
SlurmctldHost=login({MACHINES["login"]})
SlurmctldPort={SLURMCTLD_PORT}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={d}/ctld
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
SlurmdTimeout=30
KillWait=2
{nodes}
PartitionName=two Nodes={",".join(HOSTS)} Default=YES MaxTime=INFINITE State=UP
"""
        )
        (d / "cgroup.conf").write_text("ConstrainCores=no\n")
        env = {**os.environ, **self.env()}
        h = self.hosts
        self.procs.append(
            subprocess.Popen(
                h.on("login", ["slurmctld", "-D", "-i", "-f", str(self.conf)]),
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        for host in HOSTS:
            self.procs.append(
                subprocess.Popen(
                    h.on(host, ["slurmd", "-D", "-N", host, "-f", str(self.conf)]),
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + timeout
        while True:
            got = self.run(["sinfo", "-h", "-N", "-o", "%N %T"])
            states = dict(line.split() for line in got.stdout.splitlines() if line.strip())
            if all(states.get(n) in ("idle", "mixed", "allocated") for n in HOSTS):
                return
            if time.monotonic() > deadline:
                log = (d / "slurmctld.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the two-node Slurm did not come up: {states}\n{log}")
            time.sleep(0.3)

    def run(self, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm client command on the login node."""
        return subprocess.run(
            self.hosts.on("login", argv),
            env={**os.environ, **self.env()},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def down(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


WHERE = r"""%%distributed -q -o where
import os, socket
import hvdnb.torch as hvd
hvd.init()
keys = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "WORLD_SIZE")
where = dict(host=socket.gethostname(), **{k: int(os.environ[k]) for k in keys},
             hvd=(hvd.rank(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
                  hvd.cross_size()), master=os.environ["MASTER_ADDR"])
where
"""


def where(k: Any) -> dict[int, dict]:
    """Each rank's host, torchrun variables, Horovod numbers and ``MASTER_ADDR`` (``k``: a
    headless ``Kernel`` with a cluster running)."""
    got = k.run(WHERE, timeout=120)
    assert got.error is None, got.traceback[-2000:]
    shown = k.run("import json; print(json.dumps({str(r): w for r, w in where.items()}))")
    return {int(r): w for r, w in json.loads(shown.text).items()}


def wait_standby(k: Any, n: int = 4, within: float = 240) -> str:
    """Wait until the login kernel's standby is ready on every host (``n`` processes, two
    per host); returns its ``%dist status`` line, which the caller checks."""
    deadline, line = time.monotonic() + within, ""
    while time.monotonic() < deadline:
        status = k.run("%dist status").text
        line = next((x for x in status.splitlines() if x.startswith("standby:")), status)
        if f"standby: {n} of {n} ready" in line:
            break
        time.sleep(1)
    return line


def check_numbering(where: dict[int, dict], master: str = MACHINES["h1"]) -> None:
    """Four ranks, two per host, numbered by host; every name for the numbers agrees;
    ``MASTER_ADDR`` is ``master`` (rank 0's host; an elastic cluster's store is on the
    login node)."""
    assert sorted(where) == [0, 1, 2, 3]
    for rank, w in where.items():
        node, local = divmod(rank, 2)
        assert w["host"] == HOSTS[node], where  # ranks are numbered by host
        assert (w["RANK"], w["WORLD_SIZE"]) == (rank, 4), w
        assert (w["LOCAL_RANK"], w["LOCAL_WORLD_SIZE"]) == (local, 2), w
        assert (w["GROUP_RANK"], w["NODE_RANK"]) == (node, node), w
        # Horovod's view of the same numbers: rank, local rank and size, cross rank and size
        assert w["hvd"] == [rank, local, 2, node, 2], w
        assert w["master"] == master, w


def two_node_slurm(cpus: int = 2) -> Any:
    """A module fixture's body: the namespace hosts and a two-node Slurm on them, torn down
    after; skips (saying why) where they cannot be built."""
    import pytest

    reason = why_not() or TwoNodeSlurm.why_not()
    if reason:
        pytest.skip(reason)
    net = Hosts()
    cluster = TwoNodeSlurm(net, cpus=cpus)
    try:
        net.up()
        cluster.up()
    except Exception as exc:
        cluster.down()
        net.teardown()
        pytest.skip(f"cannot bring up the two-node Slurm: {exc}")
    try:
        yield cluster
    finally:
        cluster.down()
        net.teardown()
