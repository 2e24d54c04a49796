"""What each remote call (``protocol.remote``) returns: small typed replies, read by attribute.

A rank builds one of these in ``hvdnb.rank.engine`` and ipyparallel pickles it back to the
notebook, which reads its fields by name; both sides import the same class, so a field
renamed on one side is renamed on the other. They are ``NamedTuple``s: a reply pickles as
its class's name and a tuple of values (54 bytes for a no-op cell's reply; about 3 µs to
pickle and unpickle, against 5.5 µs for a frozen dataclass with slots), is immutable, and
ipyparallel sends it whole (it only walks plain lists, tuples and dicts).

=====================  ==========================  =============================
remote call            returns                     read by
=====================  ==========================  =============================
``RUN_CELL``           ``CellReply``               ``notebook.cellout.cells``
``JOIN_CELL``          ``CellReply``               ``notebook.cellout.cells``
``ENGINE_INFO``        ``EngineInfo``              ``notebook.cluster.health``
``DEBUG_COMMAND``      ``DebugReply``              ``notebook.magics`` (%dist debug)
``REBUILD_GROUP``      ``None``
``CONNECT_CHANNEL``    ``None``
=====================  ==========================  =============================

Owns: the shape of every reply. Never: import either side, or hold behaviour beyond
reading a reply.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["CellReply", "DebugReply", "EngineInfo"]


class CellReply(NamedTuple):
    """One rank's answer to ``run_cell``: the trailing expression's value, or its error.

    A user's error is a reply with ``ok=False``, never a raised exception, so the notebook
    can merge identical tracebacks across ranks.
    """

    #: the cell ran to its end on this rank
    ok: bool
    #: the rank that answered (-1 when the rank's environment has no RANK)
    rank: int
    #: ``repr`` of the cell's trailing expression (None: no expression, or it was None)
    repr: str | None = None
    #: the trailing expression's value itself; None when it could not be pickled
    value: Any = None
    #: on an error: the exception's type name, its message, and the user's frames
    ename: str = ""
    evalue: str = ""
    traceback: str = ""
    #: the error was a KeyboardInterrupt (fail-fast, the stop button, a timeout)
    interrupted: bool = False
    #: the last metrics message this cell sent, ``(pid, seq)``, for the notebook to wait for
    metrics: tuple[int, int] | None = None
    #: the error was raised inside an elastic loop, and this rank left the cluster
    left: bool = False
    #: the generation of this rank's process group when the cell ended (re-formed inside
    #: an elastic loop: a later one than at the cell's start); -1: not known
    generation: int = -1

    def error(self) -> dict[str, Any]:
        """The error record a ``CellResult`` keeps for this rank (``ok=False`` replies)."""
        return {
            "ok": False,
            "rank": self.rank,
            "ename": self.ename,
            "evalue": self.evalue,
            "traceback": self.traceback,
            "interrupted": self.interrupted,
            "left": self.left,
        }


class EngineInfo(NamedTuple):
    """A rank's answer to ``engine_info``: what ``%dist status`` shows for it."""

    rank: int
    local_rank: int
    host: str
    pid: int
    #: ``cuda:N`` or ``cpu``
    device: str
    #: the torch.distributed backend (``gloo``, ``nccl``), None before it was set up
    backend: str | None
    #: ``ok`` while the default process group is up, else ``down``
    group: str
    #: the last cell this rank ran: ``{"cell", "state", "start"}``, None before the first
    last_cell: dict[str, Any] | None


class DebugReply(NamedTuple):
    """A rank's answer to one ``debug_command``: pdb's output, or why there is no pdb."""

    #: what pdb printed for the command
    out: str = ""
    #: the session is over (``continue``, ``quit``)
    done: bool = False
    #: nothing to debug on this rank (no failed cell since its last cell began)
    error: str | None = None
