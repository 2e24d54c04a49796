"""Horovod's TensorFlow 2 API on hvdnb's runtime: ``import hvdnb.tensorflow as hvd``.

The same names and behaviour as ``horovod.tensorflow``, on tf tensors, in eager mode and
inside ``tf.function``: ``init``, ``rank``, ``size``, the collectives (``allreduce``,
``grouped_allreduce``, ``allgather``, ``broadcast``, ``alltoall``, ``reducescatter``),
``broadcast_variables``, ``broadcast_object``, ``DistributedGradientTape``,
``Compression``, ``elastic`` (Horovod's elastic API) and the ops ``Average``, ``Sum``,
``Min``, ``Max``, ``Product``, ``Adasum``. Keras: ``hvdnb.tensorflow.keras``.

Owns: the public names (explicit ``__all__``) and the check that TensorFlow is installed
(a missing one names its install command). The modules own the behaviour: ``basics``
(shared with hvdnb.torch: one job, one set of transports), ``bridge`` (tf tensors through
hvdnb.torch's negotiated collectives), ``ops``, ``functions``, ``tape``, ``compression``.
Never: do work at import time (no MPI init, no process group).
"""

from __future__ import annotations

from typing import Any

from hvdnb import extras

extras.require("tensorflow", "hvdnb.tensorflow")

from hvdnb.rank.elastic import HorovodInternalError, HostsUpdatedInterrupt  # noqa: E402
from hvdnb.tensorflow import elastic, util  # noqa: E402
from hvdnb.tensorflow.basics import (  # noqa: E402
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
    local_rank_op,
    local_size,
    local_size_op,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    process_set_included_op,
    rank,
    rank_op,
    rocm_built,
    shutdown,
    size,
    size_op,
)
from hvdnb.tensorflow.basics import executing_eagerly as _executing_eagerly  # noqa: E402
from hvdnb.tensorflow.compression import Compression  # noqa: E402
from hvdnb.tensorflow.functions import (  # noqa: E402
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from hvdnb.tensorflow.ops import (  # noqa: E402
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    reducescatter,
)
from hvdnb.tensorflow.tape import (  # noqa: E402
    DistributedGradientTape,
    PartialDistributedGradientTape,
)
from hvdnb.torch.process_sets import (  # noqa: E402
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)

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
    "size_op",
    "local_size_op",
    "rank_op",
    "local_rank_op",
    "process_set_included_op",
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
    "util",
    "_executing_eagerly",
    # ops
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "grouped_allgather",
    "broadcast",
    "broadcast_",
    "alltoall",
    "reducescatter",
    "grouped_reducescatter",
    "join",
    "barrier",
    # helpers
    "broadcast_variables",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "allgather_object",
    "DistributedGradientTape",
    "PartialDistributedGradientTape",
    "SyncBatchNormalization",
    "Compression",
    "elastic",
    # process sets
    "ProcessSet",
    "add_process_set",
    "remove_process_set",
    "global_process_set",
]


def __getattr__(name: str) -> Any:
    """``SyncBatchNormalization`` on first use: it subclasses ``tf.keras``'s layer, and
    importing Keras is slow and depends on ``TF_USE_LEGACY_KERAS`` set before it."""
    if name == "SyncBatchNormalization":
        # tf.keras is heavy and Keras-version dependent: imported when first asked for
        from hvdnb.tensorflow.sync_batch_norm import SyncBatchNormalization  # noqa: PLC0415

        globals()[name] = SyncBatchNormalization
        return SyncBatchNormalization
    raise AttributeError(f"module 'hvdnb.tensorflow' has no attribute {name!r}")
