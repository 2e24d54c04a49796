"""Who am I in the job, and the default torch.distributed process group.

Owns: discovering rank / size / local rank (from MPI under ``mpiexec``, from Slurm's task
variables under ``srun``, from hvdnb's per-host engine sets, from torchrun's variables, or
a world of one), exporting the torchrun-style variables, choosing the device, the thread
count and the network interface, and (re)initialising the default process group through a
TCPStore that rank 0 opens on a free port and announces race-free: over MPI when MPI sees
the whole job, else over hvdnb's signed side channel through the notebook.

Ranks under srun: Slurm's ``--mpi=pmi2``/``pmix`` give MPICH its world, and then MPI is
used as under mpiexec; with a site's default ``--mpi=none`` MPI sees a world of one, so
rank, size and local rank come from ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID``
and rank 0's store address and port travel over the side channel (MASTER_ADDR is the
address of rank 0's route to the notebook, so it is reachable wherever the notebook is).

Never: start processes, talk to ipyparallel, or pick a fixed port.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from hvdnb.config import get_config
from hvdnb.host import cores, ifname_of, is_loopback, reachable_addr, route_addr
from hvdnb.protocol import kinds
from hvdnb.rank import gpurules
from hvdnb.rank.frameworks.common import Place
from hvdnb.rank.frameworks.torch_hooks import destroy_default_group

__all__ = [
    "World",
    "discover",
    "init_process_group",
    "listen_store",
    "place",
    "reinit_process_group",
    "rejoin",
    "release_group",
    "store",
    "world",
]

_WORLD: World | None = None
_STORE: Any = None
_GENERATION = 0
#: one release at a time: the training thread (its collective failed) and the side
#: channel's thread (the notebook announced a lost rank) may both let the group go
_RELEASE = threading.Lock()


@dataclass(frozen=True)
class World:
    """This process's place in the job."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str
    #: "mpi" under mpiexec, "slurm" under srun without a PMI world, "sets" for one of
    #: several per-host engine sets, "elastic" in an elastic cluster (no MPI; the group is
    #: re-formed when ranks leave), "env" under torchrun, "single" otherwise
    source: str

    @property
    def comm(self) -> Any:
        """mpi4py's COMM_WORLD (None when the job was not started by mpiexec)."""
        if self.source != "mpi":
            return None
        from mpi4py import MPI  # noqa: PLC0415  mpi4py initialises MPI on import: only where MPI is used

        return MPI.COMM_WORLD


def _under_mpiexec() -> bool:
    keys = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
    return any(k in os.environ for k in keys)


def _launched_size() -> int:
    """How many ranks the launcher says it started (0 when it does not say)."""
    for key in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        try:
            return int(os.environ[key])
        except (KeyError, ValueError):
            continue
    return 0


