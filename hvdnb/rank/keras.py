"""Keras training on the live panel: one callback that calls ``hvdnb.log`` after each batch.

``hvdnb.keras_callback()`` returns a ``keras.callbacks.Callback``; pass it to ``fit`` on
every rank::

    %%distributed
    import hvdnb, tensorflow as tf
    strategy = tf.distribute.MultiWorkerMirroredStrategy()   # TF_CONFIG: set by hvdnb
    with strategy.scope():
        model = tf.keras.Sequential([...])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(dataset, epochs=5, callbacks=[hvdnb.keras_callback()])

Owns: turning Keras' per-batch ``logs`` into ``hvdnb.log`` calls (a step count that goes
on across epochs and ``fit`` calls, ``total_steps`` for the progress bar, the other
numeric logs as metrics). Never: import keras or tensorflow at import time (``import
hvdnb`` on a rank stays cheap, and works without them), or issue a collective.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from hvdnb import extras
from hvdnb.rank.metrics import recorder

__all__ = ["keras_callback"]

#: ``hvdnb.log``'s reserved names: a Keras metric with one of these names is not forwarded
_RESERVED = frozenset({"samples", "total_steps", "data_time", "compute_time", "comm_time"})


def _keras_callback_base() -> Any:
    """A ``Callback`` base that both Keras 2 and Keras 3 ``fit`` accept: tf_keras's when it
    is installed (Keras 3's ``CallbackList`` calls any object's hooks, while tf_keras's needs
    its own base: ``_implements_train_batch_hooks``), else Keras 3's."""
    legacy = os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes")
    try:
        import tf_keras  # noqa: PLC0415 (optional, and seconds to import)

        return tf_keras.callbacks.Callback
    except ImportError:
        if legacy:  # tf.keras is tf_keras, which is missing: name its install command
            extras.require("tf_keras", "hvdnb.keras_callback under TF_USE_LEGACY_KERAS=1")
    keras = extras.require("keras", "hvdnb.keras_callback")  # names the install command
    return keras.callbacks.Callback


def _float(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):  # a vector metric, a string: not a panel scalar
        return None


@functools.cache
def _callback_class() -> type:
    base: Any = _keras_callback_base()

    class PanelCallback(base):  # type: ignore[misc]  # Keras's Callback: untyped (Any)
        """Logs each training batch's ``loss`` (and other metrics) with ``hvdnb.log``."""

        def __init__(self, metrics: bool = True, samples: int | None = None) -> None:
            super().__init__()
            self.metrics = metrics
            self.samples = samples
            self.step = 0  # the next step to log, across epochs and fit calls
            self._epoch_start = 0
            self._total: int | None = None

        def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
            params = getattr(self, "params", None) or {}
            steps, epochs = params.get("steps"), params.get("epochs")
            self._total = self.step + steps * epochs if steps and epochs else None

        def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            self._epoch_start = self.step

        def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            logs = logs or {}
            # ``batch`` counts from 0 in each epoch (the last of a ``steps_per_execution``
            # group): steps run on across epochs
            step = max(self._epoch_start + int(batch), self.step)
            self.step = step + 1
            extra: dict[str, Any] = {}
            if self.metrics:
                for k, v in logs.items():
                    if k != "loss" and k not in _RESERVED and (f := _float(v)) is not None:
                        extra[k] = f
            if self.samples:
                extra["samples"] = self.samples
            if self._total:
                extra["total_steps"] = self._total
            loss = logs.get("loss")
            recorder.log(step, None if loss is None else _float(loss), **extra)

    return PanelCallback


def keras_callback(metrics: bool = True, samples: int | None = None) -> Any:
    """A Keras callback that sends each training batch's loss to hvdnb's live panel.

    After every batch it calls ``hvdnb.log(step, logs["loss"], ...)`` with a step that
    counts batches across epochs (and across ``fit`` calls with the same callback), and
    ``total_steps`` (epochs x steps per epoch, when Keras knows them) for the progress
    bar. Keras' ``loss`` is the mean over the epoch so far, not the batch's own; under
    ``MultiWorkerMirroredStrategy`` it is reduced over the workers, so every rank logs the
    same curve. Keras and TensorFlow are imported when this is called, not before. The
    same callback works in a Keras 3 ``fit`` and in a tf-keras (Keras 2,
    ``TF_USE_LEGACY_KERAS=1``) one.

    Parameters
    ----------
    metrics : also log the other numeric entries of Keras' logs (``accuracy``, ...) by name
    samples : samples this rank processes per batch (its share of the global batch), for
        the panel's samples/s

    Returns
    -------
    keras.callbacks.Callback

    Examples
    --------
    >>> import hvdnb                                               # doctest: +SKIP
    >>> model.fit(dataset, epochs=5, callbacks=[hvdnb.keras_callback(samples=32)])
    """
    return _callback_class()(metrics=metrics, samples=samples)
