"""Warm standby for ``%dist restart``: processes that have imported torch (and the
frameworks the ranks imported), and a spare controller, ready for the cluster's next start.

Owns: the policy (on, off, how many, and why), the standby processes
(``hvdnb.rank.standby``, started here, each with a control socket) and the listening
socket they share, the spare ``ipyparallel.Cluster`` whose controller is already up, and
the hand-over: a warm start's launcher runs the stand-in ``hvdnb.rank.adopt`` in place of
each engine, which gives its rank to whichever standby accepts (``HVDNB_STANDBY_READY``
of them, the processes alive, ready or still importing; the others start cold). After a
start the pool is topped up again.

Rule for the default (``HVDNB_STANDBY=auto``): one standby per rank. On this host, only
while the memory available (the host's, or what a container's cgroup limit leaves, as on
Binder) is at least ``MEMORY_FACTOR`` times what the standby takes (its processes' count
times a rank's resident memory now): a standby never takes more than a quarter of what is
left. A ``--hosts`` cluster (hydra over ssh, or an elastic one's slots over ssh) keeps its
standby on its hosts, as many on each as it has ranks there (``hoststandby``; their memory
is not read from here); a Slurm cluster, or one of engine sets, has none.
``HVDNB_STANDBY=0`` turns it off, ``=on`` sets one per rank and ``=K`` K processes,
whatever the memory.

Never: start a rank (a standby becomes one only through a launcher's hand-over), let a
standby outlive the kernel (its control socket closes with it), or block a start on one.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from hvdnb.config import get_config
from hvdnb.host import available_memory
from hvdnb.notebook.cluster import launch
from hvdnb.notebook.cluster.hoststandby import HostPool, RemoteProc, launch_env
from hvdnb.notebook.cluster.spec import StartSpec, hostfile_entries
from hvdnb.protocol.handover import import_time_diff, send_line

__all__ = ["MEMORY_FACTOR", "Proc", "Standby", "policy", "switched_off"]

MEMORY_FACTOR = 4
#: seconds a rank waits for a standby to take it: one that is ready answers in ms; one still
#: importing torch (a restart soon after the last) takes as long as its import has left
TAKE_READY_S = 3.0
TAKE_IMPORTING_S = 60.0
_ADOPT = str(Path(__file__).resolve().parents[2] / "rank" / "adopt.py")


_OFF = ("0", "off", "false", "no")


def switched_off() -> bool:
    """Has the user turned the standby off (``HVDNB_STANDBY=0``)?"""
    return str(get_config().standby).strip().lower() in _OFF


def policy(spec: StartSpec, rank_rss: list[int]) -> tuple[int, str]:
    """How many standby processes a cluster of ``spec`` gets (0: none) and why, given its
    ranks' resident memory in bytes."""
    setting = str(get_config().standby).strip().lower()
    if setting in _OFF:
        return 0, "HVDNB_STANDBY=0 turned it off"
    if setting not in ("auto", "on") and not setting.isdigit():
        return 0, (
            f"HVDNB_STANDBY={setting!r} is none of auto, on, 0 or a count; set one of "
            "those (auto: one per rank where memory allows)"
        )
    if spec.tf_ps:
        return 0, "a parameter-server cluster's ranks keep TensorFlow servers"
    if spec.multi_host and not on_hosts(spec):
        return 0, (
            "its ranks run on other hosts through "
            + ("Slurm" if spec.launcher == "slurm" else "engine sets")
            + ": a standby waits only on this host, or on the hosts of `--hosts FILE`"
        )
    if setting.isdigit():
        return int(setting), f"HVDNB_STANDBY={setting}"
    if setting == "on":
        return spec.n, "HVDNB_STANDBY=on"
    if spec.multi_host:
        return spec.n, "one per rank on each host of the hostfile (HVDNB_STANDBY=0 turns it off)"
    per = max(rank_rss) if rank_rss else 0
    need = MEMORY_FACTOR * spec.n * per
    avail = available_memory()
    if per and avail < need:
        return 0, (
            f"{avail / 2**30:.1f} GiB is available and {spec.n} standby processes of "
            f"{per / 2**20:.0f} MiB need {MEMORY_FACTOR}x that free "
            "(HVDNB_STANDBY=on overrides)"
        )
    return spec.n, f"{avail / 2**30:.1f} GiB available (>= {MEMORY_FACTOR}x what it takes)"


def on_hosts(spec: StartSpec) -> bool:
    """Does a cluster of ``spec`` keep its standby on the hosts of its hostfile (hydra over
    ssh, or an elastic cluster's slots over ssh), not on this one?"""
    return bool(spec.multi_host and spec.hosts and spec.launcher == "mpi")


