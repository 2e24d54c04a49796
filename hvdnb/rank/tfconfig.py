"""TensorFlow's view of the job: ``TF_CONFIG`` on every rank, set at the engine's bootstrap.

``tf.distribute.MultiWorkerMirroredStrategy`` reads its cluster from the ``TF_CONFIG``
variable when it is built: every worker's ``host:port`` in rank order, and which of them
this process is::

    {"cluster": {"worker": ["127.0.0.1:41234", "127.0.0.1:41235"]},
     "task": {"type": "worker", "index": 1}}

``setup`` runs on every rank after the torch rendezvous and before the engine registers,
so the first ``%%distributed`` cell that imports TensorFlow finds it set. Each rank picks a
free port on its own address (bind port 0, read it, close it); the list travels over MPI
(``allgather``) when MPI sees the whole job, else over torch.distributed's default group
(``all_gather_object``: srun without PMI, per-host engine sets, torchrun). The address is
127.0.0.1 when the whole job is on one host; across hosts it is this rank's address on
its route to rank 0 (``MASTER_ADDR``, which rendezvous chose reachable from every host).

Also sets ``TF_NUM_INTRAOP_THREADS`` / ``TF_NUM_INTEROP_THREADS`` (unless set; in a ps
cluster only the first) to this rank's share of the host's cores, as rendezvous sets
torch's thread count: ranks that each start a thread per core oversubscribe the host.

ParameterServerStrategy (``%dist start -n N --tf-ps K``: ``HVDNB_TF_PS`` and the notebook's
``HVDNB_TF_CHIEF`` address in the engine's environment): ranks ``0..K-1`` are ``ps`` tasks,
the others ``worker`` tasks, the notebook kernel the ``chief`` (the coordinator); each rank
then serves ``tf.distribute.Server`` on its port from its bootstrap until it stops::

    {"cluster": {"ps": [A0], "worker": [A1, A2], "chief": [NOTEBOOK]},
     "task": {"type": "worker", "index": 0}}                      # rank 1

The panel of a ps cluster (``hvdnb.ClusterCoordinator``, notebook side) calls ``report_role``
on every rank: each rank's messages then say its role, and a parameter server, which never
runs a cell, starts its recorder's heartbeat so that its memory (RSS) reaches the panel.

Owns: the worker address, the port probe, the exchange, the JSON and a ps cluster's
server. Never: import tensorflow unless the cluster is a ps cluster (optional, and seconds
to import: a rank that never uses it pays nothing),
override a ``TF_CONFIG`` the user set (if any rank has one, no rank gets ours), or keep a
port open (TensorFlow's gRPC server binds it when the strategy is built, on every interface:
TensorFlow's choice; until then another process could take it).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from hvdnb.host import reachable_addr
from hvdnb.rank.metrics import recorder
from hvdnb.rank.rendezvous import World, threads_per_rank

__all__ = [
    "free_port",
    "ps_config",
    "report_role",
    "resolve",
    "server",
    "setup",
    "tf_config",
    "worker_addr",
]


def tf_config(workers: Sequence[str], index: int) -> str:
    """The ``TF_CONFIG`` JSON of worker ``index`` in a cluster of ``workers`` (``host:port``)."""
    if not 0 <= index < len(workers):
        raise ValueError(f"worker index {index} outside a cluster of {len(workers)}")
    if len(set(workers)) != len(workers):
        raise ValueError(f"two workers share an address: {list(workers)}")
    return json.dumps(
        {"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": index}}
    )


def ps_config(addrs: Sequence[str], rank: int, n_ps: int, chief: str) -> str:
    """The ``TF_CONFIG`` JSON of ``rank`` in a ParameterServerStrategy cluster: the first
    ``n_ps`` of ``addrs`` (rank order) are ``ps`` tasks, the rest ``worker`` tasks, and
    ``chief`` (the notebook kernel's ``host:port``) is the coordinator."""
    if not 0 < n_ps < len(addrs):
        raise ValueError(f"{n_ps} parameter servers among {len(addrs)} ranks leave no worker")
    if not 0 <= rank < len(addrs):
        raise ValueError(f"rank {rank} outside a cluster of {len(addrs)}")
    if len({*addrs, chief}) != len(addrs) + 1:
        raise ValueError(f"two tasks share an address: {[*addrs, chief]}")
    role, index = ("ps", rank) if rank < n_ps else ("worker", rank - n_ps)
    cluster = {"ps": list(addrs[:n_ps]), "worker": list(addrs[n_ps:]), "chief": [chief]}
    return json.dumps({"cluster": cluster, "task": {"type": role, "index": index}})


def resolve(entries: Sequence[str | None], index: int) -> str | None:
    """This rank's ``TF_CONFIG`` from every rank's entry (rank order), or None when a rank
    has none (it found no port, or its user set ``TF_CONFIG``): then no rank gets one."""
    if any(e is None for e in entries):
        return None
    return tf_config([str(e) for e in entries], index)


def worker_addr(w: World, master_addr: str | None) -> str:
    """The address other workers reach this rank on: loopback when the whole job is on
    one host, else this host's address on the route to rank 0 (``master_addr``)."""
    if w.local_size >= w.size:
        return "127.0.0.1"
    return reachable_addr([master_addr])


def free_port(addr: str) -> int | None:
    """A port that is free on ``addr`` now (None if binding fails). Nothing stays open."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
            return int(s.getsockname()[1])
    except OSError:
        return None


def _host_port(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def _exchange(w: World, entry: str | None) -> list[str | None] | None:
    """Every rank's entry in rank order (collective), or None when there is no way to ask."""
    if w.size == 1:
        return [entry]
    if w.comm is not None:
        return list(w.comm.allgather(entry))
    import torch.distributed as dist  # noqa: PLC0415 (only without MPI; seconds to import)

    if not (dist.is_available() and dist.is_initialized()):
        return None
    out: list[Any] = [None] * w.size
    dist.all_gather_object(out, entry)
    return out


def _distinct_entries(w: World, addr: str, avoid: str = "") -> list[str | None] | None:
    """Every rank's ``host:port`` on ``addr`` (collective), no two alike and none equal to
    ``avoid`` (the chief's). Probed ports are closed at once, so two processes on one host
    can be handed the same free port (seen: a rank and the chief, at a restart): a rank
    whose entry an earlier rank, or the chief, already has probes again, for a few rounds."""
    port = free_port(addr)
    entry = None if port is None else _host_port(addr, port)
    entries = _exchange(w, entry)
    for _ in range(8):
        if entries is None or any(e is None for e in entries):
            return entries  # a rank with its own TF_CONFIG, or no port: the caller says
        if not any(e == avoid or e in entries[:i] for i, e in enumerate(entries)):
            return entries
        if entry == avoid or entry in entries[: w.rank]:
            port = free_port(addr)
            entry = None if port is None else _host_port(addr, port)
        entries = _exchange(w, entry)
    return entries


def _set_threads(w: World, inter_op: bool = True) -> None:
    """This rank's share of the cores for TensorFlow's op threads. Not the inter-op pool of
    a ps cluster's server (``inter_op=False``): a remote function waiting for a variable
    from a parameter server holds an inter-op thread, and with one thread the coordinator's
    first step never ended (TF 2.21, 1 ps + 2 workers, ``TF_NUM_INTEROP_THREADS=1``)."""
    n = str(threads_per_rank(w))
    # TensorFlow's C++ core logs INFO lines at import ("I0000 ... oneDNN custom operations
    # are on ..."), a dozen per rank above the cell's own output: a notebook shows its
    # warnings and errors; a user who sets the level keeps theirs
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", n)
    if inter_op:
        os.environ.setdefault("TF_NUM_INTEROP_THREADS", n)


_SERVER: list[Any] = []  # this rank's tf.distribute.Server in a ps cluster (kept serving)


def server() -> Any:
    """This rank's ``tf.distribute.Server`` in a ParameterServerStrategy cluster, or None."""
    return _SERVER[0] if _SERVER else None


def _serve(value: str) -> Any:
    """Start this rank's ``tf.distribute.Server`` for ``TF_CONFIG`` ``value`` (ps cluster)."""
    cfg = json.loads(value)
    role, index = cfg["task"]["type"], cfg["task"]["index"]
    addr = cfg["cluster"][role][index]
    import tensorflow as tf  # noqa: PLC0415 (optional, and seconds to import)

    try:
        srv = tf.distribute.Server(
            tf.train.ClusterSpec(cfg["cluster"]),
            job_name=role,
            task_index=index,
            protocol="grpc",
            start=True,
        )
    except Exception as exc:  # the port was taken since the probe, most often
        raise RuntimeError(
            f"TensorFlow's server ({role} {index}) could not listen on {addr}: "
            f"{type(exc).__name__}: {exc}. Is the port taken? `%dist restart` picks new ports"
        ) from None
    _SERVER[:] = [srv]
    return srv


def _setup_ps(w: World, n_ps: int, chief: str) -> str:
    """``setup`` of a ParameterServerStrategy cluster: every rank gets a role and serves."""
    if os.environ.get("TF_CONFIG"):
        raise RuntimeError(
            "TF_CONFIG is set in the engines' environment, and --tf-ps makes its own: "
            "unset TF_CONFIG before %dist start, or leave --tf-ps out"
        )
    if not 0 < n_ps < w.size:
        raise RuntimeError(f"--tf-ps {n_ps} among {w.size} ranks leaves no worker")
    addr = worker_addr(w, os.environ.get("MASTER_ADDR"))
    entries = _distinct_entries(w, addr, avoid=chief)
    if entries is None or any(e is None for e in entries):
        raise RuntimeError(f"a rank found no free port for TensorFlow's server: {entries}")
    value = ps_config([str(e) for e in entries], w.rank, n_ps, chief)
    os.environ["TF_CONFIG"] = value
    _serve(value)
    return value


def setup(w: World) -> str | None:
    """Set ``TF_CONFIG`` on this rank (collective: every rank calls it, after the torch
    rendezvous). Returns the value set, or None when it was left alone. In a ps cluster
    (``HVDNB_TF_PS``) also starts this rank's TensorFlow server, or raises saying why not."""
    n_ps = int(os.environ.get("HVDNB_TF_PS") or 0)
    _set_threads(w, inter_op=not n_ps)
    if n_ps:
        return _setup_ps(w, n_ps, os.environ.get("HVDNB_TF_CHIEF", ""))
    user = bool(os.environ.get("TF_CONFIG"))
    if user:
        _exchange(w, None)  # collective: the other ranks learn that this one has its own
        return None
    entries = _distinct_entries(w, worker_addr(w, os.environ.get("MASTER_ADDR")))
    if entries is None:
        return None
    value = resolve(entries, w.rank)
    if value is None:
        print(
            f"hvdnb: rank {w.rank}: TF_CONFIG left unset (another rank has its own, or found "
            "no free port)",
            file=sys.stderr,
            flush=True,
        )
        return None
    os.environ["TF_CONFIG"] = value
    return value


def report_role() -> tuple[str, int] | None:
    """Say this rank's role in a ps cluster with its metrics messages (``tf_role``,
    ``tf_index`` in each message's ``meta``) and, on a parameter server, start the
    recorder's flusher thread: its heartbeat (every 4 flush intervals) carries the RSS.
    Workers get no heartbeat: the coordinator speaks for their steps (a heartbeat's step
    would read 0 over the coordinator's count). Returns (role, index), or None outside a
    ps cluster; idempotent."""
    if not _SERVER or not os.environ.get("TF_CONFIG"):
        return None
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    role, index = str(task["type"]), int(task["index"])
    rec = recorder.get_recorder()
    # tf_since: readings older than this (this rank's clock, as its points' times) are not of
    # this role: an earlier cluster's same rank number, which the notebook's store still holds
    rec.meta.setdefault("tf_since", time.time())
    rec.meta.update(tf_role=role, tf_index=index)
    if role == "ps":
        rec.flusher.start()  # no-op once running, or without a side channel
    return role, index
