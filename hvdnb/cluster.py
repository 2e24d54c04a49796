"""Start, watch and stop a cluster of ipyparallel engines under MPI, ready to train.

Owns: the ``ipyparallel.Cluster`` (controller + engines), its configuration for fast starts
(200 ms heartbeat, no artificial delay, engines and controller started together so the
engines' ``import torch`` overlaps the controller's start-up), engine id == MPI rank, the
venv's own ``mpiexec``, input validation, and clean stops (engines first, then the
controller: 0.5 s instead of ipyparallel's 3.5 s). Every ipyparallel coroutine runs on one
private event-loop thread so that launcher callbacks (an engine set exiting) keep working.

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

from .config import get_config

__all__ = ["Cluster", "ClusterError", "find_mpiexec", "gpu_count", "current", "cores"]

log = logging.getLogger("hvdnb")
#: engine output lines that only bury the message: C++ frames, ipengine start-up chatter
_NOISE = re.compile(
    r"^(frame #\d+:|<omitting python frames>|Exception raised from |.*\[IPEngine\] WARNING"
    r"|.*WARNING \| (Not using CurveZMQ|debugpy_stream)|.*\[KernelNanny)"
)
_ipp_log = logging.getLogger("hvdnb.ipyparallel")
_ipp_log.setLevel(logging.ERROR)

#: launchers that start engines on this host only (controller stays on loopback)
_LOCAL_LAUNCHERS = {"mpi", "local"}
_ALL: weakref.WeakSet[Cluster] = weakref.WeakSet()
_CURRENT: Cluster | None = None


class ClusterError(RuntimeError):
    """A cluster could not be started, reached or stopped; the message says what to do."""


def cores() -> int:
    """CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def gpu_count() -> int:
    """GPUs on this host, found without importing torch or initialising CUDA here."""
    try:
        import pynvml  # from nvidia-ml-py, the [gpu] extra

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML: fall back to the driver's own listing
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = Path("/proc/driver/nvidia/gpus")
    if not gpus.is_dir():
        return 0
    n = len(list(gpus.iterdir()))
    if visible is not None:
        n = min(n, len([v for v in visible.split(",") if v.strip() not in ("", "-1")]))
    return n


def find_mpiexec(local: bool = False) -> str:
    """The mpiexec beside this Python (the ``mpich`` wheel's), else the one on PATH.

    With ``local``, MPICH's ``mpiexec.gforker`` is preferred where it exists: it forks the
    ranks on this host and, unlike hydra, opens no listening socket on 0.0.0.0.
    """
    bindir = Path(sys.executable).parent
    names = ["mpiexec.gforker", "mpiexec"] if local else ["mpiexec"]
    for name in names:
        if (bindir / name).exists():
            return str(bindir / name)
    found = shutil.which("mpiexec")
    if found:
        return found
    raise ClusterError(
        "mpiexec not found: install an MPI runtime into this environment with "
        "`pip install mpich` (or load your site's MPI module), then `%dist start` again."
    )


