"""Start, watch and stop a cluster of ipyparallel engines under MPI, ready to train.

Owns: the life of the ``ipyparallel.Cluster`` (controller + engines) that ``launch.py``
configures: input validation, starting engines and controller together (so the engines'
``import torch`` overlaps the controller's start-up), connecting, watching the ranks, and
clean stops (engines first, then the controller: 0.2 s instead of ipyparallel's 3.5 s)
that leave no process or file behind, even when the notebook is killed (a watchdog).
Every ipyparallel coroutine runs on one private event-loop thread so that launcher
callbacks (an engine set exiting) keep working.

Across hosts (``launcher="slurm"``/``"ssh"``/..., ``hosts=HOSTFILE`` for one MPI job over
several hosts under hydra, or ``engine_sets=[...]`` for one engine set per host): the
controller and the side channel listen on one reachable address (``ip``; by default the
address of this host's route to the first host named, else its hostname's address),
never on every interface; rank 0's rendezvous store listens on its own route to the
notebook; transports are not pinned to ``lo``. Slurm jobs are submitted with ipyparallel's
``SlurmEngineSetLauncher`` (an sbatch script running ``srun``), never a scheduler of ours.

Never: import torch in the notebook kernel (it would cost seconds and may initialise CUDA
where engines need it), choose fixed ports, or listen beyond loopback unless a multi-host
launcher asks for it.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import re
import shutil
import socket
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from hvdnb.config import get_config
from hvdnb.notebook.cluster import launch
from hvdnb.host import cores, gpu_count, route_addr
from hvdnb.notebook.cluster.launch import ClusterError, find_mpiexec
from hvdnb.protocol import kinds
from hvdnb.protocol.remote import ENGINE_INFO

__all__ = ["Cluster", "ClusterError", "cores", "current", "find_mpiexec", "gpu_count"]

log = logging.getLogger("hvdnb")
#: engine output lines that only bury the message: C++ frames, ipengine start-up chatter
_NOISE = re.compile(
    r"^(frame #\d+:|<omitting python frames>|Exception raised from |.*\[IPEngine\] WARNING"
    r"|.*WARNING \| (Not using CurveZMQ|debugpy_stream)|.*\[KernelNanny)"
)

#: launchers that start engines on this host only (controller stays on loopback)
_LOCAL_LAUNCHERS = {"mpi", "local"}
_ALL: weakref.WeakSet[Cluster] = weakref.WeakSet()
_CURRENT: Cluster | None = None


def current() -> Cluster | None:
    """The cluster that ``%dist`` and ``%%distributed`` act on (None before ``%dist start``)."""
    return _CURRENT


class _LoopThread:
    """One long-lived asyncio loop in a daemon thread, for ipyparallel's coroutines."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="hvdnb-cluster", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        assert self._loop is not None
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise


