"""Every message kind of the side channel, defined once with its fields.

Both sides import these constants: a sender writes ``ch.send(kinds.METRICS, **fields)``, a
receiver ``ch.on(kinds.METRICS, handler)``. The channel endpoints accept only ``Kind``
objects, so a bare string cannot slip in, and they check a message's required fields when it
is sent (a programming error raises ``ProtocolError`` in the sender) and when it arrives (an
unknown kind or a missing field is dropped, counted and logged: a bad peer must not break
the notebook or a training loop).

Envelope: every message carries ``kind``; a message from a rank also carries ``rank`` (the
rank's channel adds it). The fields below are those of the payload.

Owns: the list of kinds and ``check``. Never: sockets, encoding (``wire``) or behaviour.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = [
    "DEBUG_LISTEN",
    "DEBUG_OFF",
    "DEBUG_READY",
    "ELASTIC_LEFT",
    "ELASTIC_LOOP",
    "ELASTIC_RESET",
    "HELLO",
    "IMPORTED",
    "KINDS",
    "KNOBS_APPLIED",
    "KNOBS_PLAN",
    "KNOBS_REQ",
    "KNOBS_SPEC",
    "MAIN_LOSS",
    "METRICS",
    "PDB_CMD",
    "PDB_OUT",
    "RANK_INFO",
    "RDV_ANNOUNCE",
    "RDV_ASK",
    "RDV_OK",
    "RDV_STORE",
    "STOP_PLAN",
    "STOP_REQ",
    "WHERE",
    "WHERE_ASK",
    "Kind",
    "ProtocolError",
    "check",
    "kind_name",
    "lookup",
    "outgoing",
    "register",
]

Sender = Literal["rank", "notebook", "both"]


class ProtocolError(ValueError):
    """A message that does not follow the protocol: unknown kind or a missing field."""


@dataclass(frozen=True)
class Kind:
    """One message kind.

    Parameters
    ----------
    name : the ``kind`` value on the wire
    sender : who sends it: ``"rank"``, ``"notebook"`` or ``"both"``
    required : payload fields every message of this kind has
    optional : payload fields it may have
    doc : what the message means
    """

    name: str
    sender: Sender
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    doc: str = ""

    def check(self, payload: Mapping[str, Any]) -> None:
        """Raise ``ProtocolError`` when a required field is missing from ``payload``."""
        missing = [f for f in self.required if f not in payload]
        if missing:
            raise ProtocolError(
                f"{self.name!r} message without {', '.join(map(repr, missing))} "
                f"(required: {', '.join(self.required)})"
            )

    def __str__(self) -> str:
        return self.name


HELLO: Final = Kind("hello", "rank", ("pid",), doc="a rank's channel connected")
RANK_INFO: Final = Kind(
    "rank_info", "rank", ("host", "local_rank", "pid"), doc="where a rank runs (after start)"
)
METRICS: Final = Kind(
    "metrics",
    "rank",
    ("seq", "t", "cols"),
    (
        "pid",
        "lost",
        "step",
        "step_time",
        "backend",
        "idle",
        "meta",
        "run",
        "colsx",
        "blob",
        "fp",
        "cell",
    ),
    doc="a batch of logged points and the recorder's state (one per flush interval); ``fp``: "
    "the parameter fingerprints taken since the last message, for the replica-drift watcher: "
    "a list of ``{key, n, step, sums, scale[, names][, end]}`` (``n``: the optimizer's step "
    "count, the same on every rank; ``names`` once per model and cell; ``end``: a cell's last "
    "one, after its last step); ``cell``: the number of the "
    "cell whose loop logged them",
)
KNOBS_SPEC: Final = Kind(
    "knobs_spec", "rank", ("spec",), doc="a new knob set: names, kinds, ranges"
)
KNOBS_REQ: Final = Kind(
    "knobs_req", "notebook", ("id", "values"), ("at_step",), doc="a validated change, to rank 0"
)
KNOBS_PLAN: Final = Kind(
    "knobs_plan",
    "both",
    ("id",),
    ("apply_at", "values", "planned_at", "error"),
    doc="rank 0's plan (or refusal); the notebook forwards it to every rank",
)
KNOBS_APPLIED: Final = Kind(
    "knobs_applied",
    "rank",
    ("id", "step", "late"),
    ("apply_at", "values", "error"),
    doc="a rank applied a plan at this step (or could not)",
)
STOP_REQ: Final = Kind(
    "stop_req",
    "notebook",
    ("id", "reason", "cell"),
    doc="a watcher asks rank 0 to stop the loop of cell ``cell``; ``reason`` is the error text",
)
STOP_PLAN: Final = Kind(
    "stop_plan",
    "both",
    ("id",),
    ("stop_at", "reason", "cell", "error"),
    doc="rank 0's step at which every rank raises TrainingStopped (or its refusal: no loop "
    "runs); the notebook forwards it to every rank",
)
RDV_ANNOUNCE: Final = Kind(
    "rdv_announce", "rank", ("addr", "port"), doc="rank 0's TCPStore, for ranks without MPI"
)
RDV_ASK: Final = Kind("rdv_ask", "rank", doc="a rank asks for rank 0's TCPStore")
RDV_OK: Final = Kind("rdv_ok", "notebook", ("addr", "port"), doc="the store is known (to rank 0)")
RDV_STORE: Final = Kind("rdv_store", "notebook", ("addr", "port"), doc="the store, to a rank")
ELASTIC_RESET: Final = Kind(
    "elastic_reset",
    "notebook",
    ("generation", "members"),
    ("t", "removed", "why", "pids"),
    doc="an elastic cluster's next generation: ``members`` are the slots in rank order "
    "(a slot's rank is its index); ``removed``: ranks only left (the survivors need no sync); "
    "``why``: what changed, in words; ``pids``: every engine process of the cluster (a "
    "survivor shuts down its connections to them: gloo's pairs of the old group)",
)
ELASTIC_LEFT: Final = Kind(
    "elastic_left",
    "rank",
    ("slot",),
    ("error",),
    doc="a rank's own code raised inside an elastic loop: it leaves the cluster",
)
ELASTIC_LOOP: Final = Kind(
    "elastic_loop",
    "rank",
    ("slot", "inside"),
    doc="a rank entered (``inside`` True) or left its outermost elastic loop: a "
    "``%dist scale`` asked for while a cell runs happens at the loop's next commit only "
    "while every rank is inside one",
)
IMPORTED: Final = Kind(
    "imported",
    "rank",
    ("module",),
    doc="a rank imported a heavy framework (``module``): the notebook's warm standby "
    "imports it too, so the next restart finds it loaded",
)
WHERE_ASK: Final = Kind("where?", "notebook", ("ask",), doc="send me your Python stack")
WHERE: Final = Kind(
    "where",
    "rank",
    ("ask",),
    ("cell", "line", "code", "collective", "peer", "progress", "pid", "stack", "idle"),
    doc="a rank's stack",
)
PDB_OUT: Final = Kind("pdb_out", "rank", ("text", "waiting"), doc="a rank's debugger output")
PDB_CMD: Final = Kind("pdb_cmd", "notebook", ("line",), doc="a line for a rank's debugger")
DEBUG_LISTEN: Final = Kind(
    "debug_listen",
    "notebook",
    ("ask",),
    doc="JupyterLab's visual debugger is on: start debugpy's adapter on this rank (once) and "
    "say where it listens",
)
DEBUG_OFF: Final = Kind(
    "debug_off",
    "notebook",
    (),
    doc="JupyterLab's visual debugger was turned off: breakpoint() is pdb's again, and the "
    "rank's collectives time out again",
)
DEBUG_READY: Final = Kind(
    "debug_ready",
    "rank",
    ("ask",),
    ("host", "port", "pid", "error"),
    doc="where this rank's debugpy adapter listens (or why it could not start)",
)

KINDS: Final[dict[str, Kind]] = {
    k.name: k
    for k in (
        HELLO,
        RANK_INFO,
        METRICS,
        KNOBS_SPEC,
        KNOBS_REQ,
        KNOBS_PLAN,
        KNOBS_APPLIED,
        STOP_REQ,
        STOP_PLAN,
        RDV_ANNOUNCE,
        RDV_ASK,
        RDV_OK,
        RDV_STORE,
        ELASTIC_RESET,
        ELASTIC_LEFT,
        ELASTIC_LOOP,
        IMPORTED,
        WHERE_ASK,
        WHERE,
        PDB_OUT,
        PDB_CMD,
        DEBUG_LISTEN,
        DEBUG_OFF,
        DEBUG_READY,
    )
}


def register(kind: Kind) -> Kind:
    """Add a kind of one's own (a plugin's, a test's) to the registry; both sides must
    register it before it is sent. Returns it. A name already taken raises ``ValueError``."""
    if KINDS.get(kind.name, kind) != kind:
        raise ValueError(f"message kind {kind.name!r} is already defined")
    KINDS[kind.name] = kind
    return kind


def lookup(name: object) -> Kind:
    """The ``Kind`` called ``name``; ``ProtocolError`` for an unknown one."""
    kind = KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ProtocolError(f"unknown message kind {name!r} (known: {', '.join(sorted(KINDS))})")
    return kind


def check(msg: Mapping[str, Any]) -> Kind:
    """The kind of a received message, after checking its fields; ``ProtocolError`` if not."""
    kind = lookup(msg.get("kind"))
    kind.check(msg)
    return kind


def kind_name(kind: Kind) -> str:
    """``kind``'s wire name; ``TypeError`` for anything but a ``Kind`` (a bare string)."""
    if not isinstance(kind, Kind):
        raise TypeError(f"channel kinds are hvdnb.protocol.kinds constants, not {kind!r}")
    return kind.name


def outgoing(kind: Kind, payload: dict[str, Any]) -> dict[str, Any]:
    """The message to send: ``kind`` checked against its fields, then the payload."""
    kind_name(kind)
    kind.check(payload)
    return {"kind": kind.name, **payload}


#: The metric name of a loss a framework logs on its main process only, once for all ranks
#: (the HF Trainer's logged loss: the mean over ranks; ``accelerator.log``'s): the panel
#: draws it as one line, "main process", where no rank logged its own ``loss``
MAIN_LOSS: Final = "loss_main"
