"""Starting and querying hvdnb.torch: init, shutdown, rank and size (Horovod's basics).

Owns: ``init`` (reuses a default process group that hvdnb or the user already made,
otherwise makes one through ``hvdnb.rank.rendezvous``), the private MPI communicator, the
global process set, and the rank/size queries. Never: re-initialise an existing group,
pick a port, or start processes.
"""

from __future__ import annotations

import atexit
from collections.abc import Sequence
from typing import Any

import numpy as np

import hvdnb.torch.handles as handles
from hvdnb.config import get_config
from hvdnb.host import cores
from hvdnb.rank import elastic, rendezvous
from hvdnb.torch.process_sets import (
    STATE,
    ProcessSet,
    add_process_set,
    build_transports,
    global_process_set,
)

__all__ = [
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "rocm_built",
    "shutdown",
    "size",
]


def butterfly_bytes(configured: int, w: Any) -> int:
    """The butterfly's data limit (``Config.butterfly_bytes``; -1: by this host's load).

    Measured with ``bench_allreduce`` against mpi4py's ``Allreduce``: on 16 cores with a
    core per rank (4, 8 and 16 ranks) the butterfly is 0.8-1.0x MPI's time up to 4 KB and
    0.3-0.6x from 8 KB (its messages leave MPICH's eager path there, while MPI's own
    allreduce uses shared memory); on 2 cores shared by 4 ranks it is 1.05-1.6x up to 64
    KB, where MPI's collective waits on descheduled peers. Cores are ``host.cores()``, the
    ones this rank may use, as the rendezvous counts them for its threads.
    """
    if configured >= 0:
        return int(configured)
    local = max(1, int(getattr(w, "local_size", 1) or 1))
    return 64 * 1024 if local > cores() else 4 * 1024


#: ``gloo_bytes`` when it is -1: see ``gloo_bytes`` for the measurement
GLOO_BYTES = 32 * 1024 * 1024
#: ``gloo_bytes`` when it is 0 (never): larger than any tensor, so that MIN across ranks works
_NEVER = 1 << 62


def gloo_bytes(configured: int) -> int:
    """From what size a CPU allreduce of a set across hosts goes over gloo, not MPI
    (``Config.gloo_bytes``; -1: ``GLOO_BYTES``, 0: never).

    Measured with ``bench/bench_hosts.py --allreduce-only`` (2 namespace hosts x 2 ranks,
    veth link, ms per call, mpi4py's ``Allreduce`` / gloo's ``all_reduce``): 1.8 / 9.0 at
    1 MB, 15.5 / 20.5 at 8 MB, 34 / 41 at 16 MB, 141 / 78 at 32 MB, 292 / 187 at 64 MB:
    they cross between 16 and 32 MB. On one host MPI moves data through shared memory and
    is faster at every size, so a set within one host never takes gloo.
    """
    if configured < 0:
        return GLOO_BYTES
    return int(configured) if configured > 0 else _NEVER


def init(
    comm: Any = None, process_sets: Sequence[ProcessSet | Sequence[int]] | None = None
) -> None:
    """Join the job: discover rank and size, set up the transports. Collective.

    Under ``mpiexec`` hvdnb's own traffic goes over MPI (CPU tensors) and NCCL (CUDA
    tensors); under torchrun over torch.distributed (gloo / NCCL). If the default
    process group is already initialised (e.g. by hvdnb on ipyparallel engines), it is
    reused, never re-initialised. Calling ``init`` again is a no-op.

    Parameters
    ----------
    comm : Horovod's MPI communicator argument: None (the whole job) or a communicator
        spanning the whole job; a sub-communicator is refused (use process sets)
    process_sets : process sets to register right away (same on every rank)
    """
    if STATE.initialized:
        return
    if comm is not None:
        from mpi4py import MPI  # noqa: PLC0415  mpi4py initialises MPI on import: only where MPI is used

        n = len(comm) if isinstance(comm, (list, tuple)) else comm.Get_size()
        if n != MPI.COMM_WORLD.Get_size():
            raise NotImplementedError(
                "hvd.init(comm=...) with part of the job is not supported; run the job on "
                "those ranks only, or use hvd.add_process_set(ranks)"
            )
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

    w = rendezvous.discover()
    if not dist.is_initialized():
        rendezvous.init_process_group()
    cfg = get_config()
    STATE.world = w
    STATE.inline_bytes = max(0, int(cfg.inline_bytes))
    STATE.butterfly_bytes = min(STATE.inline_bytes, butterfly_bytes(cfg.butterfly_bytes, w))
    STATE.gloo_bytes, STATE.hosts = 0, []
    if w.source == "mpi":
        STATE.comm = w.comm.Dup()
        # one value on every rank: ranks that picked different limits (hosts with other
        # core counts, or other HVDNB_* settings) would take different paths for one call
        # (a wasted fallback round each time) or overrun a peer's receive buffer
        from mpi4py import MPI  # noqa: PLC0415  mpi4py initialises MPI on import: only where MPI is used

        limits = np.array(
            [STATE.inline_bytes, STATE.butterfly_bytes, gloo_bytes(cfg.gloo_bytes)], np.int64
        )
        STATE.comm.Allreduce(MPI.IN_PLACE, limits, op=MPI.MIN)
        STATE.inline_bytes, STATE.butterfly_bytes = int(limits[0]), int(limits[1])
        STATE.gloo_bytes = int(limits[2]) if int(limits[2]) < _NEVER else 0
        STATE.hosts = list(STATE.comm.allgather(w.hostname))
    if dist.get_backend() == "nccl" and STATE.comm is None:
        # headers must not queue behind NCCL kernels, and gloo can read them on the CPU
        STATE.ctrl = dist.new_group(backend="gloo")
    build_transports(global_process_set, list(range(w.size)))
    global_process_set.process_set_id = 0
    STATE.sets = {0: global_process_set}
    STATE.initialized = True
    # drop our references to the process groups before rendezvous destroys them at exit
    # (atexit is LIFO): a group that outlives destroy dies during interpreter teardown,
    # where gloo's threads abort the process ("terminate called without an active exception")
    atexit.register(shutdown)
    # an elastic cluster's next generation: the transports let the old group go, then new
    elastic.after_reset(_renew, before=_forget)
    for ps in process_sets or ():
        add_process_set(ps)


