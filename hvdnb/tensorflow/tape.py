"""Gradient averaging for TensorFlow: ``DistributedGradientTape`` and the function that
Horovod's optimizers share to allreduce a list of gradients.

Owns: ``make_allreduce_grads_fn`` (sparse-as-dense, compression, predivide factor, local
variables left alone and scaled by 1/size, one fused call per dtype),
``DistributedGradientTape`` / ``PartialDistributedGradientTape`` (the user's tape with
``gradient`` allreducing what it returns) and ``local_layer_weights`` (the Partial
wrappers' ``local_layers``, shared with the Keras optimizer). Never: reduce a ``None``
gradient, or change the order of the gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import tensorflow as tf

from hvdnb.tensorflow.compression import Compression
from hvdnb.tensorflow.ops import Average, Sum, grouped_allreduce
from hvdnb.torch.process_sets import ProcessSet, global_process_set

__all__ = [
    "DistributedGradientTape",
    "PartialDistributedGradientTape",
    "local_layer_weights",
    "make_allreduce_grads_fn",
    "var_key",
]

GradsFn = Callable[[Sequence[Any], Sequence[Any]], list[Any]]


def var_key(v: Any) -> Any:
    """A hashable identity for a variable: TensorFlow's ``v.ref()``; a Keras 3 variable
    (a model built with ``keras`` 3 on TensorFlow) has no ``ref``: its id (the set that
    holds the key lives no longer than the tape or optimizer, which holds the variable)."""
    ref = getattr(v, "ref", None)
    return ref() if callable(ref) else ("id", id(v))


def make_allreduce_grads_fn(
    name: str,
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    local_refs: set[Any] | None = None,
    scale_local_gradients: bool = True,
) -> GradsFn:
    """``fn(grads, vars)``: the gradients averaged (``op``) over ``process_set``.

    ``None`` gradients stay None; the variables whose ``var_key`` is in ``local_refs`` keep
    their own gradient (divided by the set's size when ``scale_local_gradients``, as
    Horovod does); the rest go in one ``grouped_allreduce`` call named ``name``.
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError(
            "gradient_predivide_factor needs op=hvd.Average (it splits the average into a "
            f"scale before and after the sum); got op={op}"
        )
    local = local_refs if local_refs is not None else set()

    def fn(grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        out = list(grads)
        if sparse_as_dense:
            out = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in out]
        is_local = [v is not None and var_key(v) in local for v in variables]
        idx = [i for i, g in enumerate(out) if g is not None and not is_local[i]]
        rop, pre, post = op, 1.0, 1.0
        if op == Average and gradient_predivide_factor != 1.0:
            rop, pre = Sum, 1.0 / gradient_predivide_factor
            post = gradient_predivide_factor / process_set.size()
        if idx:
            red = grouped_allreduce(
                [out[i] for i in idx],
                compression=compression,
                op=rop,
                prescale_factor=pre,
                postscale_factor=post,
                process_set=process_set,
                name=name,
            )
            for i, g in zip(idx, red):
                out[i] = g
        if scale_local_gradients and any(is_local):
            n = float(process_set.size())
            for i, g in enumerate(out):
                if is_local[i] and g is not None:
                    if isinstance(g, tf.IndexedSlices):
                        out[i] = tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
                    else:
                        out[i] = g / n
        return out

    return fn


def _gradient(
    self: Any,
    target: Any,
    sources: Any,
    output_gradients: Any = None,
    unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
    use_generic_names: bool = False,
) -> Any:
    """``tf.GradientTape.gradient``, then every gradient averaged over the ranks
    (``use_generic_names``: accepted for Horovod compatibility; the call is named anyway).

    SPMD contract: every rank asks for the gradients of the same sources, in the same
    order (shapes and dtypes equal); it blocks until all ranks arrive.
    """
    grads = super(type(self), self).gradient(
        target, sources, output_gradients, unconnected_gradients
    )
    flat_g = tf.nest.flatten(grads, expand_composites=False)
    flat_s = tf.nest.flatten(sources, expand_composites=False)
    reduced = self._hvd_allreduce(flat_g, flat_s)
    return tf.nest.pack_sequence_as(grads, reduced, expand_composites=False)


def _local_and_global(
    self: Any,
    target: Any,
    sources: Any,
    output_gradients: Any = None,
    use_generic_names: bool = False,
) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
    """``gradient``, split in ``sources``' order into ``[(source, gradient)]`` of the
    sources kept local and of those averaged over the ranks (Horovod's
    ``get_local_and_global_gradients``)."""
    grads = self.gradient(target, sources, output_gradients)
    local: list[tuple[Any, Any]] = []
    averaged: list[tuple[Any, Any]] = []
    for s, g in zip(sources, grads):
        (local if var_key(s) in self._hvd_local else averaged).append((s, g))
    return local, averaged


def _register_local_source(self: Any, source: Any) -> None:
    """Keep ``source``'s gradient local (not averaged; divided by the size, as Horovod does)."""
    self._hvd_local.add(var_key(source))


def local_layer_weights(local_layers: Iterable[Any] | None) -> list[Any]:
    """The trainable weights of ``local_layers`` (one layer or an iterable of them; None:
    none): what the Partial tape and optimizer keep local."""
    layers: Any = local_layers
    if layers is not None and hasattr(layers, "trainable_weights"):
        layers = [layers]
    return [w for layer in layers or () for w in layer.trainable_weights]


def DistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """Wrap a ``tf.GradientTape`` so that ``gradient`` returns gradients averaged over ranks.

    The returned tape is the same recording (of the same class, so ``isinstance`` holds);
    its ``gradient`` allreduces every gradient in one call (one buffer per dtype) through
    hvdnb.torch's negotiated transport, eagerly or inside ``tf.function``.
    ``register_local_source(var)`` keeps a variable's gradient local. ``device_*``,
    ``num_groups`` and ``groups`` are accepted for Horovod compatibility (every gradient
    already travels in one call).

    Examples
    --------
    >>> with tf.GradientTape() as tape:                        # doctest: +SKIP
    ...     loss = loss_fn(model(x), y)
    >>> tape = hvd.DistributedGradientTape(tape)
    >>> grads = tape.gradient(loss, model.trainable_variables)
    """
    base = type(gradtape)
    cls = type(
        base.__name__,
        (base,),
        {
            "gradient": _gradient,
            "register_local_source": _register_local_source,
            "get_local_and_global_gradients": _local_and_global,
        },
    )
    tape: Any = object.__new__(cls)  # the same recording: the user's tape's state
    tape.__dict__.update(gradtape.__dict__)
    local: set[Any] = set()
    tape._hvd_local = local
    tape._hvd_allreduce = make_allreduce_grads_fn(
        "DistributedGradientTape",
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        process_set,
        local,
        scale_local_gradients,
    )
    return tape


def PartialDistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Iterable[Any] | None = None,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """``DistributedGradientTape`` whose ``local_layers``' trainable weights stay local."""
    tape = DistributedGradientTape(
        gradtape,
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        process_set,
        scale_local_gradients,
    )
    for w in local_layer_weights(local_layers):
        tape.register_local_source(w)
    return tape
