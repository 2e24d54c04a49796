"""Starting and querying hvdnb.tensorflow: Horovod's basics, shared with hvdnb.torch.

Owns: the TensorFlow forms of the queries (``rank_op``, ``size_op``, ... as tensors) and
``_executing_eagerly``. ``init``, ``rank``, ``size`` and friends are hvdnb.torch's own
functions: one job, one set of transports, whichever API a cell imports. Never: start a
process group of its own, or touch TensorFlow's devices.
"""

from __future__ import annotations

import tensorflow as tf

from hvdnb.torch.basics import (
    ccl_built,
    cross_rank,
    cross_size,
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
from hvdnb.torch.process_sets import STATE

__all__ = [
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "executing_eagerly",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_rank_op",
    "local_size",
    "local_size_op",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "process_set_included_op",
    "rank",
    "rank_op",
    "rocm_built",
    "shutdown",
    "size",
    "size_op",
]


def executing_eagerly() -> bool:
    """Whether TensorFlow runs ops now (eager) rather than building a graph."""
    return bool(tf.executing_eagerly())


def cuda_built() -> bool:
    """Whether this TensorFlow was built with CUDA (Horovod TF's meaning)."""
    return bool(tf.test.is_built_with_cuda())


def _set_size(process_set_id: int) -> int:
    ps = STATE.sets.get(process_set_id)
    if ps is None:
        raise ValueError(f"no process set with id {process_set_id}; known: {sorted(STATE.sets)}")
    return ps.size()


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The size of a process set as an int32 tensor (the whole job: id 0)."""
    return tf.constant(_set_size(process_set_id), dtype=tf.int32, name=name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """``local_size()`` as an int32 tensor."""
    return tf.constant(local_size(), dtype=tf.int32, name=name)


def rank_op(name: str | None = None) -> tf.Tensor:
    """``rank()`` as an int32 tensor."""
    return tf.constant(rank(), dtype=tf.int32, name=name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """``local_rank()`` as an int32 tensor."""
    return tf.constant(local_rank(), dtype=tf.int32, name=name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 when this rank belongs to the process set, else 0 (an int32 tensor)."""
    ps = STATE.sets.get(process_set_id)
    inc = 0 if ps is None else int(ps.included())
    return tf.constant(inc, dtype=tf.int32, name=name)
