"""Horovod's ``SyncBatchNormalization``: batch statistics averaged over the ranks.

Owns: the layer, a ``tf.keras.layers.BatchNormalization`` (tf-keras under
``TF_USE_LEGACY_KERAS=1``, as Horovod's; Keras 3 otherwise) whose batch mean and variance
are those of every rank's batch together while training. Loaded on first use of
``hvdnb.tensorflow.SyncBatchNormalization`` (``tf.keras`` is heavy). Never: fuse (the
fused kernel computes its moments out of reach), or issue its allreduce at one rank only
(every rank's layer runs the same ``call``).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hvdnb.tensorflow.ops import Average, allreduce
from hvdnb.torch.basics import size

__all__ = ["SyncBatchNormalization"]


class SyncBatchNormalization(tf.keras.layers.BatchNormalization):  # type: ignore[misc]  # untyped Keras
    """Batch normalization whose training statistics are synchronized across the ranks.

    SPMD contract: every rank calls the layer with the same feature shape and the same
    batch size (the mean of the ranks' means is the global mean then), in training; it
    blocks until all ranks arrive. ``fused=True`` is refused, as in Horovod.
    """

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError(
                "SyncBatchNormalization does not support fused=True: pass fused=False (the default)"
            )
        if not kwargs.get("name"):
            kwargs["name"] = "sync_batch_normalization"
        if "fused" in tf.keras.layers.BatchNormalization.__init__.__code__.co_varnames:
            kwargs["fused"] = fused  # tf-keras has the argument, Keras 3 does not
        super().__init__(**kwargs)

    def _moments(self, *args: Any, **kwargs: Any) -> tuple[tf.Tensor, tf.Tensor]:
        """This rank's moments (Keras' own), then the group's: Var[X] = E[X^2] - E[X]^2
        with both expectations averaged over the ranks in one allreduce."""
        mean, variance = super()._moments(*args, **kwargs)
        if size() == 1:
            return mean, variance
        stats = allreduce(tf.stack([mean, variance + tf.math.square(mean)]), op=Average)
        group_mean, group_mean_of_square = tf.unstack(stats)
        return group_mean, group_mean_of_square - tf.math.square(group_mean)