def shutdown() -> None:
    """Forget the transports (the default process group stays: it may not be ours)."""
    if not STATE.initialized:
        return
    handles.clear()
    for ps in STATE.sets.values():
        for tr in (ps.mpi, ps.torch):
            if tr is not None:
                tr.pending.clear()
    for ps in list(STATE.sets.values()):
        if ps.mpi is not None:
            ps.mpi.free()
        ps.mpi = ps.torch = None
        if ps is not global_process_set:
            ps.process_set_id = None
    if STATE.comm is not None:
        STATE.comm.Free()
    STATE.comm = STATE.ctrl = None
    STATE.sets = {}
    STATE.plans.clear()
    STATE.initialized = False


_WAS = {"initialized": False}


def _forget() -> None:
    """The default group is about to be released (an elastic cluster lost a rank): drop
    every reference to it, so its connections close and blocked peers are released."""
    _WAS["initialized"] = STATE.initialized
    shutdown()


def _renew() -> None:
    """The default group was re-formed (an elastic cluster's next generation): set the
    transports up again over it, if hvdnb.torch was in use."""
    if STATE.initialized:
        shutdown()
        init()
    elif _WAS["initialized"]:
        _WAS["initialized"] = False
        init()


def is_initialized() -> bool:
    """Whether ``init`` has run (and ``shutdown`` has not)."""
    return STATE.initialized


def _w() -> rendezvous.World:
    if not STATE.initialized:
        raise ValueError("hvdnb.torch is not initialised: call hvd.init() first")
    w: rendezvous.World = STATE.world
    return w


def size() -> int:
    """Number of ranks in the job."""
    return _w().size


def local_size() -> int:
    """Number of ranks on this host."""
    return _w().local_size


def cross_size() -> int:
    """Number of hosts (ranks with the same local rank)."""
    return _w().cross_size


def rank() -> int:
    """This process's rank in the job, 0..size()-1."""
    return _w().rank


def local_rank() -> int:
    """This process's rank on its host (use it to pick a GPU)."""
    return _w().local_rank


def cross_rank() -> int:
    """This host's index among the hosts."""
    return _w().cross_rank


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    w = _w()
    return bool(w.local_size * w.cross_size == w.size)


def mpi_enabled() -> bool:
    """Whether CPU collectives go over MPI (the job was started by mpiexec)."""
    return STATE.comm is not None


def mpi_built() -> bool:
    """Whether this process can use MPI (mpi4py and an MPI library import)."""
    try:
        from mpi4py import MPI  # noqa: PLC0415  mpi4py initialises MPI on import: only where MPI is used

        return bool(MPI.Get_version()[0] >= 1)
    except Exception:
        return False


def gloo_enabled() -> bool:
    """Whether CPU collectives go over torch.distributed's gloo (no mpiexec)."""
    if not STATE.initialized or STATE.comm is not None:
        return False
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

    return bool(dist.is_initialized() and dist.get_backend() == "gloo")


def gloo_built() -> bool:
    """Whether torch.distributed has gloo in this build of torch."""
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

    return bool(dist.is_available() and dist.is_gloo_available())


def nccl_built() -> int:
    """NCCL's version as Horovod reports it (e.g. 21803), or 0 without NCCL."""
    import torch  # noqa: PLC0415  torch is heavy: loaded when first used
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    try:  # torch.cuda.nccl.version is unannotated
        v = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
    except Exception:
        return 0
    if isinstance(v, tuple):
        return int(v[0]) * 10000 + int(v[1]) * 100 + int(v[2])
    return int(v)


def ddl_built() -> bool:
    """IBM DDL: never (hvdnb has no DDL transport)."""
    return False


def ccl_built() -> bool:
    """Intel oneCCL: never (hvdnb has no oneCCL transport)."""
    return False


def cuda_built() -> bool:
    """Whether this torch was built with CUDA."""
    import torch  # noqa: PLC0415  torch is heavy: loaded when first used

    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Whether this torch was built with ROCm."""
    import torch  # noqa: PLC0415  torch is heavy: loaded when first used

    return getattr(torch.version, "hip", None) is not None


def mpi_threads_supported() -> bool:
    """Whether MPI was initialised with MPI_THREAD_MULTIPLE (False without MPI)."""
    _w()
    if STATE.comm is None:
        return False
    from mpi4py import MPI  # noqa: PLC0415  mpi4py initialises MPI on import: only where MPI is used

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)
