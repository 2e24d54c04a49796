"""Horovod's Keras callbacks on tf-keras: start from the same weights, average the epoch's
metrics, warm up and schedule the learning rate.

Owns: ``BroadcastGlobalVariablesCallback``, ``MetricAverageCallback``,
``LearningRateWarmupCallback``, ``LearningRateScheduleCallback``. Never: issue a
collective that not every rank issues (each callback runs the same code on every rank,
at the same batch or epoch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from hvdnb import extras
from hvdnb.tensorflow.functions import broadcast_variables
from hvdnb.tensorflow.ops import Average, allreduce
from hvdnb.torch.basics import size

keras: Any = extras.require("tf_keras", "hvdnb.tensorflow.keras")

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
]


def _optimizer_variables(opt: Any) -> list[Any]:
    v = getattr(opt, "variables", None)
    if v is None:
        return []
    return list(v() if callable(v) else v)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):  # type: ignore[misc]  # untyped Keras
    """Make every rank start from ``root_rank``'s weights (and optimizer state).

    The model's variables are broadcast when training begins (when the model is built by
    then), and again with the optimizer's after the first batch (Keras creates the
    optimizer's slots, and an unbuilt model its weights, in the first step).
    ``local_variables`` are left alone.
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.local = {v.ref() for v in (local_variables or [])}
        self.broadcast_done = False

    def _broadcast(self, with_optimizer: bool) -> None:
        vs = list(self.model.variables)
        if with_optimizer and self.model.optimizer is not None:
            vs += _optimizer_variables(self.model.optimizer)
        broadcast_variables([v for v in vs if v.ref() not in self.local], self.root_rank)

    def on_train_begin(self, logs: Any = None) -> None:
        # a model given no input shape has no weights until its first batch (Horovod's
        # tensorflow2_keras_mnist.py): then the broadcast after that batch is the first
        # (every rank builds the same model, so every rank takes the same branch)
        if not self.broadcast_done and getattr(self.model, "built", True):
            self._broadcast(False)

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self.broadcast_done:
            self._broadcast(True)
            self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):  # type: ignore[misc]  # untyped Keras
    """Average every metric of an epoch's logs over the ranks, at the epoch's end (put it
    before callbacks that read them: ReduceLROnPlateau, checkpoints, TensorBoard)."""

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if not logs:
            return
        keys = sorted(
            k for k, v in logs.items() if isinstance(v, (int, float)) or hasattr(v, "dtype")
        )
        if not keys:
            return
        vals = tf.constant([float(logs[k]) for k in keys], dtype=tf.float64)
        avg = allreduce(vals, op=Average, name="MetricAverageCallback").numpy()
        for k, v in zip(keys, avg):
            logs[k] = float(v)


def _set_lr(opt: Any, lr: float) -> None:
    keras.backend.set_value(opt.lr, lr)


class LearningRateScheduleCallback(keras.callbacks.Callback):  # type: ignore[misc]  # untyped Keras
    """Between ``start_epoch`` and ``end_epoch`` set the learning rate to ``initial_lr *
    multiplier`` (a number, or a function of the epoch; with ``staircase=False`` of the
    fractional epoch, at every batch)."""

    def __init__(
        self,
        initial_lr: float,
        multiplier: float | Callable[[float], float],
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        self.initial_lr = initial_lr
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self.multiplier = multiplier if callable(multiplier) else (lambda _e: multiplier)
        self.epoch = 0

    def _active(self) -> bool:
        return self.epoch >= self.start_epoch and (
            self.end_epoch is None or self.epoch < self.end_epoch
        )

    def _steps(self) -> int:
        return int(self.steps_per_epoch or (self.params or {}).get("steps") or 1)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epoch = epoch
        if self._active() and self.staircase:
            _set_lr(self.model.optimizer, self.initial_lr * self.multiplier(epoch))

    def on_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self._active() and not self.staircase:
            e = self.epoch + float(batch) / self._steps()
            _set_lr(self.model.optimizer, self.initial_lr * self.multiplier(e))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over
    ``warmup_epochs``, batch by batch (Goyal et al.'s gradual warmup, as Horovod's)."""

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        def ramp(epoch: float) -> float:
            n = size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            ramp,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.verbose = verbose
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if epoch == self.warmup_epochs - 1 and self.verbose:
            print(f"Epoch {epoch + 1}: learning rate warmed up to {self.initial_lr:g}")
