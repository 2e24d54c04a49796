"""Horovod's TensorFlow collectives on tf tensors, eager and in ``tf.function``.

Owns: ``allreduce`` (dense and ``tf.IndexedSlices``), ``grouped_allreduce`` (one call,
fused per dtype), ``allgather``, ``grouped_allgather``, ``broadcast``, ``broadcast_``,
``alltoall``, ``reducescatter``, ``grouped_reducescatter``, ``join``, ``barrier`` and
their gradients (Horovod's: an allreduce's gradient is the same allreduce of the incoming
gradient; allgather and broadcast average it; alltoall sends it back; reducescatter
gathers it). The data moves through hvdnb.torch (``bridge.call``): every call is
negotiated, so ranks that disagree raise ``tf.errors.FailedPreconditionError`` on every
rank and the next call works. Never: name a call at trace time (auto names are taken
when the call runs, so a rank that traced a function twice stays in step), or fuse
Adasum (its combination is per tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

import hvdnb.torch as ht
from hvdnb.tensorflow.bridge import call, could_record, from_torch, raw_view, to_torch
from hvdnb.tensorflow.compression import Compression
from hvdnb.torch.ops import resolve_op
from hvdnb.torch.process_sets import ProcessSet, global_process_set
from hvdnb.torch.reduce import allreduce_launch
from hvdnb.torch.spec import Adasum, Average, Max, Min, Product, Sum

__all__ = [
    "Adasum",
    "Average",
    "Max",
    "Min",
    "Product",
    "Sum",
    "allgather",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "join",
    "reducescatter",
]


def _float(x: tf.Tensor) -> bool:
    return bool(x.dtype.is_floating or x.dtype.is_complex)


def _tensor(x: Any) -> tf.Tensor:
    # a variable is read here, outside custom_gradient (which refuses captured variables)
    return x if isinstance(x, tf.Tensor) else tf.convert_to_tensor(x)


def _differentiable(
    forward: Callable[..., Any], backward: Callable[..., Any], *xs: tf.Tensor
) -> Any:
    """``forward(*xs)`` with ``backward(*dys)`` as its gradient (integers: no gradient).

    Eagerly, with no tape or forward accumulator that could record the call, there is no
    gradient to attach: ``forward`` runs bare (``tf.custom_gradient`` costs ~0.1-0.3 ms a
    call, more than the collective; ``bench/bench_tf.py``). In a graph it is always
    attached: a tape outside the ``tf.function`` may differentiate it later.
    """
    if not any(_float(x) for x in xs) or (tf.executing_eagerly() and not could_record()):
        return forward(*xs)

    @tf.custom_gradient  # type: ignore[untyped-decorator]  # TensorFlow: unannotated
    def f(*ts: tf.Tensor) -> Any:
        return forward(*ts), backward

    return f(*xs)


# -- allreduce -------------------------------------------------------------------------------
#: a named call site's buffer (name, dtype, shape, op, scales, process set -> torch tensor and
#: its numpy view): small arrays are copied in and reduced there in place, so hvdnb.torch's
#: plan for the site (keyed by the buffer's address) is built once. A TensorFlow input has no
#: stable address: ``.numpy()`` and ``numpy_function`` hand over a new copy each call, and a
#: plan per call cost 40-90 us of a 100 us call (``bench/bench_tf.py``).
_STAGING: dict[tuple[Any, ...], tuple[Any, np.ndarray]] = {}
_STAGE_MAX = 64 << 10  # bytes: larger arrays go through the general path as they are
_STAGE_SITES = 256  # call sites kept (cleared when full, as hvdnb.torch's plans are)


def _staged_allreduce(
    a: np.ndarray, name: str, op: int, pre: float, post: float, ps: ProcessSet
) -> np.ndarray:
    """Allreduce ``a`` through its call site's buffer; a new array holds the result."""
    key = (name, a.dtype, a.shape, op, pre, post, ps)
    got = _STAGING.pop(key, None)  # taken while in use: a concurrent same-site call makes its own
    if got is None:
        view = np.empty_like(a, order="C")
        got = (to_torch(view), view)
    t, view = got
    np.copyto(view, a)
    ht.allreduce_(t, name=name, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps)
    out: np.ndarray = view.copy()
    if len(_STAGING) >= _STAGE_SITES:
        _STAGING.clear()
    _STAGING[key] = got
    return out


