"""What a cluster is started with: ``Cluster``'s arguments, checked once, as a ``StartSpec``.

Owns: every input check of a start (rank count against this host's cores or GPUs, backend,
launcher, timeout, hostfile, engine sets, Slurm options, TensorFlow parameter servers),
reading MPI hostfiles, choosing the address the controller and the side channel listen on
(loopback for one host; across hosts one reachable address, never every interface), and
``ClusterError``, the one exception a start, a stop or a dead cluster raises.

Never: start, stop or signal a process, open a socket, or import torch: a refused start
leaves nothing behind because nothing was started.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvdnb.config import get_config
from hvdnb.extras import install_command
from hvdnb.host import cores, gpu_count, is_loopback, reachable_addr
from hvdnb.protocol.errors import UserFacing

__all__ = [
    "LOCAL_LAUNCHERS",
    "ClusterError",
    "StartSpec",
    "changed",
    "check",
    "hostfile_entries",
    "hostfile_hosts",
    "hostfile_slots",
]

#: launchers that start engines on this host only (controller stays on loopback)
LOCAL_LAUNCHERS = frozenset({"mpi", "local"})


class ClusterError(UserFacing, RuntimeError):
    """A cluster could not be started, reached or stopped; the message says what to do
    (IPython shows it after the user's frames, without hvdnb's)."""


ClusterError.__module__ = "hvdnb"  # its public name: hvdnb.ClusterError


@dataclass(frozen=True)
class StartSpec:
    """A cluster's start options, checked (``check`` makes one; see ``Cluster``)."""

    n: int
    launcher: str
    backend: str | None
    timeout: float
    ip: str
    #: ranks may run on other hosts: listen on a reachable address, pin nothing to lo
    multi_host: bool
    hosts: str | None
    engine_sets: list[dict[str, Any]] | None
    engine_env: dict[str, str]
    launcher_config: dict[str, Any]
    #: ``#SBATCH --<key>=<value>`` lines (None: left out)
    slurm: dict[str, Any]
    sbatch_args: list[str]
    #: ranks ``0..tf_ps-1`` serve as TensorFlow parameter servers, the rest as workers, and
    #: the notebook kernel is the chief (``hvdnb.notebook.tf.tfps``); 0: no ParameterServerStrategy
    tf_ps: int = 0
    #: an elastic cluster (``--min-np``): it goes on while at least ``min_np`` ranks live,
    #: and ``%dist scale`` takes it to any size up to ``max_np``; None: a fixed-size cluster
    min_np: int | None = None
    max_np: int | None = None

    @property
    def elastic(self) -> bool:
        """Does this cluster survive a rank's death (no MPI; groups re-formed per generation)?"""
        return self.min_np is not None


