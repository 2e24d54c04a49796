"""What a cluster is launched with: the MPI launcher and the ipyparallel configuration of an
hvdnb cluster.

Owns: probes without side effects (no torch import, no CUDA initialisation, no process
started), and turning a checked ``StartSpec`` (``spec.py``) into an ``ipyparallel.Cluster``
that is configured but not started: controller flags (heartbeat; CurveZMQ across hosts,
whose session key file it writes), the engine command
(``python -m kernels_ext.engine``) and its flags, the engines' environment (loopback
transports on one host, the side channel, the state directory, a ps cluster's roles and
chief address), ``mpiexec`` or Slurm's sbatch script.

Never: start or stop processes (``lifecycle.py`` does), choose fixed ports, import torch,
or know the ``Cluster`` object (it is given the spec and the few run-time facts it needs).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from hvdnb.config import get_config
from hvdnb.notebook.cluster import sshslots
from hvdnb.notebook.cluster.spec import ClusterError, StartSpec, hostfile_hosts, hostfile_slots

__all__ = [
    "ClusterError",
    "configure_engines",
    "controller_key",
    "elastic_env",
    "engine_set_env",
    "find_mpiexec",
    "hostfile_hosts",
    "hostfile_slots",
    "make_ipp",
    "preflight",
    "sbatch_template",
    "tf_ps_env",
    "transient_start_failure",
    "warn_cuda_in_kernel",
]

log = logging.getLogger("hvdnb")
#: ipyparallel's own logger (``hvdnb.ipyparallel``): only its errors
_ipp_log = log.getChild("ipyparallel")
_ipp_log.setLevel(logging.ERROR)


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


def preflight(spec: StartSpec) -> None:
    """What an MPI start checks before it starts anything: an mpiexec, and with a hostfile,
    that every other host answers ssh (:mod:`hvdnb.notebook.cluster.sshcheck`)."""
    find_mpiexec()
    if spec.hosts and not spec.elastic:
        from hvdnb.notebook.cluster import sshcheck  # noqa: PLC0415  only across hosts

        bad = sshcheck.unreachable(
            hostfile_hosts(spec.hosts), spec.timeout, spec.launcher_config.get("mpi_args", ())
        )
        if bad:
            raise ClusterError(sshcheck.verdict(bad, spec.hosts))


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


def transient_start_failure(exc: BaseException, multi_host: bool) -> str:
    """Why a start failed for a reason a second try can clear ("" where it did not).

    - MPI_Init on one host: seen here once in ~100 starts made at the same instant as
      another job's, UCX's loopback address exchange ("failed to unpack address") aborts
      it. A real misconfiguration fails the second time too and is reported then.
    - A TensorFlow server's port: the ranks pick free ports for ``TF_CONFIG``, and another
      process on the host can take one before TensorFlow's server listens on it (seen once
      with a second test run on the box). The second start picks new ports.
    """
    if not isinstance(exc, ClusterError):
        return ""
    if not multi_host and "internal_Init_thread" in str(exc):
        return "MPI_Init failed on one host"
    if "Could not start gRPC server" in str(exc):
        return "a port TensorFlow's server was given was taken before it listened"
    return ""


def tf_ps_env(spec: StartSpec) -> dict[str, str]:
    """What the ranks of a ParameterServerStrategy cluster (``--tf-ps K``) need in their
    environment: ``K``, and the notebook kernel's address as TensorFlow's chief (a port free
    now, on the address the ranks reach this kernel on); empty for other clusters."""
    if not spec.tf_ps:
        return {}
    host = spec.ip if spec.multi_host else "127.0.0.1"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    chief = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return {"HVDNB_TF_PS": str(spec.tf_ps), "HVDNB_TF_CHIEF": chief}


def make_ipp(
    spec: StartSpec,
    cluster_id: str,
    channel_endpoint: str | None,
    state_dir: str | None,
    standby: dict[str, Any] | None = None,
) -> Any:
    """An ``ipyparallel.Cluster`` configured for ``spec`` (a cluster's checked options) under
    ``cluster_id``, not started; its ranks connect their side channel to
    ``channel_endpoint`` and keep ``hvdnb.State`` commits in ``state_dir``; ``standby``: how
    they are handed to warm standby processes (``configure_engines``)."""
    import ipyparallel as ipp  # noqa: PLC0415  ipyparallel is heavy: loaded only where it is used

    cfg = get_config()
    c = ipp.Cluster(
        # an elastic cluster's engines are separate processes, one engine set per slot: no
        # mpiexec whose end would end them all (across hosts each over ssh: sshslots.py)
        engines=(sshslots.launcher_class() if spec.multi_host else "local")
        if spec.elastic
        else spec.launcher,
        n=spec.n,
        cluster_id=cluster_id,
        controller_ip=spec.ip,
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
        engine_timeout=spec.timeout,
    )
    if spec.multi_host and cfg.curve:
        c.controller_args += _curve_args(state_dir or os.path.join(c.profile_dir, "security"))
    configure_engines(c, spec, channel_endpoint, state_dir, standby)
    return c


def _curve_args(private_dir: str) -> list[str]:
    """The controller's options for CurveZMQ across hosts. ipyparallel drops the session
    key under Curve unless one is given; hvdnb's side channel signs with it, so it is kept,
    read from a 0600 file (a key on the command line would show in ``ps``)."""
    fd, keyfile = tempfile.mkstemp(prefix="controller-", suffix=".key", dir=private_dir)
    with os.fdopen(fd, "w") as f:  # mkstemp's file is 0600
        f.write(secrets.token_hex(32))
    return ["--IPController.enable_curve=True", f"--Session.keyfile={keyfile}"]


def controller_key(spec: StartSpec) -> tuple[Any, ...]:
    """What a started controller depends on: a spare one (``standby.py``) serves a start
    whose spec has the same key."""
    return (spec.launcher, spec.elastic, spec.ip, spec.multi_host, get_config().heartbeat_ms)


def configure_engines(
    c: Any,
    spec: StartSpec,
    channel_endpoint: str | None,
    state_dir: str | None,
    standby: dict[str, Any] | None = None,
) -> None:
    """Configure the engines of ipyparallel cluster ``c`` for ``spec``: their command,
    arguments, environment and launcher (the controller is not touched, so a spare
    controller started for an earlier spec serves this one). ``standby``: ``cmd`` (the
    stand-in's command, ``hvdnb.rank.adopt``) and ``env`` for a warm start."""
    local = not spec.multi_host
    env = {"HVDNB_BACKEND": spec.backend or "", **spec.engine_env, **tf_ps_env(spec)}
    if channel_endpoint is not None:
        env["HVDNB_CHANNEL"] = channel_endpoint
    if state_dir is not None:
        env["HVDNB_STATE_DIR"] = state_dir
    if local:
        # keep every transport on loopback: MPICH's UCX netmod and gloo's pairs would
        # otherwise listen on the host's public address
        env.setdefault("UCX_NET_DEVICES", "lo")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["PYTHONUNBUFFERED"] = "1"
    engine_cmd = [sys.executable, "-m", "kernels_ext.engine"]
    if standby is not None:
        engine_cmd = list(standby["cmd"])
        env.update(standby["env"])
    c.n = spec.n
    launcher_cls = c.engine_launcher_class.__name__
    if launcher_cls == "HostEngineSetLauncher":
        sshslots.configure(c)
        env = {**sshslots.forwarded(dict(os.environ)), **env}
    c.config[launcher_cls].engine_cmd = engine_cmd
    c.config[launcher_cls].engine_args = [
        f"--IPEngine.wait_for_url_file={spec.timeout}",
        "--log-level=WARN",
        # ipykernel's OutStream minus the cross-thread waits of empty flushes
        "--IPEngine.out_stream_factory=hvdnb.rank.iostream.OutStream",
    ]
    # ranks that rendezvous through the notebook read the session key from here
    env["HVDNB_ENGINE_FILE"] = os.path.join(
        c.profile_dir, "security", f"ipcontroller-{c.cluster_id}-engine.json"
    )
    c.config[launcher_cls].environment = env
    if spec.launcher == "mpi" and not spec.elastic:
        hostfile = spec.hosts is not None or any(
            "host" in str(a) for a in spec.launcher_config.get("mpi_args", [])
        )
        c.config.MPILauncher.mpi_cmd = [find_mpiexec(local=not hostfile)]
        if spec.hosts:
            c.config.MPILauncher.mpi_args = ["-f", spec.hosts]
    if spec.launcher == "slurm":
        # script and job output beside the connection files, not in the notebook's cwd
        base = os.path.join(c.profile_dir, "log", f"ipengine-{c.cluster_id}-slurm")
        c.config[launcher_cls].batch_file_name = base + ".sbatch"
        c.config[launcher_cls].output_file = base + ".out"
        c.config[launcher_cls].batch_template = sbatch_template(spec, base + ".out")
    for k, v in spec.launcher_config.items():
        c.config[launcher_cls][k] = v


def sbatch_template(spec: StartSpec, output: str) -> str:
    """The engines' sbatch script: ipyparallel fills ``{n}``, ``{cluster_id}`` and
    ``{program_and_args}``; ``srun`` starts one engine per task."""
    lines = [
        "#!/bin/sh",
        "#SBATCH --export=ALL",
        "#SBATCH --job-name=ipengine-{cluster_id}",
        "#SBATCH --ntasks={n}",
        f"#SBATCH --output={output}",
    ]
    for k, v in spec.slurm.items():
        if v not in (None, ""):
            lines.append(f"#SBATCH --{k}={v}")
    lines += [f"#SBATCH {a}" for a in spec.sbatch_args]
    lines.append("srun {program_and_args}")
    return "\n".join(lines) + "\n"


def engine_set_env(spec: StartSpec, i: int, base: int) -> dict[str, str]:
    """What tells the ranks of engine set ``i`` their global numbers."""
    assert spec.engine_sets is not None
    return {
        "HVDNB_RANK_BASE": str(base),
        "HVDNB_WORLD_SIZE": str(spec.n),
        "HVDNB_CROSS_RANK": str(i),
        "HVDNB_CROSS_SIZE": str(len(spec.engine_sets)),
    }


def elastic_env(slot: int, size: int, store: str, join: bool = False) -> dict[str, str]:
    """What tells the engine of an elastic cluster's ``slot`` its place: the first
    generation's size and the rendezvous store (``HOST:PORT``); ``join``: it joins a
    running cluster (``%dist scale``) at the generation the notebook forms next."""
    env = {
        "HVDNB_ELASTIC": "1",
        "HVDNB_SLOT": str(slot),
        "HVDNB_WORLD_SIZE": str(size),
        "HVDNB_ELASTIC_STORE": store,
    }
    if join:
        env["HVDNB_ELASTIC_JOIN"] = "1"
    return env
