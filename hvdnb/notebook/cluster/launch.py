"""What a cluster is launched with: this host's cores and GPUs, the MPI launcher,
hostfiles, and the ipyparallel configuration of an hvdnb ``Cluster``.

Owns: probes without side effects (no torch import, no CUDA initialisation, no process
started), and turning a validated ``Cluster`` into an ``ipyparallel.Cluster`` that is
configured but not started: controller flags (heartbeat), the engine command
(``python -m hvdnb.rank.engine``) and its flags, the engines' environment (loopback
transports on one host, the side channel, the state directory), ``mpiexec`` or Slurm's
sbatch script.

Never: start or stop processes (``cluster.py`` does), choose fixed ports, or import torch.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hvdnb.config import get_config


if TYPE_CHECKING:
    from hvdnb.notebook.cluster.lifecycle import Cluster

__all__ = [
    "ClusterError",
    "engine_set_env",
    "find_mpiexec",
    "hostfile_hosts",
    "hostfile_slots",
    "make_ipp",
    "sbatch_template",
    "transient_mpi_init_failure",
    "warn_cuda_in_kernel",
]

log = logging.getLogger("hvdnb")
_ipp_log = logging.getLogger("hvdnb.ipyparallel")
_ipp_log.setLevel(logging.ERROR)


class ClusterError(RuntimeError):
    """A cluster could not be started, reached or stopped; the message says what to do."""


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


def warn_cuda_in_kernel() -> None:
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


def transient_mpi_init_failure(exc: BaseException, multi_host: bool) -> bool:
    """Did a one-host start fail inside MPI_Init for a reason a second try can clear?

    Seen here once in ~100 starts made at the same instant as another job's: UCX's
    loopback address exchange ("failed to unpack address") aborts MPI_Init. A real
    misconfiguration fails the second time too and is reported then.
    """
    return not multi_host and isinstance(exc, ClusterError) and "internal_Init_thread" in str(exc)


def hostfile_slots(path: str) -> int:
    """Ranks an MPI hostfile holds: ``host:4`` or ``host slots=4`` count 4, a bare host 1."""
    total = 0
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
        total += max(slots, 1)
    return total


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


def make_ipp(self: Cluster) -> Any:
    """An ``ipyparallel.Cluster`` configured for ``self`` (an hvdnb Cluster), not started."""
    import ipyparallel as ipp

    cfg = get_config()
    local = not self.multi_host
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
        controller_ip=self.ip,
        controller_args=[
            f"--HeartMonitor.period={cfg.heartbeat_ms}",
            # a fast heartbeat for start-up, but no less patience than 3 s before an
            # engine that stops answering (a starved host) is declared dead
            f"--HeartMonitor.max_heartmonitor_misses={max(10, -(-3000 // cfg.heartbeat_ms))}",
        ],
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
        # ipykernel's OutStream minus the cross-thread waits of empty flushes
        "--IPEngine.out_stream_factory=hvdnb.rank.iostream.OutStream",
    ]
    # ranks that rendezvous through the notebook read the session key from here
    env["HVDNB_ENGINE_FILE"] = os.path.join(
        c.profile_dir, "security", f"ipcontroller-{self.cluster_id}-engine.json"
    )
    c.config[launcher_cls].environment = env
    if self.launcher == "mpi":
        hostfile = self.hosts is not None or any(
            "host" in str(a) for a in self.launcher_config.get("mpi_args", [])
        )
        c.config.MPILauncher.mpi_cmd = [find_mpiexec(local=not hostfile)]
        if self.hosts:
            c.config.MPILauncher.mpi_args = ["-f", self.hosts]
    if self.launcher == "slurm":
        # script and job output beside the connection files, not in the notebook's cwd
        base = os.path.join(c.profile_dir, "log", f"ipengine-{self.cluster_id}-slurm")
        c.config[launcher_cls].batch_file_name = base + ".sbatch"
        c.config[launcher_cls].output_file = base + ".out"
        c.config[launcher_cls].batch_template = sbatch_template(self, base + ".out")
    for k, v in self.launcher_config.items():
        c.config[launcher_cls][k] = v
    return c


def sbatch_template(self: Cluster, output: str) -> str:
    """The engines' sbatch script: ipyparallel fills ``{n}``, ``{cluster_id}`` and
    ``{program_and_args}``; ``srun`` starts one engine per task."""
    lines = [
        "#!/bin/sh",
        "#SBATCH --export=ALL",
        "#SBATCH --job-name=ipengine-{cluster_id}",
        "#SBATCH --ntasks={n}",
        f"#SBATCH --output={output}",
    ]
    for k, v in self.slurm.items():
        if v not in (None, ""):
            lines.append(f"#SBATCH --{k}={v}")
    lines += [f"#SBATCH {a}" for a in self.sbatch_args]
    lines.append("srun {program_and_args}")
    return "\n".join(lines) + "\n"


def engine_set_env(self: Cluster, i: int, base: int) -> dict[str, str]:
    """What tells the ranks of engine set ``i`` their global numbers."""
    assert self.engine_sets is not None
    return {
        "HVDNB_RANK_BASE": str(base),
        "HVDNB_WORLD_SIZE": str(self.n),
        "HVDNB_CROSS_RANK": str(i),
        "HVDNB_CROSS_SIZE": str(len(self.engine_sets)),
    }
