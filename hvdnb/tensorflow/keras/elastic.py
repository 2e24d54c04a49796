"""Horovod's elastic API for Keras 2 (tf-keras): ``hvd.elastic.run``, ``KerasState`` and the
callbacks that keep a state in step with ``model.fit``.

``KerasState`` is ``hvdnb.tensorflow.elastic.TensorFlowKerasState`` with Keras's backend.
``CommitStateCallback`` commits the state every ``batches_per_commit`` batches and at each
epoch's end (a commit is also where every rank learns, at the same batch, that the
cluster's membership changed); ``UpdateBatchStateCallback`` keeps ``state.batch`` at the
batch just finished (0 again at an epoch's end); ``UpdateEpochStateCallback`` keeps
``state.epoch`` at the number of epochs done, counted across resets. Put the update
callbacks before ``CommitStateCallback`` so that a commit saves the counters' new values.

Never: issue a collective that not every rank issues (each callback runs the same code on
every rank, at the same batch or epoch).
"""

from __future__ import annotations

from typing import Any

from hvdnb import extras
from hvdnb.tensorflow.elastic import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    TensorFlowKerasState,
    run,
)

keras: Any = extras.require("tf_keras", "hvdnb.tensorflow.keras")

__all__ = [
    "CommitStateCallback",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "KerasState",
    "ObjectState",
    "State",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]


class KerasState(TensorFlowKerasState):
    """Horovod's ``KerasState``: a Keras model, its optimizer and plain fields that an
    elastic loop commits, restores and syncs (``TensorFlowKerasState`` with Keras's
    backend, which a v1 graph's session comes from).

    Parameters
    ----------
    model : a built Keras model
    optimizer : its optimizer (default: ``model.optimizer``)
    backend : Keras's backend (default: tf-keras's)
    **kwargs : plain fields (``epoch=0, batch=0``), read and written as attributes
    """

    def __init__(
        self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any
    ) -> None:
        super().__init__(model, optimizer=optimizer, backend=backend or keras.backend, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):  # type: ignore[misc]  # untyped Keras
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of each epoch.

    The count starts again at every ``fit`` (after a reset too), so that every rank
    commits at the same batches.
    """

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if int(batches_per_commit) < 1:
            raise ValueError(f"batches_per_commit must be >= 1, not {batches_per_commit}")
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self.batches_remaining = self.batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):  # type: ignore[misc]  # untyped Keras
    """Keep ``state.batch`` at the index of the batch just finished; 0 at an epoch's end.

    When ``fit`` was given a number of steps per epoch, an epoch that starts at
    ``state.batch > 0`` (resumed after a reset) reports that many fewer steps to the
    other callbacks, as Horovod's does.
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state: Any = state  # any State with the fields the callback updates
        self.steps_per_epoch: int | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        params = self.params if self.params is not None else {}
        if params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = int(params["steps"])
            params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):  # type: ignore[misc]  # untyped Keras
    """Keep ``state.epoch`` at the number of epochs done, across resets.

    The state counts from its value when ``fit`` began, plus one at each epoch's end (so
    that a reset after an epoch's last commit does not run that epoch again). Keras
    numbers a ``fit``'s epochs from 0: as in Horovod, train the rest with
    ``fit(..., epochs=total - state.epoch)`` rather than with ``initial_epoch``.
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state: Any = state  # any State with the fields the callback updates
        self.initial_epoch = getattr(state, "epoch", 0)

    def on_train_begin(self, logs: Any = None) -> None:
        self.initial_epoch = getattr(self.state, "epoch", 0)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