def _reduce_arrays(
    arrays: Sequence[np.ndarray], name: str | None, op: int, pre: float, post: float, ps: ProcessSet
) -> list[np.ndarray]:
    """Allreduce numpy arrays through hvdnb.torch; arrays of one dtype travel as one buffer
    (checked against every rank's list of shapes), except for Adasum."""
    out: list[np.ndarray | None] = [None] * len(arrays)
    groups: dict[np.dtype, list[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault(a.dtype, []).append(i)
    for dt, idx in groups.items():
        gname = name if name is None or len(groups) == 1 else f"{name}.{dt.name}"
        if len(idx) == 1 or op == Adasum:
            for i in idx:
                nm = gname if gname is None or len(idx) == 1 else f"{gname}.{i}"
                a = arrays[i]
                if nm is not None and op != Adasum and 0 < a.nbytes <= _STAGE_MAX:
                    out[i] = _staged_allreduce(a, nm, op, pre, post, ps)
                    continue
                r = ht.allreduce(
                    to_torch(arrays[i]),
                    name=nm,
                    op=op,
                    prescale_factor=pre,
                    postscale_factor=post,
                    process_set=ps,
                )
                out[i] = from_torch(r)
            continue
        shapes = tuple(arrays[i].shape for i in idx)
        flat = np.concatenate([arrays[i].reshape(-1) for i in idx])
        ft = to_torch(flat)
        allreduce_launch(ft, True, gname, op, pre, post, ps, shape_key=hash(shapes)).wait()
        res, pos = from_torch(ft), 0
        for i, s in zip(idx, shapes):
            n = int(np.prod(s))
            out[i] = res[pos : pos + n].reshape(s)
            pos += n
    return [o for o in out if o is not None]


def _allreduce_dense(
    xs: list[tf.Tensor], name: str | None, op: int, pre: float, post: float, ps: ProcessSet
) -> list[tf.Tensor]:
    def fwd(*ts: tf.Tensor) -> list[tf.Tensor]:
        return call(
            lambda *a: _reduce_arrays(a, name, op, pre, post, ps),
            ts,
            [t.dtype for t in ts],
            [t.shape for t in ts],
        )

    def bwd(*dys: tf.Tensor) -> Any:
        g = _allreduce_dense([tf.convert_to_tensor(d) for d in dys], None, op, pre, post, ps)
        return g if len(g) > 1 else g[0]

    if not xs:
        return []
    out = _differentiable(fwd, bwd, *xs)
    return list(out)


def _allreduce_sparse(
    s: tf.IndexedSlices, name: str | None, op: int, pre: float, post: float, ps: ProcessSet
) -> tf.IndexedSlices:
    if op not in (Average, Sum):
        raise NotImplementedError(
            "allreduce of tf.IndexedSlices supports op=hvd.Average or hvd.Sum only; "
            "pass a dense tensor (tf.convert_to_tensor) for other ops"
        )
    if pre != 1.0 or post != 1.0:
        raise NotImplementedError(
            "allreduce of tf.IndexedSlices does not take prescale/postscale factors; "
            "scale the values yourself or pass a dense tensor"
        )
    values = allgather(s.values, name=None if name is None else f"{name}.values", process_set=ps)
    indices = allgather(s.indices, name=None if name is None else f"{name}.indices", process_set=ps)
    if op == Average:
        values = values / tf.cast(ps.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=s.dense_shape)


def allreduce(
    tensor: Any,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
) -> Any:
    """Reduce ``tensor`` over the ranks of ``process_set``; returns a new tensor.

    SPMD contract: every rank calls it with the same name, shape, dtype, op and scale
    factors, in the same order; it blocks until all ranks arrive. Ranks that disagree
    raise ``tf.errors.FailedPreconditionError`` on every rank. Differentiable (the
    gradient is the same allreduce of the incoming gradient).

    Parameters
    ----------
    tensor : tf.Tensor, tf.Variable or tf.IndexedSlices (gathered; Average and Sum only)
    average : deprecated (Horovod's): True means ``op=Average``, False ``op=Sum``
    device_dense, device_sparse : accepted for Horovod compatibility (data moves on the host)
    compression : ``Compression.none`` or ``Compression.fp16``
    op : ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``
        (power-of-two process sets); Average on integers truncates, as Horovod's does
    prescale_factor, postscale_factor : multiply before / after the reduction
    name : matches the call across ranks (numbered automatically when None)
    process_set : the ranks taking part (default: all)
    ignore_name_scope : accepted for Horovod compatibility

    Returns
    -------
    tf.Tensor (tf.IndexedSlices for IndexedSlices input), same shape and dtype
    """
    rop = resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, name, rop, prescale_factor, postscale_factor, process_set)
    x = _tensor(tensor)
    comp, ctx = compression.compress(x)
    out = _allreduce_dense([comp], name, rop, prescale_factor, postscale_factor, process_set)[0]
    return compression.decompress(out, ctx)


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    name: str | None = None,
) -> list[Any]:
    """Allreduce a list of tensors as one call: the dense ones of each dtype travel in one
    buffer. Same SPMD contract as ``allreduce``, for the whole list (count, order, shapes,
    dtypes). Differentiable; ``tf.IndexedSlices`` members are gathered as in ``allreduce``.
    """
    rop = resolve_op(op, average)
    tensors = list(tensors)
    if any(isinstance(t, tf.IndexedSlices) for t in tensors) and rop not in (Average, Sum):
        raise NotImplementedError(
            "grouped_allreduce with tf.IndexedSlices supports op=hvd.Average or hvd.Sum only"
        )
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    packed = [compression.compress(_tensor(tensors[i])) for i in dense]
    reduced = _allreduce_dense(
        [c for c, _ in packed], name, rop, prescale_factor, postscale_factor, process_set
    )
    out: list[Any] = list(tensors)
    for i, r, (_, ctx) in zip(dense, reduced, packed):
        out[i] = compression.decompress(r, ctx)
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            nm = None if name is None else f"{name}.sparse.{i}"
            out[i] = _allreduce_sparse(t, nm, rop, prescale_factor, postscale_factor, process_set)
    return out


