"""Runs hvdnb.torch's collectives on TensorFlow tensors, eagerly and inside graphs.

Owns: the zero-copy views between numpy arrays and CPU torch tensors (dtypes torch lacks
travel as same-width integers where no arithmetic is done), ``call`` (run a numpy-level
collective on tf tensors: directly in eager mode, as one stateful ``tf.numpy_function`` in
a ``tf.function`` or a v1 graph) and the translation of hvdnb.torch's errors into
TensorFlow's (a mismatch across ranks is ``tf.errors.FailedPreconditionError``, a bad
argument ``tf.errors.InvalidArgumentError``, as Horovod's ops raise them).

Why on hvdnb.torch: the negotiation (every rank compares every call's header and raises
the same error, the group stays usable), the MPI transport and the panel's timing are
already there; a TF tensor on the CPU is a numpy view away from a torch tensor.
Measured against TensorFlow's own collectives in ``bench/bench_tf.py``.

Why a stateful ``numpy_function``: ``tf.function`` runs stateful ops in program order
(automatic control dependencies), so every rank issues its collectives in the order its
code wrote them, which the SPMD contract needs. Never: issue a collective outside that
order, or keep a reference to a tensor's buffer past the call.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import torch
from tensorflow.python.eager.context import context as _context

from hvdnb.torch.rounds import CollectiveMismatchError

__all__ = ["call", "could_record", "from_torch", "raw_view", "to_torch", "translate"]

try:  # TensorFlow's own test of "is any tape or forward accumulator active" (0.1 us)
    from tensorflow.python.eager.record import could_possibly_record as _could_record
except ImportError:  # pragma: no cover  another TensorFlow layout: always assume a tape

    def _could_record() -> bool:
        return True


try:  # the eager tensor type, built over a numpy array without TensorFlow's defensive copy
    from tensorflow.python.framework.ops import EagerTensor as _EagerTensor
except ImportError:  # pragma: no cover
    _EagerTensor = None


def could_record() -> bool:
    """True when a ``tf.GradientTape`` (or forward accumulator) could record an op now."""
    return bool(_could_record())


def _eager_result(a: np.ndarray, dtype: tf.DType) -> tf.Tensor:
    """An eager CPU tensor over ``a``, a result array nothing else holds.

    ``tf.convert_to_tensor`` copies every numpy array first (the caller might change it
    later) and costs ~18 us for 4 KB; a collective's fresh result has no other owner, so
    the tensor takes it as it is (TensorFlow copies only a misaligned buffer).
    """
    if _EagerTensor is None or a.dtype != dtype.as_numpy_dtype:
        return tf.convert_to_tensor(a, dtype=dtype)
    ctx = _context()
    ctx.ensure_initialized()
    return _EagerTensor(a, ctx.device_name, dtype.as_datatype_enum)


#: the last collective built in each v1 graph (see ``call``)
_LAST: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

#: numpy dtypes torch has no tensor type for, moved as same-width integers (no arithmetic)
_RAW = {np.dtype(np.uint16): np.int16, np.dtype(np.uint32): np.int32, np.dtype(np.uint64): np.int64}


def to_torch(a: np.ndarray) -> torch.Tensor:
    """A CPU torch tensor over ``a``'s memory (copied only when not contiguous/writable)."""
    if not (a.flags.c_contiguous and a.flags.writeable):
        a = np.array(a, order="C")
    if a.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: torch reads its bits
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def from_torch(t: torch.Tensor, like: np.dtype | None = None) -> np.ndarray:
    """The numpy view of a CPU torch tensor (``like``: the dtype a raw view came from)."""
    if t.dtype == torch.bfloat16:
        out: np.ndarray = t.view(torch.int16).numpy().view(tf.bfloat16.as_numpy_dtype)
    else:
        out = t.numpy()
    return out if like is None or out.dtype == like else out.view(like)


def raw_view(a: np.ndarray) -> np.ndarray:
    """``a`` as a dtype torch knows, bit for bit (bool as uint8, uint16 as int16, ...);
    only for collectives that move bytes (allgather, broadcast, alltoall)."""
    if a.dtype == np.bool_:
        return a.view(np.uint8)
    raw = _RAW.get(a.dtype)
    return a if raw is None else a.view(raw)


def translate(exc: BaseException) -> BaseException:
    """The TensorFlow error Horovod's op would raise for ``exc`` (or ``exc`` itself)."""
    if isinstance(exc, CollectiveMismatchError):
        mismatch: BaseException = tf.errors.FailedPreconditionError(None, None, str(exc))
        return mismatch
    if isinstance(exc, (ValueError, TypeError)):
        bad: BaseException = tf.errors.InvalidArgumentError(
            None, None, f"{type(exc).__name__}: {exc}"
        )
        return bad
    return exc


def call(
    fn: Callable[..., Sequence[np.ndarray]],
    inputs: Sequence[Any],
    touts: Sequence[tf.DType],
    shapes: Sequence[Any] | None = None,
) -> list[tf.Tensor]:
    """Run ``fn`` (numpy arrays in, a list of arrays out) on tf tensors.

    Eager: now, on this thread, errors translated (``translate``). In a graph: one stateful
    ``tf.numpy_function`` whose outputs get ``shapes`` (None entries: unknown); there an
    error reaches the caller as TensorFlow wraps a Python exception (its message kept).
    """
    if tf.executing_eagerly():
        arrays = [x.numpy() for x in inputs]
        try:
            outs = fn(*arrays)
        except Exception as exc:
            err = translate(exc)
            if err is exc:
                raise
            raise err from exc
        dev = getattr(inputs[0], "device", "") if inputs else ""
        if not dev or "CPU" in dev:
            return [_eager_result(o, d) for o, d in zip(outs, touts)]
        with tf.device(dev):  # a GPU input's result goes back to its device
            return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outs, touts)]

    def run(*arrays: np.ndarray) -> list[np.ndarray]:
        return [np.asarray(o) for o in fn(*arrays)]

    g = tf.compat.v1.get_default_graph()
    # a v1 graph has no automatic control dependencies: chain the collectives in the order
    # they were built, or a session may run them in a different order on each rank
    chain = None if getattr(g, "building_function", False) else _LAST.get(g)
    with tf.control_dependencies([chain] if chain is not None else []):
        outs = tf.numpy_function(run, list(inputs), list(touts), stateful=True)
    if not getattr(g, "building_function", False):
        first = outs[0] if isinstance(outs, (list, tuple)) and outs else outs
        _LAST[g] = getattr(first, "op", None)
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    for o, s in zip(outs, shapes or [None] * len(outs)):
        if s is not None:
            o.set_shape(s)
    return list(outs)
