"""Who am I in the job, and the default torch.distributed process group.

Owns: discovering rank / size / local rank (from MPI under ``mpiexec``, from torchrun's
variables, or a world of one), exporting the torchrun-style variables, choosing the
device and the thread count, and (re)initialising the default process group through a
TCPStore that rank 0 opens on a free port and announces over MPI (race-free).

Never: start processes, talk to ipyparallel, or pick a fixed port.
"""

from __future__ import annotations

import atexit
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["World", "discover", "init_process_group", "reinit_process_group", "world"]

_WORLD: World | None = None
_STORE: Any = None
_GENERATION = 0


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
    #: "mpi" under mpiexec, "env" under torchrun, "single" otherwise
    source: str

    @property
    def comm(self) -> Any:
        """mpi4py's COMM_WORLD (None when the job was not started by mpiexec)."""
        if self.source != "mpi":
            return None
        from mpi4py import MPI

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


def discover() -> World:
    """Find this process's rank, size and local rank, once per process.

    Order: MPI (when started by mpiexec), then torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``,
    else a world of one.
    """
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    host = socket.gethostname()
    if _under_mpiexec():
        from mpi4py import MPI

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


def world() -> World:
    """The World of this process (discovered on first use)."""
    return discover()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def threads_per_rank(w: World) -> int:
    """Cores on this host divided by the ranks on it: oversubscribed threads cost 40x here."""
    return max(1, _cores() // max(w.local_size, 1))


def _master_addr(w: World, ip: str) -> str:
    """Rank 0's address: loopback when the whole job is on one host."""
    if w.local_size == w.size:
        return ip
    if ip not in ("127.0.0.1", "localhost"):
        return ip
    return socket.gethostbyname(socket.gethostname())


def export_env(w: World, master_addr: str, master_port: int) -> None:
    """Set the torchrun-style variables, so code written for torchrun runs unchanged."""
    os.environ.update(
        RANK=str(w.rank),
        WORLD_SIZE=str(w.size),
        LOCAL_RANK=str(w.local_rank),
        LOCAL_WORLD_SIZE=str(w.local_size),
        GROUP_RANK=str(w.cross_rank),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )


def default_backend() -> str:
    """``nccl`` when this process can see a GPU, ``gloo`` otherwise."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def setup_device(w: World) -> str:
    """Pin this rank to its GPU by local rank (GPU hosts) and set torch's thread count."""
    import torch

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
    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, the device
    and the torch thread count. Collective on every rank.

    Parameters
    ----------
    backend : "gloo", "nccl", "mpi" or None (auto: nccl with GPUs, gloo without)
    timeout : collective timeout in seconds (default: ``Config.collective_timeout``)
    ip : address rank 0's store listens on (default: ``Config.ip``)
    """
    global _STORE
    import torch.distributed as dist

    from .config import get_config

    cfg = get_config()
    w = discover()
    if dist.is_available() and dist.is_initialized():
        return w
    timeout_s = cfg.collective_timeout if timeout is None else timeout
    backend = backend or default_backend()
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available():  # every rank checks before the rendezvous
            raise RuntimeError(
                "backend nccl needs a CUDA GPU on every rank and this rank sees none: use "
                "--backend gloo, or leave --backend out to choose automatically"
            )
    setup_device(w)
    if w.source == "env":
        # torchrun (or the user) already published the rendezvous address
        dist.init_process_group(
            backend, rank=w.rank, world_size=w.size, timeout=timedelta(seconds=timeout_s)
        )
        # without this, interpreter teardown can destroy gloo's threads first: "terminate
        # called without an active exception" and exit -6 after a successful run
        atexit.register(_shutdown)
        return w
    _STORE, addr, port = _open_store(w, ip or cfg.ip, cfg.start_timeout)
    export_env(w, addr, port)
    _init_from_store(backend, w, timeout_s)
    atexit.register(_shutdown)
    return w


def _shutdown() -> None:
    """Tear down in order at exit: the group, then the store it rendezvoused through."""
    global _STORE
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # exiting anyway; a broken group must not turn into a crash
        pass
    _STORE = None


def _open_store(w: World, ip: str, wait: float) -> tuple[Any, str, int]:
    from torch.distributed import TCPStore

    addr = _master_addr(w, ip)
    if w.size == 1:
        store, port = _listen_store(addr, 1, wait)
        return store, addr, port
    comm = w.comm
    if w.rank == 0:
        try:
            store, port = _listen_store(addr, w.size, wait)
        except Exception as exc:  # tell the others instead of leaving them in bcast
            comm.bcast(-1, root=0)
            raise RuntimeError(f"rank 0 could not open a rendezvous store on {addr}: {exc}")
        comm.bcast(port, root=0)
        return store, addr, port
    port = comm.bcast(None, root=0)
    if port < 0:
        raise RuntimeError("rank 0 could not open the rendezvous store; see rank 0's error")
    store = TCPStore(addr, port, w.size, False, timeout=timedelta(seconds=wait))
    return store, addr, port


def _listen_store(addr: str, size: int, wait: float) -> tuple[Any, int]:
    """A master TCPStore listening on ``addr`` only (TCPStore alone binds every interface):
    we bind the socket ourselves on a free port and hand TCPStore its descriptor."""
    from torch.distributed import TCPStore

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
    import torch.distributed as dist

    prefix = dist.PrefixStore(f"hvdnb/{_GENERATION}", _STORE)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        import torch

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
    import torch.distributed as dist

    from .config import get_config

    w = discover()
    if _STORE is None:
        raise RuntimeError("reinit_process_group needs a group made by init_process_group")
    old_backend = None
    if dist.is_initialized():
        old_backend = dist.get_backend()
        dist.destroy_process_group()
    _GENERATION = generation
    _init_from_store(backend or old_backend or default_backend(), w, get_config().collective_timeout)


def generation() -> int:
    """How many times the default group has been rebuilt (0 for the first)."""
    return _GENERATION
