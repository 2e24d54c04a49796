"""Horovod's elastic API for TensorFlow: ``hvd.elastic.run``, ``TensorFlowState``,
``TensorFlowKerasState``.

``@hvd.elastic.run`` wraps a training function of a state; when a rank of an elastic
cluster dies (or its code raises), the survivors restore the state's last commit, form
the next generation of the group without it, run the reset callbacks and call the function
again (``hvdnb.rank.elastic`` has the loop and the membership; the group is hvdnb.torch's,
which hvdnb.tensorflow runs on, so the reset is the same as ``hvdnb.torch.elastic``'s).
A collective that fails inside a ``tf.function`` reaches the loop as a TensorFlow error
wrapping the Python one; ``run`` turns it back into ``HorovodInternalError`` when its words
say a peer was lost, as Horovod does with its ops' errors.

``TensorFlowState(variables, **fields)`` commits a list of variables (their values, copied
to host memory) and the plain fields; ``TensorFlowKerasState(model, optimizer, **fields)``
commits a Keras model's weights and its optimizer's variables. ``sync`` broadcasts rank
0's values (``broadcast_variables``, ``broadcast_object``). Eager mode (TensorFlow 2) is
the main road; a v1 graph runs its broadcast and reads its values through the session.

Never: write the state to disk (``hvdnb.State`` does, for restarts), or re-form a group
itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import tensorflow as tf

from hvdnb.rank import elastic as _core
from hvdnb.rank import rendezvous
from hvdnb.rank.elastic import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State
from hvdnb.tensorflow.basics import executing_eagerly, init, rank, shutdown
from hvdnb.tensorflow.functions import broadcast_object, broadcast_object_fn, broadcast_variables

__all__ = [
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TensorFlowKerasState",
    "TensorFlowState",
    "run",
]

F = TypeVar("F", bound=Callable[..., Any])

#: words in a TensorFlow error's message that name the Python error of a lost peer
_LOST_PEER_NAMES = (
    "horovodinternalerror",
    "disterror",
    "distbackenderror",
    "distnetworkerror",
    "diststoreerror",
)


def _reset() -> None:
    shutdown()
    _core.reform()
    init()


def _lost_peer(exc: tf.errors.OpError) -> bool:
    """Does this TensorFlow error wrap a collective that failed because a peer was lost?"""
    text = str(exc.message)
    if any(w in text.lower() for w in _LOST_PEER_NAMES):
        return True
    return _core.is_internal(RuntimeError(text), rendezvous.generation())


def run(func: F) -> F:
    """Horovod's ``hvd.elastic.run``: call ``func(state, ...)`` and go on at the new size
    when a rank is lost (see the module docstring)."""

    @functools.wraps(func)
    def translated(state: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            # a collective in a tf.function: TensorFlow wrapped the Python error
            if _lost_peer(exc):
                raise HorovodInternalError(str(exc.message)) from exc
            raise

    return _core.run_fn(cast(F, translated), _reset, rendezvous.generation)


# ---------------------------------------------------------------------- helpers
def _optimizer_variables(optimizer: Any) -> list[Any]:
    """An optimizer's variables now: a method on Keras 2's legacy optimizers, a property
    on the others; none before its first step (or only its iteration counter)."""
    if optimizer is None:
        return []
    v = getattr(optimizer, "variables", None)
    if v is None:
        return []
    return list(v() if callable(v) else v)


def _build_optimizer(optimizer: Any, model: Any) -> None:
    """Create an optimizer's slots for ``model``'s trainable weights, as its first step
    would: a rank that joined late (fresh optimizer) then has the variables rank 0 sends."""
    build = getattr(optimizer, "build", None)
    if callable(build) and not hasattr(optimizer, "_create_all_weights"):
        build(model.trainable_variables)  # Keras 2's optimizer (and Keras 3's)
    elif hasattr(optimizer, "_create_all_weights"):
        optimizer._create_all_weights(model.trainable_variables)  # Keras 2's legacy ones


def _model_built(model: Any) -> bool:
    return bool(getattr(model, "built", True))


def _v1_global_variables() -> list[Any]:
    return list(tf.compat.v1.global_variables())


def _keras_session(backend: Any) -> Any:
    """A v1 graph's Keras session: from ``backend``, or from TensorFlow's v1 Keras backend
    when ``backend`` is a TensorFlow 2 one (it has no ``get_session``)."""
    get = getattr(backend, "get_session", None)
    return get() if callable(get) else tf.compat.v1.keras.backend.get_session()


# ---------------------------------------------------------------------- states
class _Fields:
    """A state's plain fields (``epoch=0, batch=0``), kept as attributes of the state that
    owns them: saved by value, restored, and synced from rank 0 with ``bcast``.

    What ``ObjectState`` does, as a part: ``TensorFlowKerasState`` has it as a field, so
    that ``KerasState`` (which extends it) stays within two hvdnb ancestors.
    """

    def __init__(self, owner: State, bcast: Callable[[Any], Any], values: dict[str, Any]):
        self.owner = owner
        self.bcast = bcast
        self.saved = dict(values)
        self.restore()

    def save(self) -> None:
        self.saved = {k: getattr(self.owner, k) for k in self.saved}

    def restore(self) -> None:
        for k, v in self.saved.items():
            setattr(self.owner, k, v)

    def sync(self) -> None:
        if self.saved:  # the same names on every rank: every rank takes this branch
            self.saved = self.bcast(self.saved)
            self.restore()


class TensorFlowState(ObjectState):
    """Horovod's ``TensorFlowState``: a list of ``tf.Variable`` objects and plain fields
    that an elastic loop commits, restores and syncs.

    Parameters
    ----------
    variables : the variables to keep (default: a v1 graph's global variables)
    session : a v1 graph's session (default: the default session); unused in eager mode
    **kwargs : plain fields (``epoch=0, batch=0``), read and written as attributes
    """

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any) -> None:
        self.variables = list(variables) if variables else _v1_global_variables()
        self.session = session
        self._bcast_op: Any = None
        bcast: Callable[[Any], Any] = broadcast_object
        if not executing_eagerly():
            # a v1 graph: build the broadcast once (each build is a new op), run it at sync
            self.session = session or tf.compat.v1.get_default_session()
            self._bcast_op = broadcast_variables(self.variables, root_rank=0)
            bcast = broadcast_object_fn(session=self.session)
        self._values: list[Any] = []
        self._save_values()
        super().__init__(bcast_object=bcast, get_rank=rank, **kwargs)

    def save(self) -> None:
        self._save_values()
        super().save()

    def restore(self) -> None:
        for var, value in zip(self.variables, self._values):
            if self._bcast_op is None:
                var.assign(value)
            else:
                var.load(value, self.session)
        super().restore()

    def sync(self) -> None:
        if self._bcast_op is None:
            broadcast_variables(self.variables, root_rank=0)
        elif self.session is not None:
            self.session.run(self._bcast_op)
        self._save_values()
        super().sync()

    def _save_values(self) -> None:
        # eager: .numpy() is a host copy; a later in-place update copies the variable first
        if self._bcast_op is None:
            self._values = [v.numpy() for v in self.variables]
        else:
            self._values = [v.eval(self.session) for v in self.variables]


class TensorFlowKerasState(State):
    """Horovod's ``TensorFlowKerasState``: a Keras model, its optimizer and plain fields
    that an elastic loop commits, restores and syncs (the fields as ``ObjectState`` keeps
    them, through a part of its own rather than as a subclass).

    A commit keeps the model's weights (``get_weights``) and the optimizer's variables in
    host memory; ``restore`` sets them back. An optimizer has no slots before its first
    step: slots made after a commit keep their values at a restore. At ``sync`` a rank
    whose optimizer has fewer variables than rank 0's (it joined late) creates its slots
    first, then every rank takes rank 0's weights and optimizer variables. After a reset
    the model's compiled train, test and predict functions are dropped, so Keras traces
    them again for the new group's size.

    Parameters
    ----------
    model : a built Keras model (ValueError otherwise, as in Horovod)
    optimizer : its optimizer (default: ``model.optimizer``; None: not kept)
    backend : Keras's backend, for a v1 graph's session (``backend.get_session()``); in a
        v1 graph without one, the state is kept as in eager mode
    **kwargs : plain fields (``epoch=0, batch=0``), read and written as attributes
    """

    def __init__(
        self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any
    ) -> None:
        if not _model_built(model):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.backend = backend
        self._saved_model_state: list[Any] = []
        self._saved_optimizer_state: list[tuple[Any, Any]] = []
        self._bcast_op: Any = None
        bcast: Callable[[Any], Any] = broadcast_object
        if backend is not None and not executing_eagerly():
            # a v1 graph: one broadcast op (each build is a new op), run in Keras's session
            self._bcast_op = broadcast_variables(_v1_global_variables(), root_rank=0)
            bcast = broadcast_object_fn(session=_keras_session(backend))
        self._save_model()
        self._fields = _Fields(self, bcast, kwargs)
        super().__init__(bcast_object=bcast, get_rank=rank)

    def save(self) -> None:
        self._save_model()
        self._fields.save()

    def restore(self) -> None:
        self._load_model()
        self._fields.restore()

    def sync(self) -> None:
        if self._bcast_op is not None:
            _keras_session(self.backend).run(self._bcast_op)
        else:
            self._broadcast_model()
        self._save_model()
        self._fields.sync()

    def reset(self) -> None:
        # a tf.function traced before the reset has the old group's size in its constants
        for attr in ("train_function", "test_function", "predict_function"):
            if getattr(self.model, attr, None) is not None:
                setattr(self.model, attr, None)

    def _broadcast_model(self) -> None:
        if self.optimizer is not None:
            root_count = broadcast_object(len(_optimizer_variables(self.optimizer)), root_rank=0)
            if len(_optimizer_variables(self.optimizer)) < root_count:
                _build_optimizer(self.optimizer, self.model)
        variables = list(self.model.variables) + _optimizer_variables(self.optimizer)
        broadcast_variables(variables, root_rank=0)

    def _save_model(self) -> None:
        self._saved_model_state = self.model.get_weights()
        opt_vars = _optimizer_variables(self.optimizer)
        if self._bcast_op is None:
            self._saved_optimizer_state = [(v, v.numpy()) for v in opt_vars]
        else:
            values = _keras_session(self.backend).run(opt_vars) if opt_vars else []
            self._saved_optimizer_state = list(zip(opt_vars, values))

    def _load_model(self) -> None:
        self.model.set_weights(self._saved_model_state)
        if self._bcast_op is None:
            for var, value in self._saved_optimizer_state:
                var.assign(value)
        else:
            session = _keras_session(self.backend)
            for var, value in self._saved_optimizer_state:
                var.load(value, session)
