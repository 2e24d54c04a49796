"""The functions the notebook runs on ranks through ipyparallel, named rather than imported.

The notebook kernel sends a cell with ``view.apply(RUN_CELL, ...)``. Importing the rank's
engine module into the notebook to pickle its function would tie the two sides together;
a ``RemoteCall`` names the function instead (``module:attribute``), pickles as that name
(a few dozen bytes, once), and imports it on the rank when first called there.

What each call returns is a typed reply in ``hvdnb.protocol.replies`` (``RUN_CELL`` gives a
``CellReply``, and so on), named beside each call below.

Owns: the names of the rank-side entry points. Never: import the rank side here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Final

__all__ = [
    "COMPLETE",
    "COMPLETER_PREWARM",
    "CONNECT_CHANNEL",
    "DEBUG_COMMAND",
    "ENGINE_INFO",
    "INSPECT",
    "JOIN_CELL",
    "REBUILD_GROUP",
    "RUN_CELL",
    "RemoteCall",
]


class RemoteCall:
    """A callable that stands for ``module.attribute``; resolved where it is called.

    Parameters
    ----------
    target : ``"package.module:function"``
    """

    __slots__ = ("_fn", "target")

    def __init__(self, target: str) -> None:
        module, sep, attr = target.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"a remote call names 'module:function', not {target!r}")
        self.target = target
        self._fn: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._fn
        if fn is None:
            module, _, attr = self.target.partition(":")
            fn = self._fn = getattr(importlib.import_module(module), attr)
        return fn(*args, **kwargs)

    def __reduce__(self) -> tuple[type[RemoteCall], tuple[str]]:
        return (RemoteCall, (self.target,))

    def __repr__(self) -> str:
        return f"RemoteCall({self.target!r})"


#: run one cell on a rank (``hvdnb.rank.engine.run_cell``); returns a ``replies.CellReply``
RUN_CELL: Final = RemoteCall("hvdnb.rank.engine:run_cell")
#: rebuild the default process group after a failed cell (collective); returns None
REBUILD_GROUP: Final = RemoteCall("hvdnb.rank.engine:rebuild_group")
#: bring an idle rank of an elastic cluster to the notebook's generation (generation, members)
ELASTIC_REJOIN: Final = RemoteCall("hvdnb.rank.engine:elastic_rejoin")
#: a rank started while a cell trains joins the generation, then runs the cell (generation,
#: members, code, cell number); returns a ``replies.CellReply``
JOIN_CELL: Final = RemoteCall("hvdnb.rank.engine:join_cell")
#: a rank's host, pid, device and state, for ``%dist status``; returns a ``replies.EngineInfo``
ENGINE_INFO: Final = RemoteCall("hvdnb.rank.engine:engine_info")
#: connect the rank's side channel now (``%dist start`` returns once every rank has); None
CONNECT_CHANNEL: Final = RemoteCall("hvdnb.rank.engine:connect_channel")
#: one command for pdb on the frames of a rank's last failed cell; a ``replies.DebugReply``
DEBUG_COMMAND: Final = RemoteCall("hvdnb.rank.debugger:debug_command")
#: IPython's completions of a cell at a cursor, on the rank; a list of (text, start, end, type)
COMPLETE: Final = RemoteCall("hvdnb.rank.introspect:complete")
#: a name's inspection (signature, docstring) on the rank; a mime bundle or None
INSPECT: Final = RemoteCall("hvdnb.rank.introspect:inspect")
#: load the rank's completer in a thread of its own (returns at once); None
COMPLETER_PREWARM: Final = RemoteCall("hvdnb.rank.introspect:prewarm")
