"""Start, stop and restart a cluster of ipyparallel engines under MPI, ready to train.

Owns: the life of the ``ipyparallel.Cluster`` (controller + engines) that ``launch.py``
configures from the checked options (``spec.py``): starting engines and controller together
(so the engines' ``import torch`` overlaps the controller's start-up), connecting, and
clean stops (engines first, then the controller: 0.2 s instead of ipyparallel's 3.5 s)
that leave no process or file behind, even when the notebook is killed (a watchdog).
Every ipyparallel coroutine runs on one private event-loop thread so that launcher
callbacks (an engine set exiting) keep working. On a start the cluster opens its side
channel (``hub.py``), feeds the notebook's metrics store from it and becomes the current
cluster (``registry.py``); whether its ranks are alive is ``health.py``'s to tell.

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
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
import weakref
from collections.abc import Coroutine
from typing import Any

import psutil

from hvdnb.host import cores, gpu_count
from hvdnb.notebook.cluster import health, launch, registry, spec, sshslots
from hvdnb.notebook.cluster.elastic import (
    Event,
    Membership,
    StoreHost,
    slot_processes,
    start_slots,
)
from hvdnb.notebook.cluster.elastic import request as elastic_request
from hvdnb.notebook.cluster.elastic import scale as elastic_scale
from hvdnb.notebook.cluster.hub import Hub
from hvdnb.notebook.cluster.launch import find_mpiexec
from hvdnb.notebook.cluster.procs import LoopThread, kill_survivors, polite_shutdown, processes
from hvdnb.notebook.cluster.spec import ClusterError, StartSpec
from hvdnb.notebook.cluster.standby import Standby
from hvdnb.notebook.cluster.watchdog import cluster_files, remove_files, retire, watch
from hvdnb.notebook.metrics import store
from hvdnb.protocol import kinds
from hvdnb.protocol.remote import CONNECT_CHANNEL

# the store follows the current cluster through this (it never imports the cluster's modules)
store.follow(registry.current)

__all__ = ["Cluster", "ClusterError", "cores", "current", "find_mpiexec", "gpu_count"]

log = logging.getLogger("hvdnb")
_ALL: weakref.WeakSet[Cluster] = weakref.WeakSet()


def current() -> Cluster | None:
    """The cluster that ``%dist`` and ``%%distributed`` act on (None before ``%dist start``)."""
    c: Cluster | None = registry.current()
    return c


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
    tf_ps : ranks 0..tf_ps-1 serve as TensorFlow parameter servers, the others as workers,
        and this kernel coordinates them (``hvdnb.tf_cluster_resolver``; needs TensorFlow)
    min_np, max_np : an elastic cluster: it goes on while at least ``min_np`` ranks live
        (a death costs a step inside ``hvd.elastic.run`` / ``hvdnb.elastic.run``), and
        ``scale`` takes it to any size up to ``max_np`` (default ``n``). Its engines are
        separate processes on this host, not one MPI job (``elastic.py``)

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
        tf_ps: int | None = None,
        min_np: int | None = None,
        max_np: int | None = None,
    ) -> None:
        #: the start options as given, every argument above (a restart changes some and
        #: checks them all again)
        self._options: dict[str, Any] = {k: v for k, v in locals().items() if k != "self"}
        #: the checked start options (``n``, ``launcher``, ``backend``... read through them)
        self.spec: StartSpec = spec.check(**self._options)
        self.cluster_id = f"hvdnb-{uuid.uuid4().hex[:8]}"
        self.client: Any = None
        self.view: Any = None
        self.channel: Any = None
        self.channel_endpoint = ""
        #: rank -> the host it said it runs on (this start's side channel)
        self.hosts_seen: dict[int, str] = {}
        self.state_dir: str | None = None
        self._hub: Hub | None = None
        self._ipp: Any = None
        self._loop: LoopThread | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self.generation = 0
        self.cell_no = 0
        #: every %%distributed cell run on this cluster (``cellout.history.ExportCell``)
        self.history: list[Any] = []
        #: rank -> what the notebook saw of its death ("died in cell 4: ..."; ``health``)
        self.death_notes: dict[int, str] = {}
        #: rank -> its last ``engine_info`` (``health.status_rows`` shows it for dead ranks)
        self.info_seen: dict[int, Any] = {}
        self.last_cell: dict[int, dict[str, Any]] = {}
        self.started_at: float | None = None
        self.start_seconds: float | None = None
        #: an elastic cluster's slots and generations (None: a fixed-size cluster)
        self.membership: Membership | None = None
        #: an elastic cluster's rendezvous store, a process of its own
        self.store_host = StoreHost()
        #: warm processes and a spare controller for the next start (``standby.py``)
        self.standby = Standby()
        #: ranks of the last start a standby process took (the rest started cold)
        self.warm_ranks = 0
        self._quick_stop = False
        #: seconds the last restart took, stop included (None: not restarted)
        self.restart_seconds: float | None = None

    # ------------------------------------------------------------------ start options
    @property
    def n(self) -> int:
        """Number of ranks (an elastic cluster's: in its current generation)."""
        if self.membership is not None:
            return self.membership.size
        return self.spec.n

    @property
    def elastic(self) -> bool:
        """Does this cluster go on when a rank dies (``--min-np``)?"""
        return self.spec.elastic

    @property
    def launcher(self) -> str:
        return self.spec.launcher

    @property
    def backend(self) -> str | None:
        """torch.distributed backend (None: automatic)."""
        return self.spec.backend

    @property
    def timeout(self) -> float:
        """Seconds to wait for every engine at a start."""
        return self.spec.timeout

    @property
    def device(self) -> str | None:
        """What the ranks train on, as this host tells it (GPU, CPU; None across hosts)."""
        return None if self.multi_host else ("GPU" if gpu_count() else "CPU")

    @property
    def ip(self) -> str:
        """The address the controller and the side channel listen on."""
        return self.spec.ip

    @property
    def multi_host(self) -> bool:
        """Ranks may run on other hosts: listen on a reachable address, pin nothing to lo."""
        return self.spec.multi_host

    @property
    def hosts(self) -> str | None:
        """The MPI hostfile (resolved path), if any."""
        return self.spec.hosts

    @property
    def engine_sets(self) -> list[dict[str, Any]] | None:
        return self.spec.engine_sets

    @property
    def engine_env(self) -> dict[str, str]:
        return self.spec.engine_env

    @property
    def launcher_config(self) -> dict[str, Any]:
        return self.spec.launcher_config

    @property
    def slurm(self) -> dict[str, Any]:
        """Slurm job options (``#SBATCH --<key>=<value>``)."""
        return self.spec.slurm

    @property
    def sbatch_args(self) -> list[str]:
        return self.spec.sbatch_args

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self.client is not None

    @property
    def ipp(self) -> Any:
        """The ``ipyparallel.Cluster`` of this start (None when stopped)."""
        return self._ipp

    def start(self) -> Cluster:
        """Start the controller and ``n`` engines; return when every rank can train.

        Raises ClusterError (and leaves nothing running) when engines fail to start.
        """
        if self.running:
            raise ClusterError(
                "this cluster is already running; `%dist stop` or `%dist restart` first"
            )
        if self.launcher == "mpi":
            launch.preflight(self.spec)  # fail before starting anything
        if self.launcher == "slurm" and shutil.which("sbatch") is None:
            raise ClusterError(
                "sbatch not found: --launcher slurm submits the engines with sbatch; run the "
                "notebook on a host of the Slurm cluster (a login node), or load its module"
            )
        launch.warn_cuda_in_kernel()
        t0 = time.perf_counter()
        self._loop = self._loop or LoopThread()
        if self.state_dir is None:  # kept across restarts: hvdnb.State commits live here
            self.state_dir = tempfile.mkdtemp(prefix="hvdnb-state-")
        taken_before = self.standby.taken_count()
        for attempt in (1, 2):
            self._open_channel()
            if self.elastic:
                self.store_host.open(self.spec.ip if self.multi_host else "127.0.0.1")
            self._make_ipp()
            if self.elastic:
                self._begin_membership()
            try:
                self._loop.run(self._start_async(), timeout=self.timeout + 30)
                self._connect()
                self._wait_channels()
                self._protect_files()
                break
            except BaseException as exc:
                self._teardown()
                why = attempt == 1 and launch.transient_start_failure(exc, self.multi_host)
                if why:
                    log.warning("hvdnb: %s; starting again: %s", why, exc)
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
        self.warm_ranks = self.standby.taken_count() - taken_before
        self.standby.refill(self)
        # an elastic cluster's next store, serving by its next restart (none for a fixed one)
        self.store_host.keep_spare(self.elastic and bool(self.standby.count))
        if self.channel is not None:
            self.channel.on(kinds.IMPORTED, lambda msg: self.standby.preload(msg["module"]))
        self._start_watchdog()  # it knows the standby too

        try:  # feed the metrics store (hvdnb.metrics(), the panel) from this cluster
            store.attach(self)
        except Exception as exc:  # metrics are an extra: never fail a start over them
            log.warning("hvdnb: metrics are unavailable: %s", exc)
        _ALL.add(self)
        registry.set_current(self)
        return self

    def _make_ipp(self) -> None:
        """This start's ``ipyparallel.Cluster``: the standby's spare one (its controller up)
        where it serves this spec, its ranks handed to standby processes where any are ready."""
        channel = self.channel_endpoint if self.channel is not None else None
        warm = self.standby.engines(self.spec.n, {**os.environ, **self.spec.engine_env})
        spare = self.standby.take_controller(self.spec, self._loop)
        if spare is None:
            self._ipp = launch.make_ipp(self.spec, self.cluster_id, channel, self.state_dir, warm)
            return
        self.cluster_id = spare.cluster_id
        launch.configure_engines(spare, self.spec, channel, self.state_dir, warm)
        self._ipp = spare

    async def _start_controller(self) -> None:
        if self._ipp.controller is None:  # a spare one is up already
            await self._ipp.start_controller()

    async def _start_async(self) -> None:
        c = self._ipp
        if self.elastic:
            ctrl = asyncio.ensure_future(self._start_controller())
            m, n = self.membership, self.spec.n
            hosts = m.placement.first(n) if m is not None and m.placement is not None else None
            await start_slots(self, list(range(n)), n, join=False, hosts=hosts)
            await ctrl
            return
        if not self.engine_sets:
            await asyncio.gather(self._start_controller(), c.start_engines(self.n))
            return
        # one engine set per host; each launcher copies the config when it is created
        base_env = dict(c.config.MPIEngineSetLauncher.environment)
        base_args = list(c.config.MPILauncher.get("mpi_args", []))
        ctrl = asyncio.ensure_future(self._start_controller())
        base = 0
        for i, es in enumerate(self.engine_sets):
            c.config.MPIEngineSetLauncher.environment = {
                **base_env,
                **launch.engine_set_env(self.spec, i, base),
            }
            c.config.MPILauncher.mpi_cmd = list(es.get("mpi_cmd") or [find_mpiexec()])
            c.config.MPILauncher.mpi_args = list(es.get("mpi_args", base_args))
            await c.start_engines(es["n"], engine_set_id=f"host{i}")
            base += es["n"]
        await ctrl

    def slot_processes(self) -> dict[int, Any]:
        """An elastic cluster's engine process per slot (psutil), while its set runs."""
        return slot_processes(self.engine_launchers())

    def run_async(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        """Run one of ipyparallel's coroutines on this cluster's loop thread."""
        self._loop = self._loop or LoopThread()
        return self._loop.run(coro, timeout=timeout)

    def scale(self, n: int) -> Event:
        """Take an elastic cluster to ``n`` ranks (between cells; ``elastic.scale``)."""
        return elastic_scale(self, n)  # new engines: the watchdog learns them (on_started)

    def request_scale(self, n: int) -> str:
        """Ask for ``n`` ranks from any thread (the panel's ``ranks=N``): a running elastic
        loop takes it at its next commit, else the next cell's start. Says which, in words."""
        return elastic_request(self, n)

    def _connect(self) -> None:
        from ipyparallel import Client  # noqa: PLC0415  ipyparallel is heavy: loaded only where it is used

        info = self._loop.run(self._connection_info(), timeout=self.timeout)  # type: ignore[union-attr]
        hub = self._hub
        if hub is not None and info.get("key"):
            # ranks that rendezvous through the channel talk before they register
            hub.sign_with(info["key"])
        self.client = Client(info, cluster=self._ipp, cluster_id=self.cluster_id)
        deadline = time.monotonic() + self.timeout
        while len(self.client.ids) < self.n:
            self._check_alive()
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {len(self.client.ids)} of {self.n} engines were ready after "
                    f"{self.timeout:.0f} s. The machine may be overloaded: retry with a longer "
                    f"`--timeout`. Engine output:\n{health.engine_output(self)}"
                )
            time.sleep(0.01)
        self.view = self.client[:]
        self.view.block = False
        if hub is not None:
            # engines sign with the session key of the (0600) connection file: so do we
            hub.sign_with(bytes(self.client.session.key))

    def _begin_membership(self) -> None:
        assert self.spec.min_np is not None and self.spec.max_np is not None
        m = Membership(
            self, list(range(self.spec.n)), self.spec.min_np, self.spec.max_np, self._start_watchdog
        )
        self.membership = m
        if self.spec.hosts:  # across hosts: each slot's engine over ssh (sshslots.py)
            m.placement = sshslots.Placement(spec.hostfile_entries(self.spec.hosts))
        # the channel listens from the start: a rank may leave during the first cell
        if self.channel is not None:
            self.channel.on(kinds.ELASTIC_LEFT, m.on_left)
            self.channel.on(kinds.ELASTIC_LOOP, m.on_loop)

    def watch_members(self, cell: int | None = None) -> Event | None:
        """An elastic cluster: form the next generation if ranks were lost (None: none
        were, or the cluster is not elastic)."""
        return self.membership.watch(cell) if self.membership is not None else None

    def _wait_channels(self) -> None:
        """Ready means ready: every rank connects its side channel now (a rank otherwise
        connects on its first cell) and start returns only once each has said hello, so a
        `%dist where`, `knobs` or `debug` right after a start or restart reaches every rank."""
        if self.channel is None or self.view is None:
            return
        self.view.apply_sync(CONNECT_CHANNEL)
        want = set(range(self.n))
        deadline = time.monotonic() + min(self.timeout, 30.0)
        while not want <= set(self.channel.ranks):
            self._check_alive()
            if time.monotonic() > deadline:
                missing = sorted(want - set(self.channel.ranks))
                raise ClusterError(
                    f"rank(s) {missing} started but never reached the notebook's side channel "
                    f"at {self.channel_endpoint}: is that address reachable from their host? "
                    "Pass `%dist start --ip ADDRESS` (an address of this host they can reach)"
                )
            time.sleep(0.002)

    def _open_channel(self) -> None:
        self._hub = Hub(self.ip)
        self.channel = self._hub.channel
        self.channel_endpoint = self._hub.endpoint
        self.hosts_seen = self._hub.hosts_seen

    def _root_pids(self) -> list[int]:
        pids = [p.pid for p in self.slot_processes().values()]
        pids += self.standby.taken_pids()  # warm ranks (not the idle standby: it outlives a stop)
        if self.store_host.pid is not None:
            pids.append(self.store_host.pid)
        for launcher in [getattr(self._ipp, "controller", None), *self.engine_launchers()]:
            proc = getattr(launcher, "process", None)
            if proc is not None and getattr(proc, "pid", None):
                pids.append(proc.pid)
        return pids

    def _start_watchdog(self) -> None:
        """A stdlib-only process that stops this cluster if the notebook kernel is killed
        (a new one replaces the last: ``scale`` started engines it must know)."""
        old, self._watchdog = self._watchdog, None
        retire(old)
        # and, as a stop would, the cluster's files and its state directory (a killed
        # `hvdnb run` or kernel left hvdnb-state-* behind in the temp directory)
        files = cluster_files(self._ipp.profile_dir, self.cluster_id)
        self._watchdog = watch(
            self._root_pids() + self.standby.pids() + [p for p in [self.store_host.spare_pid] if p],
            self.engine_launchers(),
            files + ([self.state_dir] if self.state_dir else []),
        )

    def _protect_files(self) -> None:
        """ipyparallel writes its cluster file 0644; it names the connection files: 0600."""
        path = getattr(self._ipp, "cluster_file", None)
        if path and os.path.exists(path):
            os.chmod(path, 0o600)

    async def _connection_info(self) -> dict[str, Any]:
        info = await self._ipp.controller.get_connection_info()
        return dict(info["client"])

    def engine_launchers(self) -> list[Any]:
        """ipyparallel's launcher of each engine set (empty when stopped)."""
        return list(self._ipp.engines.values()) if self._ipp is not None else []

    def check_alive(self) -> None:
        """Raise ClusterError if the controller or an engine set has exited
        (``health.check_alive``)."""
        self._check_alive()

    def _check_alive(self) -> None:  # the one hook behind check_alive (tests wrap it)
        health.check_alive(self)

    def dead_ranks(self) -> list[int]:
        """Ranks of this cluster whose engine has gone away (``health.dead_ranks``)."""
        return health.dead_ranks(self)

    def stop(self) -> None:
        """Stop engines, then the controller; leaves no process behind."""
        self._teardown()
        self.standby.close(self._loop)
        self.store_host.close_spare()
        if self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            self.state_dir = None
        _ALL.discard(self)
        registry.forget(self)

    def _teardown(self, force: bool = False) -> None:
        """Stop everything. ``force``: ranks are known to be stuck, so kill them first
        instead of asking (and waiting) politely."""
        # taken now, with their start times: killed below only if still the same processes
        pids = processes(self.pids()) if self._ipp is not None else []
        profile = self._ipp.profile_dir if self._ipp is not None else None
        if force:
            kill_survivors(pids)
        if self.client is not None:
            if not force:
                polite_shutdown(self.client, 2.0, self.rank_pids(), self.engine_launchers())
            try:
                self.client.close(linger=0)
            except Exception:
                pass
            self.client = None
            self.view = None
        if self._hub is not None:
            self._hub.close()
            self._hub = None
            self.channel = None
        if self._ipp is not None and self._loop is not None:
            try:
                self._loop.run(self._stop_async(), timeout=30)
            except Exception as exc:  # fall back to killing what is left
                log.warning("hvdnb: clean stop failed (%s); killing processes", exc)
                self._kill_all()
        self._ipp = None
        kill_survivors(pids)
        self.store_host.close()
        self.membership = None
        if profile is not None:
            # ipyparallel removes its own files on a clean stop, but not the hub's
            # engine-state file, the Slurm script, or a killed controller's
            remove_files(cluster_files(profile, self.cluster_id))
        wd, self._watchdog = self._watchdog, None
        retire(wd)

    def pids(self) -> list[int]:
        """Every process of this cluster: controller, mpiexec, engines, and their children."""

        found: set[int] = set()
        for pid in self._root_pids():
            try:
                p = psutil.Process(pid)
                found.add(pid)
                found.update(c.pid for c in p.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        return sorted(found)

    def rank_pids(self) -> list[int]:
        """The engine processes themselves (children of each mpiexec; an elastic
        cluster's own processes)."""

        pids: list[int] = [p.pid for p in self.slot_processes().values()]
        pids += self.standby.taken_pids()
        for es in self.engine_launchers():
            proc: Any = getattr(es, "process", None)  # None: AttributeError below, skipped
            try:
                pids.extend(p.pid for p in psutil.Process(proc.pid).children())
            except (AttributeError, psutil.NoSuchProcess):
                pass
        return pids

    async def _stop_async(self) -> None:
        c = self._ipp
        # wait for the ranks (not mpiexec: gforker lingers ~2 s after its children exit),
        # then stop_engines signals whatever launcher is left
        ranks = self.rank_pids()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(
            psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
            for p in ranks
        ):
            await asyncio.sleep(0.02)
        for es in self.engine_launchers():  # the ranks are gone: mpiexec has nothing left to do
            proc = getattr(es, "process", None)  # a psutil.Process in ipyparallel 9
            try:
                if proc is not None and proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()
            except (psutil.NoSuchProcess, OSError):
                pass
        if c.engines:
            await c.stop_engines()
        if c.controller is not None:
            if self._quick_stop:  # a restart: nothing of this controller is read again
                c.controller.signal(signal.SIGKILL)
            await c.stop_controller()
        c.remove_cluster_file()

    def _kill_all(self) -> None:
        for launcher in [*self.engine_launchers(), getattr(self._ipp, "controller", None)]:
            if launcher is None:
                continue
            try:
                launcher.signal(signal.SIGKILL)
            except Exception:
                pass

    def restart(
        self,
        force: bool = False,
        *,
        n: int | None = None,
        backend: str | None = None,
        timeout: float | None = None,
        oversubscribe: bool | None = None,
        tf_ps: int | None = None,
        min_np: int | None = None,
        max_np: int | None = None,
    ) -> Cluster:
        """Stop everything and start a fresh cluster: the same settings, except those given.

        Parameters
        ----------
        force : kill the ranks at once (for ranks that no longer answer); implied when a
            rank has died, since the survivors may be blocked on it
        n, backend, timeout, oversubscribe : new start options (None: keep; backend
            "auto": automatic again), checked before anything is stopped: a refused restart
            (ClusterError) leaves the cluster running. Launcher, hosts, ip and Slurm options
            are kept: for another place, stop this cluster and start a new one.
        tf_ps : the same ranks with TensorFlow parameter-server roles (``K``: ranks
            0..K-1 serve, the others are workers; 0: no parameter servers again)
        min_np, max_np : an elastic cluster's bounds (``min_np=0``: a fixed-size one again)
        """
        options = spec.changed(
            self._options,
            n=n,
            backend=backend,
            timeout=timeout,
            oversubscribe=oversubscribe,
            tf_ps=tf_ps,
            min_np=min_np,
            max_np=max_np,
        )
        new_spec = spec.check(**options)  # refused here: nothing was stopped
        t0 = time.perf_counter()
        self._quick_stop = True
        try:
            self._teardown(force=force or bool(self.dead_ranks()))
        finally:
            self._quick_stop = False
        self._options, self.spec = options, new_spec
        self.cluster_id = f"hvdnb-{uuid.uuid4().hex[:8]}"
        self.generation = 0
        self.start()
        self.restart_seconds = time.perf_counter() - t0
        return self

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
        """One row per rank of the job, dead ones included (``health.status_rows``)."""
        return health.status_rows(self)

    def launcher_exit(self) -> str | None:
        """How the engines' launcher (mpiexec, sbatch) ended, or None while it runs."""
        return health.launcher_exit(self)


def _stop_all_at_exit() -> None:
    for c in list(_ALL):
        try:
            c.stop()
        except Exception:
            pass


atexit.register(_stop_all_at_exit)