# -- allgather -------------------------------------------------------------------------------
def _gather_arrays(a: np.ndarray, name: str | None, ps: ProcessSet) -> list[np.ndarray]:
    raw = raw_view(a)
    r = ht.allgather(to_torch(raw), name=name, process_set=ps)
    return [from_torch(r, a.dtype)]


def _allgather(x: tf.Tensor, name: str | None, ps: ProcessSet) -> tf.Tensor:
    shape = [None, *x.shape[1:]] if x.shape.rank else [None]
    return call(lambda a: _gather_arrays(a, name, ps), [x], [x.dtype], [shape])[0]


def allgather(
    tensor: Any,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order.

    SPMD contract: same name, dtype and trailing shape on every rank (the first dimension
    may differ); blocks until all ranks arrive. Differentiable: each rank's slice of the
    averaged incoming gradient.
    """
    x = _tensor(tensor)

    def bwd(dy: tf.Tensor) -> tf.Tensor:
        g = _allreduce_dense([tf.convert_to_tensor(dy)], None, Average, 1.0, 1.0, process_set)[0]
        dim0 = tf.reshape(tf.shape(x, out_type=tf.int64)[0] if x.shape.rank else 1, [1])
        dims = _allgather(tf.cast(dim0, tf.int64), None, process_set)
        me = process_set.rank()
        start = tf.reduce_sum(dims[:me])
        return g[start : start + dims[me]]

    return _differentiable(lambda t: _allgather(t, name, process_set), bwd, x)


def grouped_allgather(
    tensors: Sequence[Any],
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor]:
    """``allgather`` of each tensor of a list. Same SPMD contract, for the whole list."""
    return [
        allgather(t, None if name is None else f"{name}.{i}", process_set=process_set)
        for i, t in enumerate(tensors)
    ]


# -- broadcast -------------------------------------------------------------------------------
def _bcast_arrays(a: np.ndarray, root: int, name: str | None, ps: ProcessSet) -> list[np.ndarray]:
    r = ht.broadcast(to_torch(raw_view(a)), root, name=name, process_set=ps)
    return [from_torch(r, a.dtype)]


def _broadcast(x: tf.Tensor, root: int, name: str | None, ps: ProcessSet) -> tf.Tensor:
    return call(lambda a: _bcast_arrays(a, root, name, ps), [x], [x.dtype], [x.shape])[0]


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank.

    SPMD contract: same name, shape, dtype and ``root_rank`` (a global rank, a member of
    ``process_set``) on every rank; blocks until all ranks arrive. Differentiable: root
    gets the averaged incoming gradient, the other ranks zeros.
    """
    x = _tensor(tensor)

    def bwd(dy: tf.Tensor) -> tf.Tensor:
        g = _allreduce_dense([tf.convert_to_tensor(dy)], None, Average, 1.0, 1.0, process_set)[0]
        return g if ht.rank() == root_rank else g * 0

    return _differentiable(lambda t: _broadcast(t, root_rank, name, process_set), bwd, x)


def broadcast_(
    variables: Any,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Overwrite each variable with ``root_rank``'s value, in place; returns what each
    assignment returns (eager: the variables; in a v1 graph: the assignments, which do the
    broadcast when run, as Horovod's ``broadcast_`` returns them).

    SPMD contract: the same variables (count, order, shapes, dtypes) on every rank.
    """
    single = not isinstance(variables, (list, tuple))
    vs = [variables] if single else list(variables)
    out = []
    for i, v in enumerate(vs):
        nm = None if name is None else (name if single else f"{name}.{i}")
        out.append(v.assign(_broadcast(_tensor(v), root_rank, nm, process_set)))
    return out[0] if single else out


# -- alltoall --------------------------------------------------------------------------------
def _a2a_arrays(
    a: np.ndarray, splits: np.ndarray | None, name: str | None, ps: ProcessSet
) -> list[np.ndarray]:
    x = to_torch(raw_view(a))
    if splits is None:
        n = ps.size()
        # the received splits are needed for the gradient: ask for them with equal splits
        # (an indivisible first dimension goes through as None: hvdnb.torch names the fix)
        sp: Any = [x.shape[0] // n] * n if x.dim() and x.shape[0] % n == 0 else None
    else:
        sp = [int(v) for v in np.asarray(splits).reshape(-1)]
    r = ht.alltoall(x, sp, name=name, process_set=ps)
    out, rs = (r, None) if sp is None else r
    recv = np.zeros(0, np.int32) if rs is None else rs.numpy().astype(np.int32)
    return [from_torch(out, a.dtype), recv]


def _alltoall(
    x: tf.Tensor, splits: tf.Tensor | None, name: str | None, ps: ProcessSet
) -> tuple[tf.Tensor, tf.Tensor]:
    shape = [None, *x.shape[1:]] if x.shape.rank else None
    if splits is None:
        outs = call(
            lambda a: _a2a_arrays(a, None, name, ps), [x], [x.dtype, tf.int32], [shape, [None]]
        )
    else:
        outs = call(
            lambda a, s: _a2a_arrays(a, s, name, ps),
            [x, splits],
            [x.dtype, tf.int32],
            [shape, [None]],
        )
    return outs[0], outs[1]


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` (dimension 0) to rank i, gather what they send.

    SPMD contract: same name, dtype and trailing shape on every rank; without ``splits``
    dimension 0 is split equally. Returns the received tensor, and with ``splits`` also
    the received splits (int32), as Horovod does. Differentiable in ``tensor``.
    """
    x = _tensor(tensor)
    sp = None if splits is None else tf.cast(_tensor(splits), tf.int32)
    rs_box: list[tf.Tensor] = []

    def fwd(t: tf.Tensor) -> tf.Tensor:
        out, rs = _alltoall(t, sp, name, process_set)
        rs_box.append(rs)
        return out

    def bwd(dy: tf.Tensor) -> tf.Tensor:
        g, _ = _alltoall(tf.convert_to_tensor(dy), rs_box[0], None, process_set)
        return g

    out = _differentiable(fwd, bwd, x)
    return out if splits is None else (out, rs_box[0])


# -- reducescatter ---------------------------------------------------------------------------
def _rs_arrays(
    a: np.ndarray, name: str | None, op: int, pre: float, post: float, ps: ProcessSet
) -> list[np.ndarray]:
    r = ht.reducescatter(
        to_torch(a), name=name, op=op, process_set=ps, prescale_factor=pre, postscale_factor=post
    )
    return [from_torch(r)]


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: Any = Compression.none,
    op: int = Average,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reduce ``tensor`` over the ranks and return this rank's rows of dimension 0.

    SPMD contract: as ``allreduce``. Rank i gets rows ``[start_i, start_i + rows_i)``, the
    first ``dim0 % size`` ranks one row more. Average (default) or Sum. Differentiable.
    """
    x, ctx = compression.compress(_tensor(tensor))
    if op not in (Average, Sum):
        raise NotImplementedError("reducescatter supports op=hvd.Average or hvd.Sum")
    shape = [None, *x.shape[1:]] if x.shape.rank else None

    def fwd(t: tf.Tensor) -> tf.Tensor:
        def fn(a: np.ndarray) -> list[np.ndarray]:
            return _rs_arrays(a, name, op, prescale_factor, postscale_factor, process_set)

        return call(fn, [t], [t.dtype], [shape])[0]

    def bwd(dy: tf.Tensor) -> tf.Tensor:
        scale = prescale_factor * postscale_factor * (process_set.size() if op == Sum else 1)
        g = _allgather(tf.convert_to_tensor(dy), None, process_set)
        return g * tf.cast(scale, g.dtype) if scale != 1 else g

    return compression.decompress(_differentiable(fwd, bwd, x), ctx)


def grouped_reducescatter(
    tensors: Sequence[Any],
    device_dense: str = "",
    compression: Any = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
) -> list[tf.Tensor]:
    """``reducescatter`` of each tensor of a list. Same SPMD contract, for the whole list."""
    return [
        reducescatter(
            t,
            compression=compression,
            op=op,
            name=None if name is None else f"{name}.{i}",
            process_set=process_set,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
        )
        for i, t in enumerate(tensors)
    ]


# -- join / barrier --------------------------------------------------------------------------
def join(process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Wait until every rank has joined; returns the rank that joined last (int32).

    Until then this rank serves the others' allreduces with zeros, as Horovod does.
    """
    return call(
        lambda: [np.asarray(ht.join(process_set=process_set), np.int32)], [], [tf.int32], [[]]
    )[0]


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of the process set calls ``barrier``."""
    ht.barrier(process_set=process_set)