class Cluster:
    """MPI engines with torch.distributed initialised on each, driven from a notebook.

    Parameters
    ----------
    n : number of ranks (default: the number of GPUs, else 2)
    backend : "gloo", "nccl" or None for automatic (nccl with GPUs, gloo without)
    launcher : ipyparallel engine launcher: "mpi" (default), or "slurm", "ssh", ... passed
        through to ipyparallel
    timeout : seconds to wait for all engines to be ready
    oversubscribe : allow more ranks than cores (or GPUs) on this host
    engine_env : extra environment variables for the engines
    launcher_config : extra ipyparallel config for the engine launcher class, e.g.
        ``{"mpi_args": ["-hostfile", "hosts"]}``
    hosts : an MPI hostfile (``host[:slots]`` per line): one MPI job across those hosts
        under MPICH's hydra ``mpiexec -f HOSTFILE``
    engine_sets : one engine set per host instead of one MPI job: a list of dicts with
        ``n`` (ranks on that host) and ipyparallel ``MPILauncher`` traits such as
        ``mpi_cmd`` (e.g. ``["ssh", "gpu2", "mpiexec"]``) or ``mpi_args``; global ranks
        are numbered set after set
    ip : the address the controller and the side channel listen on when ranks run on
        other hosts (default: this host's address on the route to them); ignored (loopback)
        when every rank is on this host
    partition, time_limit, gpus_per_node, account, sbatch_args : Slurm job options
        (``launcher="slurm"``): ``#SBATCH --partition/--time/--gpus-per-node/--account``
        lines, plus any further ``sbatch`` arguments

    Examples
    --------
    >>> with Cluster(n=2) as c:                               # doctest: +SKIP
    ...     c.run_cell("import torch.distributed as d; print(d.get_rank())")
    """

    def __init__(
        self,
        n: int | None = None,
        *,
        backend: str | None = None,
        launcher: str = "mpi",
        timeout: float | None = None,
        oversubscribe: bool = False,
        engine_env: dict[str, str] | None = None,
        launcher_config: dict[str, Any] | None = None,
        hosts: str | None = None,
        engine_sets: list[dict[str, Any]] | None = None,
        ip: str | None = None,
        partition: str | None = None,
        time_limit: str | None = None,
        gpus_per_node: int | None = None,
        account: str | None = None,
        sbatch_args: list[str] | None = None,
    ) -> None:
        cfg = get_config()
        if not isinstance(launcher, str) or not launcher:
            raise ClusterError(
                f"launcher must be a name such as 'mpi' or 'slurm', not {launcher!r}"
            )
        self.launcher = launcher.lower()
        self.hosts = self._check_hostfile(hosts) if hosts else None
        self.engine_sets = self._check_sets(engine_sets, n) if engine_sets else None
        if self.hosts and self.launcher != "mpi":
            raise ClusterError(
                f"a hostfile runs one MPI job across hosts: use it with --launcher mpi, not "
                f"{self.launcher!r} (Slurm chooses the hosts itself)"
            )
        if self.engine_sets is not None:
            n = sum(int(es["n"]) for es in self.engine_sets)
        if self.hosts and n is None:
            n = launch.hostfile_slots(self.hosts)  # mpiexec -f fills the slots in order
        #: ranks may run on other hosts: listen on a reachable address, pin nothing to lo
        self.multi_host = bool(
            self.launcher not in _LOCAL_LAUNCHERS or self.hosts or self.engine_sets
        )
        self.slurm = {
            "partition": partition,
            "time": time_limit,
            "gpus-per-node": gpus_per_node,
            "account": account,
        }
        self.sbatch_args = list(sbatch_args or [])
        if self.launcher != "slurm" and (any(self.slurm.values()) or self.sbatch_args):
            raise ClusterError(
                "--partition, --time, --gpus-per-node, --account and sbatch arguments are "
                "Slurm options: add `--launcher slurm`"
            )
        gpus = gpu_count()
        self.n = self._check_n(n, oversubscribe or bool(cfg.oversubscribe) or self.multi_host, gpus)
        if backend not in (None, "auto", "gloo", "nccl", "mpi"):
            raise ClusterError(
                f"unknown backend {backend!r}: use gloo (CPU), nccl (GPU), mpi, or leave it "
                "out for automatic"
            )
        self.backend = None if backend == "auto" else backend
        if self.backend == "nccl" and not self.multi_host and 0 < gpus < self.n:
            raise ClusterError(
                f"--backend nccl needs one GPU per rank, and {self.n} ranks would share this "
                f"host's {gpus} GPU(s): NCCL refuses two ranks on one GPU. Use `-n {gpus}`, or "
                "leave --backend out (ranks that share a GPU use gloo)."
            )
        if timeout is not None and not timeout > 0:
            raise ClusterError(f"timeout must be a positive number of seconds, not {timeout!r}")
        self.timeout = float(timeout or cfg.start_timeout)
        self.engine_env = dict(engine_env or {})
        self.launcher_config = dict(launcher_config or {})
        self.ip = self._listen_ip(ip, cfg.ip)
        self.cluster_id = f"hvdnb-{uuid.uuid4().hex[:8]}"
        self.client: Any = None
        self.view: Any = None
        self.channel: Any = None
        self.channel_endpoint = ""
        self.state_dir: str | None = None
        self._ipp: Any = None
        self._loop: _LoopThread | None = None
        self.generation = 0
        self.cell_no = 0
        #: every %%distributed cell run on this cluster (``hvdnb.notebook.export.ExportCell``)
        self.history: list[Any] = []
        #: rank -> what the notebook saw of its death ("died in cell 4: ...")
        self.death_notes: dict[int, str] = {}
        self._info_seen: dict[int, Any] = {}  # last engine_info per rank (for dead ones)
        self.last_cell: dict[int, dict[str, Any]] = {}
        self.started_at: float | None = None
        self.start_seconds: float | None = None

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _check_n(n: Any, oversubscribe: bool, gpus: int) -> int:
        if n is None:
            n = get_config().ranks or gpus or 2
        if isinstance(n, bool) or not isinstance(n, int):
            raise ClusterError(f"-n must be a whole number of ranks, not {n!r}")
        if n < 1:
            raise ClusterError(f"-n must be at least 1 (got {n}); e.g. `%dist start -n 2`")
        limit, what = (gpus, "GPUs") if gpus else (cores(), "CPU cores")
        if n > limit and not oversubscribe:
            share = " (ranks sharing a GPU use gloo: NCCL needs a GPU per rank)" if gpus else ""
            raise ClusterError(
                f"{n} ranks but this host has {limit} {what}: ranks would share them and run "
                f"slower. Use `-n {limit}`, or add `--oversubscribe` if you mean it{share}."
            )
        return n

    @staticmethod
    def _check_hostfile(path: str) -> str:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ClusterError(
                f"hostfile {path!r} not found: write one host per line (`gpu1:4` for 4 "
                "ranks on gpu1), then `%dist start --hosts FILE`"
            )
        if not launch.hostfile_hosts(str(p)):
            raise ClusterError(f"hostfile {path!r} names no host: one `host[:slots]` per line")
        return str(p.resolve())

    @staticmethod
    def _check_sets(sets: Any, n: Any) -> list[dict[str, Any]]:
        if not isinstance(sets, list) or not sets:
            raise ClusterError("engine_sets must be a non-empty list of dicts with `n`")
        out = []
        for i, es in enumerate(sets):
            k = es.get("n") if isinstance(es, dict) else None
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ClusterError(f"engine set {i} needs `n`, a whole number >= 1 (got {es!r})")
            out.append(dict(es))
        total = sum(es["n"] for es in out)
        if n is not None and n != total:
            raise ClusterError(f"-n {n} but the engine sets hold {total} ranks: leave -n out")
        return out

    def _listen_ip(self, ip: str | None, default: str) -> str:
        """Loopback for one host; across hosts one reachable address, never every one."""
        if not self.multi_host:
            return ip or default
        if ip:
            return ip
        if default not in ("127.0.0.1", "localhost"):
            return default  # HVDNB_IP
        peers = []
        if self.hosts:
            peers = launch.hostfile_hosts(self.hosts)
        for es in self.engine_sets or []:
            if es.get("host"):
                peers.append(str(es["host"]))
        for peer in peers:
            try:
                addr = route_addr(socket.gethostbyname(peer))
            except OSError:
                continue
            if not addr.startswith("127."):
                return addr
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            raise ClusterError(
                "cannot tell which address the other hosts reach this one on: pass "
                "`--ip ADDRESS` (or Cluster(ip=...))"
            ) from None

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self.client is not None

    def start(self) -> Cluster:
        """Start the controller and ``n`` engines; return when every rank can train.

        Raises ClusterError (and leaves nothing running) when engines fail to start.
        """
        global _CURRENT
        if self.running:
            raise ClusterError(
                "this cluster is already running; `%dist stop` or `%dist restart` first"
            )
        if self.launcher == "mpi":
            find_mpiexec()  # fail before starting anything
        if self.launcher == "slurm" and shutil.which("sbatch") is None:
            raise ClusterError(
                "sbatch not found: --launcher slurm submits the engines with sbatch; run the "
                "notebook on a host of the Slurm cluster (a login node), or load its module"
            )
        launch.warn_cuda_in_kernel()
        t0 = time.perf_counter()
        self._loop = self._loop or _LoopThread()
        if self.state_dir is None:  # kept across restarts: hvdnb.State commits live here
            import tempfile

            self.state_dir = tempfile.mkdtemp(prefix="hvdnb-state-")
        for attempt in (1, 2):
            self._open_channel()
            self._ipp = launch.make_ipp(self)
            try:
                self._loop.run(self._start_async(), timeout=self.timeout + 30)
                self._connect()
                self._protect_files()
                self._start_watchdog()
                break
            except BaseException as exc:
                self._teardown()
                if attempt == 1 and launch.transient_mpi_init_failure(exc, self.multi_host):
                    log.warning("hvdnb: MPI_Init failed on one host; starting again: %s", exc)
                    continue
                if isinstance(exc, ClusterError):
                    raise
                if isinstance(exc, KeyboardInterrupt):
                    raise ClusterError("start interrupted; nothing was left running") from None
                raise ClusterError(
                    f"could not start the cluster: {type(exc).__name__}: {exc}"
                ) from exc
        self.start_seconds = time.perf_counter() - t0
        self.started_at = time.time()
        try:  # feed the metrics store (hvdnb.metrics(), the panel) from this cluster
            from hvdnb.notebook.metrics import store

            store.attach(self)
        except Exception as exc:  # metrics are an extra: never fail a start over them
            log.warning("hvdnb: metrics are unavailable: %s", exc)
        _ALL.add(self)
        _CURRENT = self
        return self

    async def _start_async(self) -> None:
        c = self._ipp
        if not self.engine_sets:
            await asyncio.gather(c.start_controller(), c.start_engines(self.n))
            return
        # one engine set per host; each launcher copies the config when it is created
        base_env = dict(c.config.MPIEngineSetLauncher.environment)
        base_args = list(c.config.MPILauncher.get("mpi_args", []))
        ctrl = asyncio.ensure_future(c.start_controller())
        base = 0
        for i, es in enumerate(self.engine_sets):
            c.config.MPIEngineSetLauncher.environment = {
                **base_env,
                **launch.engine_set_env(self, i, base),
            }
            c.config.MPILauncher.mpi_cmd = list(es.get("mpi_cmd") or [find_mpiexec()])
            c.config.MPILauncher.mpi_args = list(es.get("mpi_args", base_args))
            await c.start_engines(es["n"], engine_set_id=f"host{i}")
            base += es["n"]
        await ctrl

    def _connect(self) -> None:
        from ipyparallel import Client

        info = self._loop.run(self._connection_info(), timeout=self.timeout)  # type: ignore[union-attr]
        if self.channel is not None and info.get("key"):
            # ranks that rendezvous through the channel talk before they register
            key = info["key"]
            self.channel.key = key.encode() if isinstance(key, str) else bytes(key)
        self.client = Client(info, cluster=self._ipp, cluster_id=self.cluster_id)
        deadline = time.monotonic() + self.timeout
        while len(self.client.ids) < self.n:
            self._check_alive()
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {len(self.client.ids)} of {self.n} engines were ready after "
                    f"{self.timeout:.0f} s. The machine may be overloaded: retry with a longer "
                    f"`--timeout`. Engine output:\n{self._engine_output()}"
                )
            time.sleep(0.01)
        self.view = self.client[:]
        self.view.block = False
        if self.channel is not None:
            # engines sign with the session key of the (0600) connection file: so do we
            self.channel.key = bytes(self.client.session.key)

    def _open_channel(self) -> None:
        import zmq

        from hvdnb.notebook.channel import ClientChannel

        try:
            self.channel = ClientChannel(ip=self.ip)
        except zmq.ZMQError as exc:
            raise ClusterError(
                f"cannot listen on {self.ip} ({exc}): --ip / HVDNB_IP must be an address of "
                "this host; leave it unset for 127.0.0.1"
            ) from None
        self.channel_endpoint = f"tcp://{self.ip}:{self.channel.port}"
        self._rdv: dict[str, Any] = {}
        self.hosts_seen: dict[int, str] = {}
        ch = self.channel
        ch.on(kinds.RDV_ANNOUNCE, self._on_rdv_announce)
        ch.on(kinds.RDV_ASK, self._on_rdv_ask)
        ch.on(kinds.RANK_INFO, self._on_rank_info)

    # rendezvous through the notebook (ranks without an MPI world): rank 0 announces its
    # store, the others ask until it is known; every message is answered (channel thread)
    def _on_rdv_announce(self, msg: dict[str, Any]) -> None:
        if msg.get("rank") != 0:
            return
        self._rdv = {"addr": msg.get("addr"), "port": msg.get("port")}
        self.channel.send(0, kinds.RDV_OK, **self._rdv)

    def _on_rdv_ask(self, msg: dict[str, Any]) -> None:
        if self._rdv and isinstance(msg.get("rank"), int):
            self.channel.send(msg["rank"], kinds.RDV_STORE, **self._rdv)

    def _on_rank_info(self, msg: dict[str, Any]) -> None:
        if isinstance(msg.get("rank"), int) and msg.get("host"):
            self.hosts_seen[msg["rank"]] = str(msg["host"])

    def _root_pids(self) -> list[int]:
        pids = []
        for launcher in [getattr(self._ipp, "controller", None), *self._engine_sets()]:
            proc = getattr(launcher, "process", None)
            if proc is not None and getattr(proc, "pid", None):
                pids.append(proc.pid)
        return pids

    def _start_watchdog(self) -> None:
        """A stdlib-only process that stops this cluster if the notebook kernel is killed."""
        import subprocess

        cancel: list[str] = []
        for es in self._engine_sets():  # batch jobs (Slurm, PBS...) are cancelled, not killed
            job, delete = getattr(es, "job_id", None), getattr(es, "delete_command", None)
            if job and delete:
                cancel += ["--cancel", *map(str, delete), str(job)]
        # and, as a stop would, the cluster's files
        files = ["--files", *_cluster_files(self._ipp.profile_dir, self.cluster_id)]
        self._watchdog = subprocess.Popen(
            [sys.executable, "-m", "hvdnb.notebook.cluster.watchdog", str(os.getpid())]
            + [str(pid) for pid in self._root_pids()]
            + cancel
            + files,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _protect_files(self) -> None:
        """ipyparallel writes its cluster file 0644; it names the connection files: 0600."""
        path = getattr(self._ipp, "cluster_file", None)
        if path and os.path.exists(path):
            os.chmod(path, 0o600)

    async def _connection_info(self) -> dict[str, Any]:
        info = await self._ipp.controller.get_connection_info()
        return info["client"]

    def _engine_sets(self) -> list[Any]:
        return list(self._ipp.engines.values()) if self._ipp is not None else []

    def _engine_output(self, tail: int = 20) -> str:
        """What the engines said: hvdnb's own one-line reports first, then the last lines
        without C++ stack frames (torch prints dozens when a peer has already gone)."""
        ours, rest = [], []
        for es in self._engine_sets():
            try:
                text = es.get_output(remove=False) or ""
            except Exception:
                text = ""
            for line in text.splitlines():
                if line.startswith("hvdnb:"):
                    ours.append(line)
                elif not _NOISE.match(line):
                    rest.append(line)
        return "\n".join(ours + rest[-tail:]) or "(no output)"

    def _check_alive(self) -> None:
        """Raise ClusterError if the controller or an engine set has exited."""
        if self._ipp is None:
            raise ClusterError("the cluster is not running; `%dist start` first")
        ctrl = self._ipp.controller
        if ctrl is not None and ctrl.stop_data is not None:
            raise ClusterError(f"the controller exited ({ctrl.stop_data}); `%dist restart`")
        for es in self._engine_sets():
            if es.stop_data is not None:
                code = es.stop_data.get("exit_code")
                where = ""
                if len(self._engine_sets()) > 1:
                    where = f" of engine set {getattr(es, 'engine_set_id', '?')}"
                raise ClusterError(
                    f"the engines{where} exited (launcher exit code {code}). Last output:\n"
                    f"{self._engine_output()}\nFix the cause above, then `%dist restart`."
                )

    def dead_ranks(self) -> list[int]:
        """Ranks of this cluster whose engine has gone away (empty when all are there)."""
        if self.client is None:
            return []
        ids = set(self.client.ids)
        return [r for r in range(self.n) if r not in ids]

    def stop(self) -> None:
        """Stop engines, then the controller; leaves no process behind."""
        global _CURRENT
        self._teardown()
        if self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            self.state_dir = None
        _ALL.discard(self)
        if _CURRENT is self:
            _CURRENT = None

    def _teardown(self, force: bool = False) -> None:
        """Stop everything. ``force``: ranks are known to be stuck, so kill them first
        instead of asking (and waiting) politely."""
        pids = self.pids() if self._ipp is not None else []
        profile = self._ipp.profile_dir if self._ipp is not None else None
        if force:
            _kill_survivors(pids)
        if self.client is not None:
            if not force:
                self._polite_shutdown(self.client, wait=2.0, ranks=self._rank_pids())
            try:
                self.client.close(linger=0)
            except Exception:
                pass
            self.client = None
            self.view = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self._ipp is not None and self._loop is not None:
            try:
                self._loop.run(self._stop_async(), timeout=30)
            except Exception as exc:  # fall back to killing what is left
                log.warning("hvdnb: clean stop failed (%s); killing processes", exc)
                self._kill_all()
        self._ipp = None
        _kill_survivors(pids)
        if profile is not None:
            _remove_cluster_files(profile, self.cluster_id)
        wd, self._watchdog = getattr(self, "_watchdog", None), None
        if wd is not None and wd.poll() is None:
            wd.terminate()
            try:
                wd.wait(2)
            except Exception:
                pass

    @staticmethod
    def _polite_shutdown(client: Any, wait: float, ranks: list[int]) -> None:
        """Ask engines to exit (they exit 0, faster than a signal) without ever blocking
        for longer than ``wait``: a dead or stuck engine never answers.

        Done when every engine has answered or every rank process has gone: an engine
        can exit before its reply leaves the socket (one stop in ~8 waited the full
        ``wait`` for replies that were never sent).
        """
        import psutil

        def ask() -> None:
            try:
                if client.ids:
                    client.shutdown(targets="all", hub=False, block=True)
            except Exception:
                pass

        def gone(pid: int) -> bool:
            try:
                return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        t = threading.Thread(target=ask, name="hvdnb-shutdown", daemon=True)
        t.start()
        deadline = time.monotonic() + wait
        while t.is_alive() and time.monotonic() < deadline:
            t.join(0.02)
            if ranks and all(gone(p) for p in ranks):
                break

    def pids(self) -> list[int]:
        """Every process of this cluster: controller, mpiexec, engines, and their children."""
        import psutil

        found: set[int] = set()
        for pid in self._root_pids():
            try:
                p = psutil.Process(pid)
                found.add(pid)
                found.update(c.pid for c in p.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        return sorted(found)

    def _rank_pids(self) -> list[int]:
        """The engine processes themselves (children of each mpiexec)."""
        import psutil

        pids = []
        for es in self._engine_sets():
            proc = getattr(es, "process", None)
            try:
                pids.extend(p.pid for p in psutil.Process(proc.pid).children())
            except (AttributeError, psutil.NoSuchProcess):
                pass
        return pids

    async def _stop_async(self) -> None:
        import psutil

        c = self._ipp
        # wait for the ranks (not mpiexec: gforker lingers ~2 s after its children exit),
        # then stop_engines signals whatever launcher is left
        ranks = self._rank_pids()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(
            psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
            for p in ranks
        ):
            await asyncio.sleep(0.02)
        for es in self._engine_sets():  # the ranks are gone: mpiexec has nothing left to do
            proc = getattr(es, "process", None)  # a psutil.Process in ipyparallel 9
            try:
                if proc is not None and proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()
            except (psutil.NoSuchProcess, OSError):
                pass
        if c.engines:
            await c.stop_engines()
        if c.controller is not None:
            await c.stop_controller()
        c.remove_cluster_file()

    def _kill_all(self) -> None:
        import signal

        for launcher in [*self._engine_sets(), getattr(self._ipp, "controller", None)]:
            if launcher is None:
                continue
            try:
                launcher.signal(signal.SIGKILL)
            except Exception:
                pass

    def restart(self, force: bool = False) -> Cluster:
        """Stop everything and start a fresh cluster with the same settings.

        ``force`` kills the ranks at once (for ranks that no longer answer); it is implied
        when a rank has died, since the survivors may be blocked on it."""
        self._teardown(force=force or bool(self.dead_ranks()))
        self.cluster_id = f"hvdnb-{uuid.uuid4().hex[:8]}"
        self.generation = 0
        return self.start()

    def __enter__(self) -> Cluster:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<hvdnb.Cluster n={self.n} launcher={self.launcher} {state}>"

    # ------------------------------------------------------------------ introspection
    def status(self) -> list[dict[str, Any]]:
        """One row per rank of the job, dead ones included: rank, host, pid, device,
        backend, state, last cell.

        Never raises because a rank is gone: its state says "dead" and what the notebook
        knows of it (the cell it died in; MPI ends every rank of a job when one dies).
        Host and pid of a dead rank are the last ones seen.
        """
        if not self.running:
            raise ClusterError("no cluster is running; `%dist start -n 2` first")

        dead = set(self.dead_ranks())
        alive = [r for r in range(self.n) if r not in dead]
        infos: dict[int, Any] = {}
        queue: dict[Any, Any] = {}
        if alive:
            try:
                queue = self.client.queue_status()
            except Exception:
                queue = {}
            try:
                vals = self.client[alive].apply_async(ENGINE_INFO).get(timeout=5)
                infos = dict(zip(alive, vals if isinstance(vals, list) else [vals]))
            except Exception:
                infos = {}
        self._info_seen.update({r: i for r, i in infos.items() if i is not None})
        rows = []
        for r in range(self.n):
            info = infos.get(r) or self._info_seen.get(r)
            row: dict[str, Any] = {
                "rank": r,
                "host": "?",
                "pid": "?",
                "device": "?",
                "backend": "?",
            }
            if info is not None:
                row.update({k: info[k] for k in ("host", "pid", "device", "backend")})
                row["group"] = info.get("group")
            else:  # what the rank told the notebook's side channel before it went
                from hvdnb.notebook.metrics.store import get_store

                said = get_store().rank_info.get(r, {})
                row["host"], row["pid"] = said.get("host") or "?", said.get("pid") or "?"
            if r in dead:
                row["state"] = "dead: " + self.death_notes.get(
                    r, "gone (MPI ends every rank of a job when one of them dies)"
                )
            else:
                q = queue.get(r, {}) if isinstance(queue, dict) else {}
                busy = q.get("tasks", 0) > 0 or q.get("queue", 0) > 0
                row["state"] = "busy" if busy else ("idle" if r in infos else "no answer")
            last = self.last_cell.get(r)
            row["last cell"] = f"[{last['cell']}] {last['state']}" if last else "-"
            rows.append(row)
        return rows

    def launcher_exit(self) -> str | None:
        """How the engines' launcher (mpiexec, sbatch) ended, or None while it runs."""
        for es in self._engine_sets():
            if es.stop_data is not None:
                code = es.stop_data.get("exit_code")
                return f"the ranks' launcher exited (exit code {code})"
        return None


def _kill_survivors(pids: list[int], wait: float = 1.0) -> None:
    """SIGKILL what a polite stop left behind: an engine busy in a loop that ignores
    signals never reaches ipyparallel's own shutdown code."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                procs.append(p)
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    # not our children, so a killed one may linger as a zombie until init reaps it:
    # "gone" means gone or zombie (psutil.wait_procs would wait out its whole timeout)
    deadline = time.monotonic() + wait
    while procs and time.monotonic() < deadline:
        left = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.NoSuchProcess:
                pass
        procs = left
        if procs:
            time.sleep(0.01)


def _cluster_files(profile: str, cluster_id: str) -> list[str]:
    """Glob patterns of every file a cluster writes in its ipyparallel profile: connection
    files (with the session key) in security/, logs, the hub's engine-state file and a
    Slurm script and job output in log/. Each name carries the cluster id."""
    return [os.path.join(profile, sub, f"*{cluster_id}*") for sub in ("security", "log")]


def _remove_cluster_files(profile: str, cluster_id: str) -> None:
    """After a stop: ipyparallel removes its own files on a clean stop, but not the hub's
    engine-state file, the Slurm script, or anything of a controller that had to be
    killed (a forced restart), so one start left up to four files behind."""
    from hvdnb.notebook.cluster.watchdog import remove_files  # the same removal the watchdog does

    remove_files(_cluster_files(profile, cluster_id))


def _stop_all_at_exit() -> None:
    for c in list(_ALL):
        try:
            c.stop()
        except Exception:
            pass


atexit.register(_stop_all_at_exit)