def check(
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
) -> StartSpec:
    """``Cluster``'s arguments as a ``StartSpec``; raises ClusterError, saying what to
    change, for the first one that cannot work."""
    cfg = get_config()
    if not isinstance(launcher, str) or not launcher:
        raise ClusterError(f"launcher must be a name such as 'mpi' or 'slurm', not {launcher!r}")
    launcher = launcher.lower()
    hostfile = _check_hostfile(hosts) if hosts else None
    sets = _check_sets(engine_sets, n) if engine_sets else None
    if hostfile and launcher != "mpi":
        raise ClusterError(
            f"a hostfile runs one MPI job across hosts: use it with --launcher mpi, not "
            f"{launcher!r} (Slurm chooses the hosts itself)"
        )
    if sets is not None:
        n = sum(int(es["n"]) for es in sets)
    if hostfile and n is None:
        n = hostfile_slots(hostfile)  # mpiexec -f fills the slots in order
    multi_host = bool(launcher not in LOCAL_LAUNCHERS or hostfile or sets)
    slurm = {
        "partition": partition,
        "time": time_limit,
        "gpus-per-node": gpus_per_node,
        "account": account,
    }
    sbatch = list(sbatch_args or [])
    if launcher != "slurm" and (any(slurm.values()) or sbatch):
        raise ClusterError(
            "--partition, --time, --gpus-per-node, --account and sbatch arguments are "
            "Slurm options: add `--launcher slurm`"
        )
    gpus = gpu_count()
    n = _check_n(n, oversubscribe or bool(cfg.oversubscribe) or multi_host, gpus)
    if backend not in (None, "auto", "gloo", "nccl", "mpi"):
        raise ClusterError(
            f"unknown backend {backend!r}: use gloo (CPU), nccl (GPU), mpi, or leave it "
            "out for automatic"
        )
    backend = None if backend == "auto" else backend
    if backend == "nccl" and not multi_host and 0 < gpus < n:
        raise ClusterError(
            f"--backend nccl needs one GPU per rank, and {n} ranks would share this "
            f"host's {gpus} GPU(s): NCCL refuses two ranks on one GPU. Use `-n {gpus}`, or "
            "leave --backend out (ranks that share a GPU use gloo)."
        )
    if timeout is not None and not timeout > 0:
        raise ClusterError(f"timeout must be a positive number of seconds, not {timeout!r}")
    ps = _check_tf_ps(tf_ps, n)
    if min_np is None and cfg.min_np > 0 and not (multi_host or ps):  # hvdnb run --min-np
        min_np, max_np = min(cfg.min_np, n), max_np or cfg.max_np or None
    min_np, max_np = _check_elastic(min_np, max_np, n, launcher, multi_host, backend, ps, hostfile)
    return StartSpec(
        n=n,
        launcher=launcher,
        backend=backend,
        timeout=float(timeout or cfg.start_timeout),
        ip=_listen_ip(ip, cfg.ip, multi_host, hostfile, sets),
        multi_host=multi_host,
        hosts=hostfile,
        engine_sets=sets,
        engine_env=dict(engine_env or {}),
        launcher_config=dict(launcher_config or {}),
        slurm=slurm,
        sbatch_args=sbatch,
        tf_ps=ps,
        min_np=min_np,
        max_np=max_np,
    )


def changed(options: dict[str, Any], **given: Any) -> dict[str, Any]:
    """A restart's start options: ``options`` with those ``given`` (None: kept) changed.
    ``tf_ps=0`` turns a ps cluster back into a plain one, ``min_np=0`` an elastic cluster
    back into a fixed-size one. Not checked here (``check`` does that)."""
    tf_ps, min_np, max_np = given.pop("tf_ps"), given.pop("min_np"), given.pop("max_np")
    changes: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    if tf_ps is not None:
        changes["tf_ps"] = None if tf_ps == 0 else tf_ps
    if min_np is not None:
        changes["min_np"] = min_np or None
        changes["max_np"] = max_np if min_np else None
    elif max_np is not None:
        changes["max_np"] = max_np
    out = {**options, **changes}
    if "n" in changes and out.get("engine_sets"):
        raise ClusterError(
            "this cluster was started with engine sets (ranks per host): change their `n` "
            "with a new Cluster(engine_sets=...), not restart(n=...)"
        )
    return out


