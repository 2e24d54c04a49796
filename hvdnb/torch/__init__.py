"""Horovod's torch API on torch.distributed and mpi4py: ``import hvdnb.torch as hvd``.

Owns: the public names (explicit ``__all__``); the modules own the behaviour, each
importing only the ones below it (never this package): ``basics`` (init, rank, size),
``ops`` (the allreduce family), ``collectives`` (the other collectives), ``optimizer``
(with ``adasum_optimizer``: ``DistributedOptimizer(op=Adasum)``), ``functions``,
``compression``, ``sync_batch_norm``, ``schedule`` (lr scaling, warmup, LARS),
``timeline``; below them ``plans`` (planned fast allreduces over MPI), ``reduce`` (the
general allreduce), ``adasum`` (the combination), ``handles`` (async handles, poll, synchronize),
``spec`` (op and dtype codes, names, transport choice), ``process_sets``, ``rounds``
(negotiation, async queue, join), ``transport`` (headers, MPI and torch.distributed
transports), ``butterfly`` (the rounds of more than two ranks over MPI), ``timing`` (NCCL
and gloo timings) and ``listeners``. Never: do work at import
time (no process group, no MPI init).
"""

from __future__ import annotations

from hvdnb.torch import elastic
from hvdnb.torch.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from hvdnb.torch.collectives import (
    allgather,
    allgather_async,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
)
from hvdnb.torch.compression import Compression
from hvdnb.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from hvdnb.torch.listeners import add_comm_listener, remove_comm_listener
from hvdnb.torch.ops import (
    Adasum,
    Average,
    CollectiveMismatchError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    Product,
    Sum,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    poll,
    synchronize,
)
from hvdnb.torch.optimizer import DistributedOptimizer
from hvdnb.torch.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from hvdnb.torch.schedule import LARS, LinearWarmup, scale_lr, warmup_lr
from hvdnb.torch.sync_batch_norm import SyncBatchNorm
from hvdnb.torch.timeline import merge_timelines, start_timeline, stop_timeline

__all__ = [  # noqa: RUF022 (grouped by role, in the order of Horovod's API docs)
    # basics
    "init",
    "shutdown",
    "is_initialized",
    "size",
    "local_size",
    "cross_size",
    "rank",
    "local_rank",
    "cross_rank",
    "is_homogeneous",
    "mpi_enabled",
    "mpi_built",
    "gloo_enabled",
    "gloo_built",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "mpi_threads_supported",
    # ops
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "CollectiveMismatchError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "sparse_allreduce_async",
    "barrier",
    "join",
    "poll",
    "synchronize",
    # model helpers
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "broadcast_object",
    "allgather_object",
    "DistributedOptimizer",
    "Compression",
    "SyncBatchNorm",
    "elastic",
    # process sets
    "ProcessSet",
    "add_process_set",
    "remove_process_set",
    "global_process_set",
    # schedules
    "scale_lr",
    "warmup_lr",
    "LinearWarmup",
    "LARS",
    # observability
    "start_timeline",
    "stop_timeline",
    "merge_timelines",
    "add_comm_listener",
    "remove_comm_listener",
]
