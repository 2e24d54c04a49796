"""Horovod's TensorFlow helpers: broadcast variables and Python objects.

Owns: ``broadcast_variables``, ``broadcast_global_variables`` (v1 graphs only, as in
Horovod), ``broadcast_object``, ``broadcast_object_fn`` and ``allgather_object`` (objects
pickled by hvdnb.torch's helpers). Never: broadcast in an order that depends on the rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

import hvdnb.torch as ht
from hvdnb.tensorflow.ops import broadcast_
from hvdnb.torch.process_sets import ProcessSet, global_process_set

__all__ = [
    "allgather_object",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
]


def broadcast_variables(
    variables: Sequence[Any],
    root_rank: int,
    process_set: ProcessSet = global_process_set,
    inplace: bool = False,
) -> Any:
    """Overwrite every variable with ``root_rank``'s value (model weights, optimizer slots).

    SPMD contract: the same variables (count, order, shapes, dtypes) on every rank; call it
    after the first step (Keras optimizers create their slots then) or before training.
    ``inplace`` is accepted for Horovod compatibility (the assignment is in place anyway).
    """
    return broadcast_(
        list(variables), root_rank, name="broadcast_variables", process_set=process_set
    )


def broadcast_global_variables(root_rank: int) -> Any:
    """Broadcast every global variable of a v1 graph from ``root_rank``.

    As in Horovod, TensorFlow 2's eager mode has no global variables: there it raises
    RuntimeError naming ``broadcast_variables``.
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution (TensorFlow 2 "
            "has no global variables); use hvd.broadcast_variables(model.variables, root_rank=0)"
        )
    return tf.group(*broadcast_(tf.compat.v1.global_variables(), root_rank))


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (pickled). Same name and root everywhere."""
    return ht.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def broadcast_object_fn(
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Callable[[Any], Any]:
    """A function ``f(obj)`` that broadcasts ``obj`` from ``root_rank`` (Horovod's form for
    repeated broadcasts)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def allgather_object(
    obj: Any,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[Any]:
    """The list of every rank's ``obj``, in rank order. Same name on every rank."""
    return ht.allgather_object(obj, name=name, process_set=process_set)