def _check_elastic(
    min_np: Any,
    max_np: Any,
    n: int,
    launcher: str,
    multi_host: bool,
    backend: Any,
    ps: int,
    hostfile: str | None = None,
) -> tuple[int | None, int | None]:
    """``--min-np M [--max-np K]``: checked against ``n`` and the rest of the options."""
    if min_np is None:
        if max_np is not None:
            raise ClusterError(
                f"--max-np {max_np} is for an elastic cluster: add `--min-np M` (the fewest "
                "ranks it may go on with), e.g. `%dist start -n 4 --min-np 2 --max-np 4`"
            )
        return None, None
    for name, v in (("--min-np", min_np), ("--max-np", max_np)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ClusterError(f"{name} must be a whole number of ranks, 1 or more, not {v!r}")
    max_np = n if max_np is None else max_np
    if not min_np <= n <= max_np:
        raise ClusterError(
            f"an elastic cluster needs --min-np <= -n <= --max-np, got {min_np} <= {n} <= "
            f"{max_np}: e.g. `%dist start -n {max(n, min_np)} --min-np {min(min_np, n)}`"
        )
    if launcher != "mpi" or (multi_host and not hostfile):
        raise ClusterError(
            "an elastic cluster (--min-np) starts its engines itself, one per slot: on this "
            "host, or across hosts over ssh with `--hosts FILE`; leave out --launcher "
            f"{launcher} and engine sets (Slurm: a fixed-size cluster)"
        )
    if backend == "mpi" or ps:
        raise ClusterError(
            "an elastic cluster has no MPI job (MPICH cannot shrink a communicator, and "
            "its launcher ends every rank when one dies), so --backend mpi and --tf-ps do "
            "not apply: leave them out (gloo on CPU, NCCL on GPUs)"
        )
    return min_np, max_np


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


def _check_tf_ps(k: Any, n: int) -> int:
    """``--tf-ps K``: parameter servers among ``n`` ranks (None: none, no ps cluster)."""
    if k is None:
        return 0
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ClusterError(
            f"--tf-ps must be the number of parameter servers, 1 or more, not {k!r}: "
            "`%dist start -n 3 --tf-ps 1` (leave --tf-ps out for MultiWorkerMirroredStrategy)"
        )
    if k >= n:
        raise ClusterError(
            f"--tf-ps {k} leaves no worker among {n} rank{'s' if n > 1 else ''}: "
            f"ParameterServerStrategy needs a worker besides its parameter servers; use "
            f"`-n {k + 1}` or more (add --oversubscribe beyond this host's cores)"
        )
    if importlib.util.find_spec("tensorflow") is None:
        raise ClusterError(
            "--tf-ps needs TensorFlow, in this kernel (the coordinator) and on the ranks: "
            f"{install_command('tensorflow')}"
        )
    return k


def _check_hostfile(path: str) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ClusterError(
            f"hostfile {path!r} not found: write one host per line (`gpu1:4` for 4 "
            "ranks on gpu1), then `%dist start --hosts FILE`"
        )
    if not hostfile_hosts(str(p)):
        raise ClusterError(f"hostfile {path!r} names no host: one `host[:slots]` per line")
    return str(p.resolve())


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


def _listen_ip(
    ip: str | None,
    default: str,
    multi_host: bool,
    hostfile: str | None,
    sets: list[dict[str, Any]] | None,
) -> str:
    """Loopback for one host; across hosts one reachable address, never every one."""
    if not multi_host:
        return ip or default
    if ip:
        return ip
    if not is_loopback(default):
        return default  # HVDNB_IP
    peers = hostfile_hosts(hostfile) if hostfile else []
    peers += [str(es["host"]) for es in sets or [] if es.get("host")]
    try:
        return reachable_addr(peers)
    except OSError:
        raise ClusterError(
            "cannot tell which address the other hosts reach this one on: pass "
            "`--ip ADDRESS` (or Cluster(ip=...))"
        ) from None


def hostfile_entries(path: str) -> list[tuple[str, int]]:
    """An MPI hostfile's hosts and their slots, in order: ``host:4`` or ``host slots=4``
    hold 4, a bare host 1."""
    out = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        head, *rest = line.split()
        slots = 1
        if ":" in head:
            slots = int(head.split(":", 1)[1] or 1)
        for word in rest:
            if word.startswith("slots="):
                slots = int(word.split("=", 1)[1])
        out.append((head.split(":", 1)[0], max(slots, 1)))
    return out


def hostfile_slots(path: str) -> int:
    """Ranks an MPI hostfile holds (``hostfile_entries``' slots, summed)."""
    return sum(k for _, k in hostfile_entries(path))


def hostfile_hosts(path: str) -> list[str]:
    """Host names of an MPI hostfile (``host[:slots]`` or ``host slots=N`` per line)."""
    hosts = []
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            hosts.append(line.split()[0].split(":")[0])
    return hosts
