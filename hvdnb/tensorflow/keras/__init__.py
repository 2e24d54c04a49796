"""Horovod's Keras API on tf-keras (Keras 2): ``import hvdnb.tensorflow.keras as hvd``.

``DistributedOptimizer`` wraps a Keras 2 optimizer so that the gradients it computes are
averaged over the ranks (the user scales the learning rate by ``hvd.size()``, as with
Horovod); ``callbacks`` has Horovod's four callbacks; ``elastic`` its elastic API
(``KerasState`` and the callbacks that commit it); ``load_model`` reads a model saved with
a wrapped optimizer. Everything else (``init``, ``rank``, ``size``, ...) is
``hvdnb.tensorflow``'s. Horovod's Keras API is written for Keras 2: TensorFlow 2.16+ ships
Keras 3 as ``tf.keras`` unless ``TF_USE_LEGACY_KERAS=1`` is set before TensorFlow is
imported, and then ``tf.keras`` is the ``tf-keras`` package used here.

Owns: the wrapped optimizer class (a subclass of the user's optimizer's class, with the
same name, so a saved model loads without hvdnb) and the refusal of Keras 3 optimizers.
Never: change the learning rate, or allreduce outside ``compute_gradients``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from hvdnb import extras

keras: Any = extras.require("tf_keras", "hvdnb.tensorflow.keras")

import tensorflow as tf  # noqa: E402

from hvdnb.tensorflow import (  # noqa: E402
    Adasum,
    Average,
    Compression,
    Max,
    Min,
    Product,
    Sum,
    allgather_object,
    broadcast_object,
    broadcast_variables,
    global_process_set,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from hvdnb.tensorflow import ops as _ops  # noqa: E402
from hvdnb.tensorflow.functions import broadcast_global_variables as bgv  # noqa: E402
from hvdnb.tensorflow.keras import aggregate, callbacks, elastic  # noqa: E402
from hvdnb.tensorflow.tape import local_layer_weights, make_allreduce_grads_fn  # noqa: E402
from hvdnb.torch.process_sets import ProcessSet  # noqa: E402

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Max",
    "Min",
    "PartialDistributedOptimizer",
    "Product",
    "Sum",
    "allgather",
    "allgather_object",
    "allreduce",
    "broadcast",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_variables",
    "callbacks",
    "elastic",
    "init",
    "is_initialized",
    "load_model",
    "local_rank",
    "local_size",
    "rank",
    "reducescatter",
    "shutdown",
    "size",
]

_OPT_BASES = (keras.optimizers.Optimizer, keras.optimizers.legacy.Optimizer)


def _check_optimizer(optimizer: Any) -> None:
    if isinstance(optimizer, _OPT_BASES):
        return
    mod = type(optimizer).__module__
    if mod.startswith("keras"):
        raise TypeError(
            f"hvd.DistributedOptimizer wraps Keras 2 (tf-keras) optimizers; this is Keras 3's "
            f"{type(optimizer).__name__} ({mod}). Horovod's Keras API is written for Keras 2: "
            "set TF_USE_LEGACY_KERAS=1 before TensorFlow is imported (then tf.keras is tf-keras) "
            f"and install it: {extras.install_command('tf_keras')}"
        )
    raise TypeError(
        f"hvd.DistributedOptimizer needs a tf-keras optimizer, not {type(optimizer).__name__}; "
        "for a tf.GradientTape loop use hvdnb.tensorflow.DistributedGradientTape"
    )


class _Distributed:
    """The methods a wrapped optimizer gets (copied onto a subclass of its class)."""

    _hvd_fn: Any = None
    _hvd_local: Any = None
    _agg_helper: Any = None  # Horovod's name (its tests read ``_agg_helper.counter``)

    def _hvd_reduce(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        if self._hvd_fn is None:  # an optimizer made by from_config: Horovod's defaults
            self._hvd_local = set()
            self._hvd_fn = make_allreduce_grads_fn(
                "DistributedOptimizer", local_refs=self._hvd_local
            )
        return list(self._hvd_fn(grads, variables))

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local (divided by the size, as Horovod does)."""
        if self._hvd_fn is None:
            self._hvd_reduce([], [])
        self._hvd_local.add(var.ref())

    def _hvd_compute(self, loss: Any, var_list: Any, grad_loss: Any, tape: Any) -> list[Any]:
        base: Any = super(type(self), self)
        if hasattr(base, "_compute_gradients") and not hasattr(base, "build"):
            gv = base._compute_gradients(loss, var_list, grad_loss, tape)  # Keras 2 legacy
        else:
            gv = base.compute_gradients(loss, var_list, tape)
        grads, variables = zip(*gv) if gv else ((), ())
        if self._agg_helper is not None:
            return list(zip(self._agg_helper.compute(grads, variables), variables))
        return list(zip(self._hvd_reduce(grads, variables), variables))

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        """The base update; with ``backward_passes_per_step > 1`` only on the pass that
        allreduced (the other passes count the iteration)."""
        base: Any = super(type(self), self)
        if self._agg_helper is None:
            return base.apply_gradients(grads_and_vars, *args, **kwargs)
        gv = list(grads_and_vars)
        return aggregate.apply(
            self._agg_helper, self, lambda: base.apply_gradients(gv, *args, **kwargs)
        )

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> list[Any]:
        """The base optimizer's gradients, averaged over the ranks (one call)."""
        return self._hvd_compute(loss, var_list, None, tape)

    def _compute_gradients(
        self, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None
    ) -> list[Any]:
        return self._hvd_compute(loss, var_list, grad_loss, tape)

    def get_gradients(self, loss: Any, params: Any) -> list[Any]:
        """Legacy graph-mode path: the base's gradients, averaged over the ranks."""
        grads = super(type(self), self).get_gradients(loss, params)  # type: ignore[misc]
        return self._hvd_reduce(grads, params)


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """Wrap a tf-keras optimizer so that its gradients are averaged over the ranks.

    The result is an instance of a subclass of ``optimizer``'s class with the same name
    and config; ``model.fit`` (and ``minimize``) allreduce every gradient in one call (one
    buffer per dtype) before the update. Scale the learning rate by ``hvd.size()`` yourself,
    as with Horovod. ``register_local_var(var)`` keeps a variable's gradient local.

    ``backward_passes_per_step > 1`` sums that many passes' gradients on each rank and
    allreduces (and applies) once per that many steps, the sum divided by the count when
    ``average_aggregated_gradients``. Raises TypeError for a Keras 3 optimizer (set
    ``TF_USE_LEGACY_KERAS=1``).
    """
    _check_optimizer(optimizer)
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, not {backward_passes_per_step}")
    methods = {k: v for k, v in vars(_Distributed).items() if not k.startswith("__")}
    cls: Any = type(type(optimizer).__name__, (type(optimizer),), methods)
    opt = cls.from_config(optimizer.get_config())
    opt._hvd_local = set()
    opt._hvd_fn = make_allreduce_grads_fn(
        name or f"Distributed{type(optimizer).__name__}",
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        process_set,
        opt._hvd_local,
        scale_local_gradients,
    )
    if backward_passes_per_step > 1:
        opt._agg_helper = aggregate.Aggregator(
            int(backward_passes_per_step), average_aggregated_gradients, opt._hvd_fn
        )
    return opt


def PartialDistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Iterable[Any] | None = None,
    scale_local_gradients: bool = True,
) -> Any:
    """``DistributedOptimizer`` whose ``local_layers``' trainable weights stay local."""
    opt = DistributedOptimizer(
        optimizer,
        name,
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        gradient_predivide_factor,
        op,
        backward_passes_per_step,
        average_aggregated_gradients,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    for w in local_layer_weights(local_layers):
        opt.register_local_var(w)
    return opt


def broadcast_global_variables(root_rank: int) -> Any:
    """Horovod's Keras form; TensorFlow 2 has no global variables (RuntimeError, naming
    ``callbacks.BroadcastGlobalVariablesCallback``)."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "broadcast_global_variables needs a v1 graph; in TensorFlow 2 pass "
            "hvd.callbacks.BroadcastGlobalVariablesCallback(0) to model.fit"
        )

    return bgv(root_rank)


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: int | None = None,
    compression: Any = Compression.none,
) -> Any:
    """Allreduce a tensor-compatible value (Average by default); returns a tensor."""
    return _ops.allreduce(
        tf.constant(value),
        average=average,
        compression=compression,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        name=name,
    )


def allgather(value: Any, name: str | None = None) -> Any:
    """Allgather a tensor-compatible value along its first dimension."""
    return _ops.allgather(tf.constant(value), name=name)


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    """Broadcast a tensor-compatible value from ``root_rank``."""
    return _ops.broadcast(tf.constant(value), root_rank, name=name)


def reducescatter(value: Any, name: str | None = None, op: int = Average) -> Any:
    """Reducescatter a tensor-compatible value (Average by default)."""
    return _ops.reducescatter(tf.constant(value), op=op, name=name)


def load_model(
    filepath: Any,
    custom_optimizers: Sequence[type] | None = None,
    custom_objects: dict[str, Any] | None = None,
    compression: Any = Compression.none,
    legacy_opts: bool = False,
) -> Any:
    """Load a Keras 2 model saved with a wrapped optimizer; the loaded optimizer is wrapped
    again with ``DistributedOptimizer``."""
    base = keras.optimizers.legacy.Optimizer if legacy_opts else keras.optimizers.Optimizer

    def wrap(cls: type) -> Any:
        return lambda **kw: DistributedOptimizer(cls(**kw), compression=compression)

    objs: dict[str, Any] = {c.__name__.lower(): wrap(c) for c in base.__subclasses__()}
    objs.update({c.__name__: wrap(c) for c in custom_optimizers or ()})
    objs.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objs)