def host_slots(spec: StartSpec) -> dict[str, int]:
    """How many of ``spec``'s ranks each host of its hostfile runs (hydra fills the hosts
    in order, ``mpiexec -f``; an elastic cluster's slots too, ``sshslots.Placement.first``)."""
    order = [h for h, k in hostfile_entries(spec.hosts or "") for _ in range(k)]
    out: dict[str, int] = {}
    for i in range(spec.n):
        host = order[i % len(order)] if order else "localhost"
        out[host] = out.get(host, 0) + 1
    return out


@dataclass
class Proc:
    """One standby process and its control socket."""

    popen: subprocess.Popen[bytes]
    control: socket.socket
    ready: bool = False
    adopted: bool = False
    #: modules it has imported beyond torch (``import`` lines it answered)
    modules: list[str] = field(default_factory=list)
    _buf: bytes = b""
    host = ""  # this host

    def send(self, line: str) -> None:
        send_line(self.control, line)

    def end(self) -> None:
        try:
            self.control.close()  # it exits on EOF ...
            self.popen.kill()  # ... or now, mid-import
        except OSError:
            pass

    @property
    def pid(self) -> int:
        return int(self.popen.pid)

    def poll(self) -> None:
        """Read what it has said (ready, imported ...), without blocking."""
        while True:
            try:
                chunk = self.control.recv(4096, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                chunk = b""
            if not chunk:  # it has exited
                return
            self._buf += chunk
            *lines, self._buf = self._buf.split(b"\n")
            for line in lines:
                words = line.decode(errors="replace").split()
                if words[:1] == ["ready"]:
                    self.ready = True
                elif words[:1] == ["taken"]:
                    self.adopted = True
                elif words[:1] == ["imported"] and words[1] not in self.modules:
                    self.modules.append(words[1])

    def alive(self) -> bool:
        return self.popen.poll() is None

    def memory(self) -> tuple[int, int]:
        """(resident, unique) bytes of this standby and the nanny it holds: resident
        counts pages shared with the ranks (torch's libraries), unique (USS) only what
        ending it would free."""
        rss = uss = 0
        try:
            top = psutil.Process(self.pid)
            for p in [top, *top.children(recursive=True)]:
                info = p.memory_full_info()
                rss, uss = rss + int(info.rss), uss + int(info.uss)
        except psutil.Error:
            pass
        return rss, uss


class Standby:
    """The warm standby of one ``Cluster``, kept across its restarts."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.procs: list[Proc | RemoteProc] = []
        #: standby processes a start took: ranks now (this host's: this kernel's children
        #: to reap)
        self.taken: list[Proc | RemoteProc] = []
        #: the pools on other hosts (``hoststandby``), by host
        self.pools: dict[str, HostPool] = {}
        #: why there is no standby (None: there is one, or none was asked for yet)
        self.why_off: str | None = None
        self.count = 0
        #: why the last start's ranks were not handed to a ready standby (None: they were,
        #: or none was ready)
        self.refused: str | None = None
        self._env: dict[str, str] = {}
        #: frameworks the ranks imported: every standby imports them too
        self.modules: list[str] = []
        self._dir: str | None = None
        self._listener: socket.socket | None = None
        self._spare: Any = None
        self._spare_key: tuple[Any, ...] | None = None

    # ------------------------------------------------------------------ the pool
    @property
    def path(self) -> str | None:
        """The socket a stand-in hands its rank over on (``{host}`` in it: on the pools'
        hosts, filled in there)."""
        return os.path.join(self._dir, "standby.sock") if self._dir else None

    def idle(self) -> list[Proc | RemoteProc]:
        """Standby processes alive and not taken (their state read now). Any thread: the
        side channel's calls ``preload``."""
        with self._lock:
            for p in self.procs:
                p.poll()
            self.taken += [p for p in self.procs if p.adopted]
            self.procs = [p for p in self.procs if p.alive() and not p.adopted]
            return list(self.procs)

    def taken_pids(self) -> list[int]:
        """This host's standby processes that became ranks and still run (reaping those
        that ended: they are this kernel's children)."""
        with self._lock:
            self.idle()
            self.taken = [p for p in self.taken if p.alive()]
            return [p.pid for p in self.taken if isinstance(p, Proc)]

    def taken_count(self) -> int:
        """Standby processes, on any host, that became ranks and still run."""
        self.taken_pids()
        return len(self.taken)

    def ready(self) -> int:
        """How many can take a rank now."""
        return sum(p.ready for p in self.idle())

    def refill(self, cluster: Any) -> None:
        """After a start: top the pool up to what the policy allows for ``cluster``, and
        start a spare controller for its next start. Never raises: a start does not fail
        for its standby."""
        try:
            rss = [p.memory_info().rss for p in map(_proc, cluster.rank_pids()) if p]
            self.count, why = policy(cluster.spec, rss)
            if self.count == 0:
                self.why_off = why
                self.close()
                return
            self.why_off = None
            if import_time_diff(self._env, dict(os.environ)):  # they can serve no rank now
                self.close()
            if on_hosts(cluster.spec):
                self._refill_hosts(cluster.spec)
            else:
                self._open()
                with self._lock:
                    missing = self.count - len(self.idle())
                    self.procs += [self._spawn() for _ in range(max(0, missing))]
            self._start_spare(cluster)
        except Exception as exc:  # the standby is an extra
            self.why_off = f"it could not start: {type(exc).__name__}: {exc}"
            self.close()

    def _refill_hosts(self, spec: StartSpec) -> None:
        """Top up each host's pool to its ranks there (a pool started where none is)."""
        want = host_slots(spec)
        if set(self.pools) - set(want) or self._listener is not None:
            self.close()  # other hosts than this cluster's, or this host's pool
        if self._dir is None:
            self._env = launch_env({**os.environ, **spec.engine_env})
            # one name for every host: each fills in its own (a shared /tmp holds them all)
            self._dir = os.path.join(
                tempfile.gettempdir(), f"hvdnb-standby-{os.urandom(6).hex()}-{{host}}"
            )
        share = max(1, -(-self.count // max(1, spec.n)))  # HVDNB_STANDBY=K: K per rank, rounded up
        for host, ranks in want.items():
            pool = self.pools.get(host)
            if pool is None or not pool.alive():
                pool = self.pools[host] = HostPool(host, self._dir, self._env)
                for module in self.modules:
                    pool.send(f"import {module}")
            with self._lock:
                have = sum(1 for p in self.idle() if p.host == host)
                self.procs += [pool.spawn() for _ in range(max(0, ranks * share - have))]

    def _open(self) -> None:
        if self._listener is not None:
            return
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # every standby of this pool's
        self._dir = tempfile.mkdtemp(prefix="hvdnb-standby-")  # 0700: only we hand over
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(os.path.join(self._dir, "standby.sock"))
        sock.listen(64)
        self._listener = sock

    def _spawn(self) -> Proc:
        assert self._listener is not None
        ours, theirs = socket.socketpair()
        popen = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hvdnb.rank.standby",
                str(self._listener.fileno()),
                str(theirs.fileno()),
                *self.modules,
            ],
            pass_fds=(self._listener.fileno(), theirs.fileno()),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # its own session: an interrupt of the kernel's process group is not for it
            start_new_session=True,
            env=self._env,
        )
        theirs.close()
        return Proc(popen, ours)

    def preload(self, module: str) -> None:
        """A rank imported ``module``: every standby (and every later one) imports it."""
        with self._lock:
            if module in self.modules:
                return
            self.modules.append(module)
        for pool in self.pools.values():  # also for the processes it starts later
            pool.send(f"import {module}")
        for p in self.idle():
            if isinstance(p, Proc):
                p.send(f"import {module}")

    # ------------------------------------------------------------------ a warm start
    def engines(self, n: int, rank_env: dict[str, str]) -> dict[str, Any] | None:
        """How a start of ``n`` ranks with environment ``rank_env`` hands them to the
        standby (``launch.configure_engines``), or None when none can take them (then
        ``refused`` says why, where one was ready)."""
        self.refused = None
        idle = self.idle()
        ready = sum(p.ready for p in idle)
        if not idle or self.path is None or switched_off():
            return None
        if self.pools:  # the ranks a host's stand-ins may hand over: the fewest any host has
            idle = [p for p in idle if p.host in self.pools]
            per = {h: [p for p in idle if p.host == h] for h in self.pools}
            took_per = min(len(ps) for ps in per.values())
            ready = min(sum(p.ready for p in ps) for ps in per.values())
            n = took_per  # a stand-in counts its own host's ranks (MPI_LOCALRANKID)
        diff = import_time_diff(self._env, rank_env)
        if diff:
            self.refused = (
                f"its processes started with other {', '.join(diff)} than the ranks have now "
                "(read when Python starts); the next start makes new ones"
            )
            return None
        # a process still importing is further on than a cold one, which would import
        # beside it on the same cores (a restart soon after the last took 3.3 s against a
        # cold 2.2 s): its ranks wait for it to take them, as long as an import may take
        took = min(len(idle), n)
        wait = TAKE_READY_S if ready >= took else TAKE_IMPORTING_S
        return {
            "cmd": [sys.executable, "-I", "-S", _ADOPT, self.path],
            "env": {
                "HVDNB_STANDBY_READY": str(took),
                "HVDNB_STANDBY_WAIT": str(wait),
                "HVDNB_STANDBY": "1",
            },
        }

    def take_controller(self, spec: StartSpec, loop: Any) -> Any:
        """The spare ``ipyparallel.Cluster`` with its controller up, for a start of ``spec``
        (None: none, or it was started for an incompatible spec; it is then stopped)."""
        spare, key = self._spare, self._spare_key
        self._spare = self._spare_key = None
        if spare is None:
            return None
        ok = key == launch.controller_key(spec) and not switched_off()
        if ok and spare.controller is not None and spare.controller.stop_data is None:
            return spare
        _stop_spare(spare, loop)
        return None

    def _start_spare(self, cluster: Any) -> None:
        if self._spare is not None:
            return
        import uuid  # noqa: PLC0415

        spare = launch.make_ipp(cluster.spec, f"hvdnb-{uuid.uuid4().hex[:8]}", None, None)
        _private_file(getattr(spare, "cluster_file", ""))
        # the launch itself (a Popen) is quick; its connection file comes ~0.5 s later,
        # which a start waits for (``get_connection_info``) only if it comes that soon
        cluster.run_async(spare.start_controller(), timeout=30)
        self._spare, self._spare_key = spare, launch.controller_key(cluster.spec)

    def spare_ready(self) -> bool:
        """Has the spare controller written its engines' connection file (it serves
        registrations from then on; a restart that takes it sooner waits for it)?"""
        spare = self._spare
        if spare is None:
            return False
        name = f"ipcontroller-{spare.cluster_id}-engine.json"
        return os.path.exists(os.path.join(spare.profile_dir, "security", name))

    def spare_pid(self) -> int | None:
        ctrl = getattr(self._spare, "controller", None)
        proc = getattr(ctrl, "process", None)
        return getattr(proc, "pid", None)

    def pids(self) -> list[int]:
        """This host's standby processes (idle standby and the spare controller); the
        pools on other hosts end with their ssh sessions."""
        pids = [p.pid for p in self.idle() if isinstance(p, Proc)]  # this host's only
        spare = self.spare_pid()
        return pids + ([spare] if spare else [])

    def rows(self) -> list[dict[str, Any]]:
        """One row per standby process for ``%dist status``."""
        rows = []
        for p in self.idle():
            rss, uss = p.memory()
            rows.append(
                {
                    "pid": p.pid,
                    "state": "ready" if p.ready else "importing",
                    "rss_mib": round(rss / 2**20),
                    "uss_mib": round(uss / 2**20),
                    "modules": ["torch", *p.modules],
                    "host": p.host,
                }
            )
        return rows

    def line(self) -> str:
        """One line for ``%dist status`` and a restart: what the standby is, or why none."""
        if self.why_off is not None:
            return f"standby: off, because {self.why_off}"
        rows = self.rows()
        if not rows:
            return "standby: none"
        ready = sum(r["state"] == "ready" for r in rows)
        mods = ", ".join(rows[0]["modules"])
        mem = "; ".join(f"{r['rss_mib']} MiB ({r['uss_mib']} its own)" for r in rows)
        hosts = sorted({r["host"] for r in rows if r["host"]})
        if hosts:  # another host's memory is not read from here
            per = ", ".join(f"{sum(r['host'] == h for r in rows)} on {h}" for h in hosts)
            head = f"standby: {ready} of {len(rows)} ready for `%dist restart`, not ranks"
            return f"{head} ({per}); {mods}"
        return (
            f"standby: {ready} of {len(rows)} ready for `%dist restart`, not ranks; "
            f"{mods}; resident: {mem}"
        )

    def close(self, loop: Any = None) -> None:
        """End every idle standby and the spare controller (taken ones are ranks now)."""
        with self._lock:
            procs, self.procs = self.procs, []
        for p in procs:
            p.end()
        for p in procs:  # reaped: they are this kernel's children
            try:
                if isinstance(p, Proc):
                    p.popen.wait(2)
            except subprocess.TimeoutExpired:
                pass
        pools, self.pools = self.pools, {}
        for pool in pools.values():
            pool.close()
        if self._spare is not None:
            _stop_spare(self._spare, loop)
            self._spare = self._spare_key = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._dir is not None:
            if "{host}" not in self._dir:  # a pool removes its own host's
                shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _private_file(path: str) -> None:
    """Make ``path`` an empty file only its owner reads (0600) if it is not there: the
    spare's cluster file, which ipyparallel writes later with ``open(path, "w")`` (the mode
    of a file that exists is kept; a new one would be 0644 under the usual umask, beside
    its 0600 connection files, which it names)."""
    if not path:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    os.chmod(path, 0o600)


def _proc(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _stop_spare(spare: Any, loop: Any) -> None:
    ctrl = getattr(spare, "controller", None)
    if ctrl is None:
        return
    try:
        if loop is not None:
            loop.run(spare.stop_controller(), timeout=10)
        else:
            asyncio.run(spare.stop_controller())
    except Exception:
        proc = getattr(ctrl, "process", None)
        try:
            if proc is not None:
                proc.kill()
        except Exception:
            pass
    try:
        spare.remove_cluster_file()
    except Exception:
        pass