def _under_srun_without_pmi() -> bool:
    """A Slurm task whose MPI would see a world of one (srun --mpi=none)."""
    return (
        "SLURM_PROCID" in os.environ
        and "SLURM_NTASKS" in os.environ
        and not any(
            k in os.environ for k in ("PMI_RANK", "PMI_FD", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")
        )
    )


def _int_env(key: str, default: int) -> int:
    try:
        return int(os.environ[key])
    except (KeyError, ValueError):
        return default


def discover() -> World:
    """Find this process's rank, size and local rank, once per process.

    Order: one of hvdnb's per-host engine sets (``HVDNB_WORLD_SIZE`` set by the client,
    MPI within the set), a Slurm task without a PMI world (``SLURM_PROCID`` ...), MPI (when
    started by mpiexec, or srun with PMI), then torchrun's ``RANK``/``WORLD_SIZE``/
    ``LOCAL_RANK``, else a world of one.
    """
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    host = socket.gethostname()
    if os.environ.get("HVDNB_ELASTIC") == "1" and "HVDNB_ELASTIC_STORE" in os.environ:
        _WORLD = _elastic_world(host)
    elif "HVDNB_WORLD_SIZE" in os.environ and "HVDNB_RANK_BASE" in os.environ:
        # one engine set per host: MPI numbers the ranks within the set, the client
        # numbered the sets
        local_rank, local_size = 0, 1
        if _under_mpiexec():
            from mpi4py import MPI  # noqa: PLC0415  mpi4py initialises MPI on import: only where MPI is used

            local_rank, local_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        _WORLD = World(
            rank=_int_env("HVDNB_RANK_BASE", 0) + local_rank,
            size=_int_env("HVDNB_WORLD_SIZE", 1),
            local_rank=local_rank,
            local_size=local_size,
            cross_rank=_int_env("HVDNB_CROSS_RANK", 0),
            cross_size=_int_env("HVDNB_CROSS_SIZE", 1),
            hostname=host,
            source="sets",
        )
    elif _under_srun_without_pmi():
        size = _int_env("SLURM_NTASKS", 1)
        nodes = max(_int_env("SLURM_NNODES", 1), 1)
        local_size = _int_env("SLURM_NTASKS_PER_NODE", 0) or _slurm_local_size(size, nodes)
        _WORLD = World(
            rank=_int_env("SLURM_PROCID", 0),
            size=size,
            local_rank=_int_env("SLURM_LOCALID", 0),
            local_size=local_size,
            cross_rank=_int_env("SLURM_NODEID", 0),
            cross_size=nodes,
            hostname=host,
            source="slurm",
        )
    elif _under_mpiexec():
        from mpi4py import MPI  # noqa: PLC0415  mpi4py initialises MPI on import: only where MPI is used

        comm = MPI.COMM_WORLD
        launched = _launched_size()
        if launched > 1 and comm.Get_size() == 1:
            lib = MPI.Get_library_version().splitlines()[0].strip()
            raise RuntimeError(
                f"mpiexec started {launched} ranks but mpi4py's MPI ({lib}) sees a world "
                "of 1: mpiexec belongs to another MPI "
                "than mpi4py. Use the mpiexec of the same environment (pip install mpich puts "
                "it beside python), or rebuild mpi4py against your site's MPI."
            )
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        cross = comm.Split(color=local.Get_rank(), key=comm.Get_rank())
        _WORLD = World(
            rank=comm.Get_rank(),
            size=comm.Get_size(),
            local_rank=local.Get_rank(),
            local_size=local.Get_size(),
            cross_rank=cross.Get_rank(),
            cross_size=cross.Get_size(),
            hostname=host,
            source="mpi",
        )
        local.Free()
        cross.Free()
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        _WORLD = World(
            rank=rank,
            size=size,
            local_rank=local_rank,
            local_size=local_size,
            cross_rank=int(os.environ.get("GROUP_RANK", rank // max(local_size, 1))),
            cross_size=max(size // max(local_size, 1), 1),
            hostname=host,
            source="env",
        )
    else:
        _WORLD = World(0, 1, 0, 1, 0, 1, host, "single")
    return _WORLD


def _elastic_world(host: str) -> World:
    """An elastic cluster's engine: one per slot, no MPI; the first generation's rank is
    the slot. Across hosts the notebook says where the slot is among them."""
    rank, size = _int_env("HVDNB_SLOT", 0), _int_env("HVDNB_WORLD_SIZE", 1)
    return World(
        rank,
        size,
        _int_env("HVDNB_LOCAL_RANK", rank),
        _int_env("HVDNB_LOCAL_SIZE", size),
        _int_env("HVDNB_CROSS_RANK", 0),
        _int_env("HVDNB_CROSS_SIZE", 1),
        host,
        "elastic",
    )


def _slurm_local_size(size: int, nodes: int) -> int:
    """Tasks on this node, from ``SLURM_TASKS_PER_NODE`` ("2(x3),1" style) or an even split."""
    spec = os.environ.get("SLURM_TASKS_PER_NODE", "")
    node = _int_env("SLURM_NODEID", 0)
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        num, _, rep = part.partition("(x")
        try:
            counts += [int(num)] * (int(rep.rstrip(")")) if rep else 1)
        except ValueError:
            counts = []
            break
    if node < len(counts):
        return counts[node]
    return max(1, -(-size // nodes))


def world() -> World:
    """The World of this process (discovered on first use)."""
    return discover()


def threads_per_rank(w: World) -> int:
    """Cores on this host divided by the ranks on it: more threads than cores make each step
    wait for the others' (``bench/bench_omp_wait.py``, ``bench/bench_oversubscribe.py``)."""
    return max(1, cores() // max(w.local_size, 1))


def _channel_host() -> str | None:
    """The notebook's address, from the side channel's endpoint (``tcp://host:port``)."""
    ep = os.environ.get("HVDNB_CHANNEL", "")
    if not ep.startswith("tcp://"):
        return None
    host = ep[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return host or None


def _master_addr(w: World, ip: str) -> str:
    """Rank 0's address: loopback when the whole job is on one host; across hosts, an
    explicit non-loopback ``ip``, else the address of rank 0's route to the notebook (an
    address the other hosts can reach, as the notebook's own is reachable from them)."""
    if w.local_size == w.size or not is_loopback(ip):
        return ip
    return reachable_addr([_channel_host()])


def _pin_interface(addr: str) -> None:
    """Make gloo use the interface of ``addr`` (its default resolves the hostname, which
    on a multi-homed node may name an address the other hosts cannot reach)."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or addr.startswith("127."):
        return
    name = ifname_of(addr)
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def export_env(w: World, master_addr: str, master_port: int) -> None:
    """Set the torchrun-style variables, so code written for torchrun runs unchanged."""
    os.environ.update(
        RANK=str(w.rank),
        WORLD_SIZE=str(w.size),
        LOCAL_RANK=str(w.local_rank),
        LOCAL_WORLD_SIZE=str(w.local_size),
        GROUP_RANK=str(w.cross_rank),
        NODE_RANK=str(w.cross_rank),  # Lightning's name for it
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    if w.source == "elastic":  # as horovodrun --elastic tells its workers
        os.environ.update(
            HOROVOD_RANK=str(w.rank),
            HOROVOD_SIZE=str(w.size),
            HOROVOD_LOCAL_RANK=str(w.local_rank),
            HOROVOD_LOCAL_SIZE=str(w.local_size),
            HOROVOD_HOSTNAME=w.hostname,
        )


def shares_gpus(w: World) -> bool:
    """Do this host's ranks outnumber the GPUs they can see (``--oversubscribe``)?"""
    import torch  # noqa: PLC0415  torch is heavy: loaded when first used

    return torch.cuda.is_available() and w.local_size > torch.cuda.device_count()


def default_backend(w: World | None = None) -> str:
    """``nccl`` when each rank of this host has a GPU of its own, ``gloo`` otherwise.

    Ranks that share a GPU (more ranks than GPUs on a host) get gloo: NCCL refuses two
    ranks of one communicator on one device. Gloo reduces CUDA tensors too, through host
    memory, so the same training code runs, slower.
    """
    import torch  # noqa: PLC0415  torch is heavy: loaded when first used

    if not torch.cuda.is_available():
        return "gloo"
    return "gloo" if w is not None and shares_gpus(w) else "nccl"


def setup_device(w: World) -> str:
    """Pin this rank to its GPU by local rank (GPU hosts) and set torch's thread count.

    With more ranks than GPUs on the host they share them round-robin (rank ``i`` on GPU
    ``i % count``).
    """
    import torch  # noqa: PLC0415  torch is heavy: loaded when first used

    torch.set_num_threads(threads_per_rank(w))
    if torch.cuda.is_available():
        dev = w.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(dev)
        return f"cuda:{dev}"
    return "cpu"


def init_process_group(
    backend: str | None = None, timeout: float | None = None, ip: str | None = None
) -> World:
    """Initialise the default process group for this job, if it is not already.

    Under mpiexec, rank 0 opens a TCPStore on a free port and broadcasts the port over
    MPI; under torchrun, the ``MASTER_ADDR``/``MASTER_PORT`` it set are used. Also sets
    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK, MASTER_ADDR,
    MASTER_PORT, the device and the torch thread count. Collective on every rank.

    Parameters
    ----------
    backend : "gloo", "nccl", "mpi" or None (auto: nccl with GPUs, gloo without)
    timeout : collective timeout in seconds (default: ``Config.collective_timeout``)
    ip : address rank 0's store listens on (default: ``Config.ip``)
    """
    global _STORE
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

    cfg = get_config()
    w = discover()
    if dist.is_available() and dist.is_initialized():
        return w
    timeout_s = cfg.collective_timeout if timeout is None else timeout
    backend = backend or default_backend(w)
    if backend == "nccl":
        import torch  # noqa: PLC0415  torch is heavy: loaded when first used

        if not torch.cuda.is_available():  # every rank checks before the rendezvous
            raise RuntimeError(
                "backend nccl needs a CUDA GPU on every rank and this rank sees none: use "
                "--backend gloo, or leave --backend out to choose automatically"
            )
        if shares_gpus(w):
            raise RuntimeError(
                f"rank {w.rank}: backend nccl needs one GPU per rank, and this host "
                f"({w.hostname}) runs {w.local_size} ranks "
                f"on {torch.cuda.device_count()} GPU(s): NCCL refuses two ranks on one GPU. "
                "Start as many ranks as GPUs, or leave --backend out (gloo when ranks share)"
            )
        # ProcessGroupNCCL then records CUDA events around each collective on its stream:
        # the collective's own GPU time (Work._get_duration) that the panel shows
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    setup_device(w)
    _bind_group_defaults_before_init()
    if w.source == "env":
        # torchrun (or the user) already published the rendezvous address
        dist.init_process_group(
            backend, rank=w.rank, world_size=w.size, timeout=timedelta(seconds=timeout_s)
        )
        # without this, interpreter teardown can destroy gloo's threads first: "terminate
        # called without an active exception" and exit -6 after a successful run
        atexit.register(_shutdown)
        gpurules.install()
        return w
    _STORE, addr, port = _open_store(w, ip or cfg.ip, cfg.start_timeout)
    export_env(w, addr, port)
    if w.source == "elastic" and os.environ.get("HVDNB_ELASTIC_JOIN") == "1":
        # a rank added to a running elastic cluster joins the generation the notebook
        # forms with it (``rejoin``), not one of its own
        return w
    _init_from_store(backend, w, timeout_s)
    atexit.register(_shutdown)
    gpurules.install()  # a GPU node's point-to-point rules, on CPU ranks too
    return w


def _bind_group_defaults_before_init() -> None:
    """Import ``torch.distributed.nn.functional`` while no process group exists.

    That module binds ``group.WORLD`` as its functions' default arguments at import time
    (torch 2.13). Imported after ``init_process_group`` (``torch.optim`` imports it through
    torch._dynamo the first time an optimizer is built) it holds the default group for
    good: ``destroy_process_group`` at exit cannot free it, gloo's worker threads live into
    interpreter teardown, and one that drops a finished collective's tensor there needs
    the GIL and aborts the process ("terminate called without an active exception",
    exit -6, after a run that succeeded). Imported first, the defaults are None (the
    default group, whichever it is when called). Called only when no group exists yet.
    """
    import torch.distributed.nn.functional  # noqa: F401, PLC0415  torch is heavy: loaded when first used


def _shutdown() -> None:
    """Tear down in order at exit: the group, then the store it rendezvoused through."""
    global _STORE
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

    try:
        if dist.is_initialized():
            # a caught collective error keeps the group in a cycle (its traceback's frames
            # hold the transport): destroy frees the group only once that cycle is gone
            gc.collect()
            destroy_default_group()
    except Exception:  # exiting anyway; a broken group must not turn into a crash
        pass
    _STORE = None


def _open_store(w: World, ip: str, wait: float) -> tuple[Any, str, int]:
    from torch.distributed import TCPStore  # noqa: PLC0415  torch is heavy: loaded when first used

    if w.source == "elastic":  # the store lives in a process of its own, not on a rank
        addr, _, port_s = os.environ["HVDNB_ELASTIC_STORE"].rpartition(":")
        if not is_loopback(addr):  # across hosts: gloo on the interface toward the store
            _pin_interface(_route_or(addr))
        store = TCPStore(addr, int(port_s), None, False, timeout=timedelta(seconds=wait))
        return store, addr, int(port_s)
    if w.size == 1:
        addr = _master_addr(w, ip)
        store, port = listen_store(addr, 1, wait)
        return store, addr, port
    comm = w.comm
    if comm is None:  # srun without PMI, per-host engine sets: through the notebook
        return _open_store_via_channel(w, ip, wait)
    if w.rank == 0:
        addr = _master_addr(w, ip)
        try:
            store, port = listen_store(addr, w.size, wait)
        except Exception as exc:  # tell the others instead of leaving them in bcast
            comm.bcast(("", -1), root=0)
            raise RuntimeError(
                f"rank 0 could not open a rendezvous store on {addr}: {exc}"
            ) from exc
        comm.bcast((addr, port), root=0)
        _pin_interface(addr)
        return store, addr, port
    # rank 0's address, not ours: across hosts they differ
    addr, port = comm.bcast(None, root=0)
    if port < 0:
        raise RuntimeError("rank 0 could not open the rendezvous store; see rank 0's error")
    _pin_interface(_route_or(addr))
    store = TCPStore(addr, port, w.size, False, timeout=timedelta(seconds=wait))
    return store, addr, port


def _route_or(peer: str) -> str:
    try:
        return route_addr(peer)
    except OSError:
        return peer


def _engine_key(wait: float) -> bytes:
    """The ipyparallel session key, read from the engine connection file (0600) that the
    engine itself is about to read: the side channel is signed with it."""

    key = os.environ.get("HVDNB_CHANNEL_KEY")
    if key:
        return key.encode()
    path = os.environ.get("HVDNB_ENGINE_FILE", "")
    deadline = time.monotonic() + wait
    while True:
        try:
            with open(path) as f:
                return str(json.load(f)["key"]).encode()
        except (OSError, ValueError, KeyError):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no engine connection file at {path or '(HVDNB_ENGINE_FILE unset)'} after "
                    f"{wait:.0f} s: ranks on other hosts need the notebook's profile directory "
                    "on a shared file system (as ipyparallel's own engines do)"
                ) from None
            time.sleep(0.1)


def _open_store_via_channel(w: World, ip: str, wait: float) -> tuple[Any, str, int]:
    """Rank 0 opens the store and tells the notebook; the others ask the notebook. Each
    message is repeated until answered (the notebook may not hold the key yet)."""

    from torch.distributed import TCPStore  # noqa: PLC0415  torch is heavy: loaded when first used

    from hvdnb.rank import channel as kch  # noqa: PLC0415  the side channel (zmq) on an engine only: exported scripts never import zmq

    if not os.environ.get("HVDNB_CHANNEL"):
        raise RuntimeError(
            f"rank {w.rank} of {w.size} has no MPI world and no hvdnb side channel to "
            "rendezvous through: start the ranks with hvdnb.Cluster / %dist start"
        )
    ch = kch.get(rank=w.rank, key=_engine_key(wait))
    assert ch is not None
    got: dict[str, Any] = {}
    done = threading.Event()

    def on_store(msg: dict[str, Any]) -> None:
        got.update(addr=msg.get("addr"), port=msg.get("port"))
        done.set()

    ch.on(kinds.RDV_STORE, on_store)
    ch.on(kinds.RDV_OK, on_store)
    store = None
    if w.rank == 0:
        addr = _master_addr(w, ip)
        store, port = listen_store(addr, w.size, wait)
        _pin_interface(addr)
        ask = (kinds.RDV_ANNOUNCE, {"addr": addr, "port": port})
    else:
        ask = (kinds.RDV_ASK, {})
    deadline = time.monotonic() + wait
    try:
        while not done.is_set():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank {w.rank}: no rendezvous address from the notebook after {wait:.0f} s "
                    f"(channel {os.environ.get('HVDNB_CHANNEL')}): is the notebook's address "
                    "reachable from this host? Pass Cluster(ip=...) / `%dist start --ip ...`"
                )
            ch.send(ask[0], **ask[1])
            done.wait(0.5)
    finally:
        ch.off(kinds.RDV_STORE, on_store)
        ch.off(kinds.RDV_OK, on_store)
    if store is not None:
        return store, got["addr"], int(got["port"])
    addr, port = str(got["addr"]), int(got["port"])
    _pin_interface(_route_or(addr))
    store = TCPStore(addr, port, w.size, False, timeout=timedelta(seconds=wait))
    return store, addr, port


def listen_store(addr: str, size: int, wait: float) -> tuple[Any, int]:
    """A master TCPStore listening on ``addr`` only (TCPStore alone binds every interface):
    we bind the socket ourselves on a free port and hand TCPStore its descriptor."""
    from torch.distributed import TCPStore  # noqa: PLC0415  torch is heavy: loaded when first used

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = TCPStore(
        addr,
        port,
        size,
        True,
        timeout=timedelta(seconds=wait),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
    return store, port


def _init_from_store(backend: str, w: World, timeout_s: float) -> None:
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

    prefix = dist.PrefixStore(f"hvdnb/{_GENERATION}", _STORE)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        import torch  # noqa: PLC0415  torch is heavy: loaded when first used

        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        backend,
        store=prefix,
        rank=w.rank,
        world_size=w.size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )


def reinit_process_group(generation: int, backend: str | None = None) -> None:
    """Destroy the default group (if any) and build a fresh one under a new store prefix.

    Every rank must call this with the same ``generation`` (a number that only grows), e.g.
    after a failed collective left the group broken. Takes ~0.15 s with gloo.
    """
    global _GENERATION
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

    w = discover()
    if _STORE is None:
        raise RuntimeError("reinit_process_group needs a group made by init_process_group")
    old_backend = None
    if dist.is_initialized():
        old_backend = dist.get_backend()
        destroy_default_group()
    _GENERATION = generation
    _init_from_store(
        backend or old_backend or default_backend(w), w, get_config().collective_timeout
    )


def store() -> Any:
    """The rendezvous store this process's groups form through (None before the first)."""
    return _STORE


def release_group() -> None:
    """Let go of every process group after a peer was lost: each is aborted (its
    connections close, so peers still blocked on this rank fail at once, whatever still
    holds a reference to it), never destroyed (destroying an NCCL communicator with a dead
    peer can hang, pytorch#180611); gloo's abort closes its pairs the same way."""
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used
    import torch.distributed.distributed_c10d as c10d  # noqa: PLC0415  torch is heavy: loaded when first used

    with _RELEASE:
        if not dist.is_initialized():
            return
        abort = getattr(c10d, "_abort_process_group", None)
        if abort is not None:
            try:
                abort()
                return
            except Exception:  # an older torch, or a backend without abort: destroy below
                pass
        gc.collect()  # a caught collective error's frames hold the group (see _shutdown)
        destroy_default_group()


def rejoin(
    generation: int,
    rank: int,
    size: int,
    backend: str | None = None,
    place: tuple[int, int, int, int] | None = None,
) -> World:
    """Form generation ``generation`` of an elastic cluster's group, this rank being
    ``rank`` of ``size``: the old group is released, the torchrun-style variables are
    exported again, and the group forms under the generation's own store prefix (a store
    prefix used twice hangs, pytorch#55967). Collective over the new generation's ranks.
    ``place``: (local rank, local size, cross rank, cross size) across hosts (None: every
    rank on one host)."""
    global _WORLD, _GENERATION
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

    w = discover()
    if w.source != "elastic" or _STORE is None:
        raise RuntimeError(
            "rejoin is for the ranks of an elastic cluster (`%dist start -n N --min-np M`)"
        )
    old = str(dist.get_backend()) if dist.is_initialized() else None
    release_group()
    lr, ls, cr, cs = place or (rank, size, 0, 1)
    _WORLD = replace(
        w, rank=rank, size=size, local_rank=lr, local_size=ls, cross_rank=cr, cross_size=cs
    )
    export_env(_WORLD, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    _GENERATION = generation
    _init_from_store(
        backend or old or default_backend(_WORLD), _WORLD, get_config().collective_timeout
    )
    return _WORLD


def place(w: World, device: str) -> Place:
    """Where this rank stands, as the framework integrations read it (after the group
    exists)."""
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

    backend = str(dist.get_backend()) if dist.is_initialized() else ""
    return Place(w.rank, w.size, w.local_rank, w.local_size, w.cross_size, device, backend)


def generation() -> int:
    """How many times the default group has been rebuilt (0 for the first)."""
    return _GENERATION