def _warn_cuda_in_kernel() -> None:
    """Engines are separate processes (not forks), so a CUDA context in the notebook kernel
    does not break them as it breaks fork-based launchers; but it holds memory on GPU 0,
    which rank 0 then shares. Say so once, with the fix."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return
        held = torch.cuda.memory_reserved() / 2**20
    except Exception:
        return
    log.warning(
        "hvdnb: CUDA is initialised in this notebook kernel (%.0f MiB reserved on GPU %d); "
        "rank 0 will share that GPU. Do GPU work in %%%%distributed cells, or restart the "
        "kernel before %%dist start to give the ranks whole GPUs.",
        held,
        torch.cuda.current_device(),
    )


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
    ) -> None:
        cfg = get_config()
        self.n = self._check_n(n, oversubscribe)
        if backend not in (None, "auto", "gloo", "nccl", "mpi"):
            raise ClusterError(
                f"unknown backend {backend!r}: use gloo (CPU), nccl (GPU), mpi, or leave it "
                "out for automatic"
            )
        self.backend = None if backend == "auto" else backend
        if not isinstance(launcher, str) or not launcher:
            raise ClusterError(f"launcher must be a name such as 'mpi' or 'slurm', not {launcher!r}")
        self.launcher = launcher.lower()
        if timeout is not None and not timeout > 0:
            raise ClusterError(f"timeout must be a positive number of seconds, not {timeout!r}")
        self.timeout = float(timeout or cfg.start_timeout)
        self.engine_env = dict(engine_env or {})
        self.launcher_config = dict(launcher_config or {})
        self.ip = cfg.ip
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
        self.last_cell: dict[int, dict[str, Any]] = {}
        self.started_at: float | None = None
        self.start_seconds: float | None = None

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _check_n(n: Any, oversubscribe: bool) -> int:
        if n is None:
            n = get_config().ranks or gpu_count() or 2
        if isinstance(n, bool) or not isinstance(n, int):
            raise ClusterError(f"-n must be a whole number of ranks, not {n!r}")
        if n < 1:
            raise ClusterError(f"-n must be at least 1 (got {n}); e.g. `%dist start -n 2`")
        gpus = gpu_count()
        limit, what = (gpus, "GPUs") if gpus else (cores(), "CPU cores")
        if n > limit and not oversubscribe:
            raise ClusterError(
                f"{n} ranks but this host has {limit} {what}: ranks would share them and run "
                f"slower. Use `-n {limit}`, or add `--oversubscribe` if you mean it."
            )
        return n

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self.client is not None

    def _make_ipp(self) -> Any:
        import ipyparallel as ipp

        cfg = get_config()
        local = self.launcher in _LOCAL_LAUNCHERS
        env = {"HVDNB_BACKEND": self.backend or "", **self.engine_env}
        if self.channel is not None:
            env["HVDNB_CHANNEL"] = self.channel_endpoint
        if self.state_dir is not None:
            env["HVDNB_STATE_DIR"] = self.state_dir
        if local:
            # keep every transport on loopback: MPICH's UCX netmod and gloo's pairs would
            # otherwise listen on the host's public address
            env.setdefault("UCX_NET_DEVICES", "lo")
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env["PYTHONUNBUFFERED"] = "1"
        engine_cmd = [sys.executable, "-m", "kernels_ext.engine"]
        c = ipp.Cluster(
            engines=self.launcher,
            n=self.n,
            cluster_id=self.cluster_id,
            controller_ip=self.ip if local else "*",
            controller_args=[f"--HeartMonitor.period={cfg.heartbeat_ms}"],
            # engines wait for the connection file themselves: start them with the controller
            send_engines_connection_env=False,
            delay=0,
            # our own logger: ipyparallel's default writes to the sys.stdout of the moment
            # (a closed capture later), and what it would say we report ourselves
            log=_ipp_log,
            engine_timeout=self.timeout,
        )
        launcher_cls = c.engine_launcher_class.__name__
        c.config[launcher_cls].engine_cmd = engine_cmd
        c.config[launcher_cls].engine_args = [
            f"--IPEngine.wait_for_url_file={self.timeout}",
            "--log-level=WARN",
        ]
        c.config[launcher_cls].environment = env
        if self.launcher == "mpi":
            hostfile = any("host" in str(a) for a in self.launcher_config.get("mpi_args", []))
            c.config.MPILauncher.mpi_cmd = [find_mpiexec(local=not hostfile)]
        for k, v in self.launcher_config.items():
            c.config[launcher_cls][k] = v
        return c

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
        _warn_cuda_in_kernel()
        t0 = time.perf_counter()
        self._loop = self._loop or _LoopThread()
        if self.state_dir is None:  # kept across restarts: hvdnb.State commits live here
            import tempfile

            self.state_dir = tempfile.mkdtemp(prefix="hvdnb-state-")
        self._open_channel()
        self._ipp = self._make_ipp()
        try:
            self._loop.run(self._start_async(), timeout=self.timeout + 30)
            self._connect()
            self._protect_files()
            self._start_watchdog()
        except BaseException as exc:
            self._teardown()
            if isinstance(exc, ClusterError):
                raise
            if isinstance(exc, KeyboardInterrupt):
                raise ClusterError("start interrupted; nothing was left running") from None
            raise ClusterError(f"could not start the cluster: {type(exc).__name__}: {exc}") from exc
        self.start_seconds = time.perf_counter() - t0
        self.started_at = time.time()
        try:  # feed the metrics store (hvdnb.metrics(), the panel) from this cluster
            from .metrics import store

            store.attach(self)
        except Exception as exc:  # metrics are an extra: never fail a start over them
            log.warning("hvdnb: metrics are unavailable: %s", exc)
        _ALL.add(self)
        _CURRENT = self
        return self

    async def _start_async(self) -> None:
        c = self._ipp
        await asyncio.gather(c.start_controller(), c.start_engines(self.n))

    def _connect(self) -> None:
        from ipyparallel import Client

        info = self._loop.run(self._connection_info(), timeout=self.timeout)  # type: ignore[union-attr]
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
        from .channel import ClientChannel

        import zmq

        local = self.launcher in _LOCAL_LAUNCHERS
        try:
            self.channel = ClientChannel(ip=self.ip if local else "0.0.0.0")
        except zmq.ZMQError as exc:
            raise ClusterError(
                f"cannot listen on {self.ip} ({exc}): HVDNB_IP must be an address of this "
                "host; leave it unset for 127.0.0.1"
            ) from None
        host = self.ip if local else socket.gethostbyname(socket.gethostname())
        self.channel_endpoint = f"tcp://{host}:{self.channel.port}"

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

        self._watchdog = subprocess.Popen(
            [sys.executable, "-m", "hvdnb._watchdog", str(os.getpid())]
            + [str(pid) for pid in self._root_pids()],
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
                raise ClusterError(
                    f"the engines exited (mpiexec exit code {code}). Last output:\n"
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
        if force:
            _kill_survivors(pids)
        if self.client is not None:
            if not force:
                self._polite_shutdown(self.client, wait=2.0)
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
        wd, self._watchdog = getattr(self, "_watchdog", None), None
        if wd is not None and wd.poll() is None:
            wd.terminate()
            try:
                wd.wait(2)
            except Exception:
                pass

    @staticmethod
    def _polite_shutdown(client: Any, wait: float) -> None:
        """Ask engines to exit (they exit 0, faster than a signal) without ever blocking
        for longer than ``wait``: a dead or stuck engine never answers."""

        def ask() -> None:
            try:
                if client.ids:
                    client.shutdown(targets="all", hub=False, block=True)
            except Exception:
                pass

        t = threading.Thread(target=ask, name="hvdnb-shutdown", daemon=True)
        t.start()
        t.join(wait)

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
        """One row per rank: rank, host, pid, device, backend, state, last cell."""
        if not self.running:
            raise ClusterError("no cluster is running; `%dist start -n 2` first")
        from kernels_ext.engine import engine_info

        queue = self.client.queue_status()
        ar = self.view.apply_async(engine_info)
        rows = []
        try:
            infos = ar.get(timeout=5)
        except Exception:
            infos = [None] * len(self.client.ids)
        for eid, info in zip(self.client.ids, infos):
            q = queue.get(eid, {})
            busy = q.get("tasks", 0) > 0 or q.get("queue", 0) > 0
            row = {"rank": eid, "host": "?", "pid": "?", "device": "?", "backend": "?"}
            if info is not None:
                row.update({k: info[k] for k in ("host", "pid", "device", "backend")})
                row["group"] = info["group"]
            row["state"] = "busy" if busy else ("idle" if info is not None else "no answer")
            last = self.last_cell.get(eid)
            row["last cell"] = f"[{last['cell']}] {last['state']}" if last else "-"
            rows.append(row)
        return rows


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


def _stop_all_at_exit() -> None:
    for c in list(_ALL):
        try:
            c.stop()
        except Exception:
            pass


atexit.register(_stop_all_at_exit)
