"""hvdnb's Jupyter server extension: a cell's output outlives the page that ran it.

A plain kernel's output reaches only the page that asked for the cell: reload that page,
or close it, and what the cell prints from then on is lost to the notebook (JupyterLab
drops messages answering a request it no longer knows). With hvdnb's ``durable`` extra,
the server keeps its own copy of each open notebook (``jupyter-collaboration``), which
every page draws and the server saves; the page runs cells as usual (its outputs are
trusted, so widgets draw), and when it leaves while a cell runs, the server writes the
rest of that cell's output into the shared copy (:mod:`hvdnb.server.takeover`), with
``jupyter-server-nbmodel``'s output hook. A reloaded page, a second tab, or a browser
opened after the cell ended all show the whole output. (nbmodel's own page executor,
which runs every cell from the server, is turned off: its outputs reach the page
untrusted, and then no widget in a cell draws.)

nbmodel's hook writes streams, displays, results and errors, but drops
``update_display_data`` (it leaves it as a FIXME). hvdnb draws in place with it: the
live line under a training cell, the ranks' progress bars, the picture of the run at the
cell's end. :func:`with_display_updates` wraps the hook so that an update replaces the
output that the same ``display_id`` displayed.

How it writes the update matters. A page applies a change of the shared outputs as
"remove these, then *append* those" (JupyterLab 4's code cell model appends every
inserted output at the end, and appends stream text to the last output), so replacing one
output in the middle would move it to the bottom on every page, and send the next
printed line into it. An update therefore rewrites the outputs from the updated one to
the end, in one transaction: removed, then appended again in their order, the updated
one changed. That costs the tail's size per update, so updates to outputs before the
last are written at most every :data:`REWRITE_EVERY` seconds (the newest one wins; the
last one is always written, at most that long after it came). An update to the last
output costs one output.

Owns: that wrapper and the take-over, put in when the server loads this extension
(enabled by the file ``jupyter-config/hvdnb-server.json``), and keeping a notebook's
shared copy in the server while no page has it open (``_link_jupyter_server_extension``).
Never: anything when nbmodel is not installed, or is a release whose hook has another
signature (one warning, and the server runs as without hvdnb).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

__all__ = ["REWRITE_EVERY", "with_display_updates"]

#: the parameters of the nbmodel hook this wraps (jupyter-server-nbmodel 0.2)
HOOK_PARAMETERS = ("outputs", "ycell", "stream_state", "msg")

#: seconds between two rewrites of a cell's outputs for in-place updates above the last
#: output (hvdnb's live line updates every 0.25 s; a page shows it at this pace)
REWRITE_EVERY = 0.5

Hook = Callable[[list[Any], Any, Any, dict[str, Any]], None]


#: how many display ids the server remembers, newest kept (an update may name a display of
#: an earlier cell: hvdnb puts a training cell's picture in with the next cell's messages)
REMEMBERED = 4096


class _Execution:
    """What one execution's updates need: its outputs and shared cell, and the updates not
    yet written into that cell."""

    def __init__(self, outputs: list[Any], ycell: Any) -> None:
        self.outputs = outputs
        self.ycell = ycell
        #: index in the shared cell -> the data and metadata written there last (a rewrite
        #: only touches an output that still holds them: a page may have cleared the cell)
        self.known: dict[int, dict[str, Any]] = {}
        #: index in the shared cell -> the output to write there at the next rewrite
        self.pending: dict[int, dict[str, Any]] = {}
        self.last_rewrite = 0.0
        self.timer: asyncio.TimerHandle | None = None


def with_display_updates(hook: Hook, every: float = REWRITE_EVERY) -> Hook:
    """nbmodel's output ``hook`` that also applies ``update_display_data``.

    It remembers where each ``display_data`` carrying a ``display_id`` landed (the
    execution's ``outputs`` and its shared cell; nbmodel makes one ``stream_state`` object
    per execution), and an update with that id, from this execution or a later one,
    replaces those outputs' data and metadata, as the messaging protocol says of display
    ids. An update for an id never displayed here changes nothing; a ``clear_output``
    forgets the places of the cell it cleared. Updates above the last output are written
    at most every ``every`` seconds (module docstring); with no event loop running, at
    once.
    """
    #: display id -> [(execution, index in its outputs, index in its shared cell)]
    places: OrderedDict[str, list[tuple[_Execution, int, int]]] = OrderedDict()

    def apply(outputs: list[Any], ycell: Any, stream_state: Any, msg: dict[str, Any]) -> None:
        kind = msg["header"]["msg_type"]
        content = msg.get("content") or {}
        display_id = (content.get("transient") or {}).get("display_id")
        # kept on the execution's own state object (a dataclass, unhashable), so it goes
        # when the execution and the displays it made do
        run: _Execution | None = stream_state.__dict__.get("_hvdnb_displays")
        if run is None:
            run = stream_state.__dict__["_hvdnb_displays"] = _Execution(outputs, ycell)
        if kind == "update_display_data":
            for owner, in_outputs, in_cell in places.get(display_id or "", ()):
                _update(owner, in_outputs, in_cell, content, every)
            return
        hook(outputs, ycell, stream_state, msg)
        if kind == "clear_output":
            run.known.clear()
            run.pending.clear()
            for did in [d for d, at in places.items() if any(r is run for r, _, _ in at)]:
                places[did] = [p for p in places[did] if p[0] is not run]
        elif kind == "display_data" and display_id:
            in_cell = len(ycell["outputs"]) - 1 if ycell is not None else -1
            places.setdefault(display_id, []).append((run, len(outputs) - 1, in_cell))
            places.move_to_end(display_id)
            while len(places) > REMEMBERED:
                places.popitem(last=False)
            run.known[in_cell] = _shown(content)

    apply.__wrapped__ = hook  # type: ignore[attr-defined]
    apply.places = places  # type: ignore[attr-defined]  # read by hvdnb.server.takeover
    return apply


def _shown(content: dict[str, Any]) -> dict[str, Any]:
    return {
        "output_type": "display_data",
        "data": dict(content.get("data") or {}),
        "metadata": dict(content.get("metadata") or {}),
    }


def _update(
    run: _Execution, in_outputs: int, in_cell: int, content: dict[str, Any], every: float
) -> None:
    import nbformat  # noqa: PLC0415  a server's import, not the kernel's

    new = _shown(content)
    if 0 <= in_outputs < len(run.outputs):
        run.outputs[in_outputs] = nbformat.from_dict(new)
    ycell = run.ycell
    if ycell is None or in_cell < 0:
        return
    run.pending[in_cell] = new
    last = len(ycell["outputs"]) - 1
    due = time.monotonic() - run.last_rewrite >= every or set(run.pending) == {last}
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if due or loop is None:
        _rewrite(run, ycell)
    elif run.timer is None:
        wait = max(0.0, run.last_rewrite + every - time.monotonic())
        run.timer = loop.call_later(wait, _rewrite, run, ycell)


def _rewrite(run: _Execution, ycell: Any) -> None:
    """Write the pending updates: the shared outputs from the first updated one to the end
    are removed and appended again, in order, in one transaction (module docstring)."""
    from pycrdt import Map, Text  # noqa: PLC0415  installed with nbmodel

    if run.timer is not None:
        run.timer.cancel()
        run.timer = None
    pending, run.pending = run.pending, {}
    cell_outputs = ycell["outputs"]
    n = len(cell_outputs)
    valid = {}
    for at, new in pending.items():
        if at >= n:
            continue
        old = cell_outputs[at]
        seen = old.to_py() if hasattr(old, "to_py") else old
        if seen == run.known.get(at):  # still what this execution wrote there
            valid[at] = new
    if not valid:
        return
    first = min(valid)
    tail = []
    for at in range(first, n):
        old = cell_outputs[at]
        tail.append(valid.get(at) or (old.to_py() if hasattr(old, "to_py") else dict(old)))
    with cell_outputs.doc.transaction():
        del cell_outputs[first:n]
        for out in tail:
            if out.get("output_type") == "stream":
                # as nbmodel writes a stream: its text a shared Text, which it appends to
                out = dict(out)
                out["text"] = Text(str(out.get("text", "")))
                cell_outputs.append(Map(out))
            else:
                cell_outputs.append(out)
    run.known.update(valid)
    run.last_rewrite = time.monotonic()


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "hvdnb.server"}]


def _link_jupyter_server_extension(serverapp: Any) -> None:
    """Keep a notebook's shared copy while no page has it open.

    jupyter-collaboration drops a document from the server's memory 60 s after its last
    page closed (``YDocExtension.document_cleanup_delay``); nbmodel goes on writing a
    running cell's output into the dropped copy, which nothing saves, so a cell that
    trains on with the browser closed for a minute loses the rest of its output. hvdnb
    keeps the documents (``None``: never dropped while the server runs) unless the
    user's configuration says otherwise. Extensions are linked in name order, so this
    runs before jupyter_server_ydoc reads the server's configuration.
    """
    ydoc = serverapp.config.YDocExtension
    if "document_cleanup_delay" not in ydoc:
        ydoc.document_cleanup_delay = None


def _load_jupyter_server_extension(serverapp: Any) -> None:
    try:
        from jupyter_server_nbmodel import actions  # noqa: PLC0415  optional (durable extra)
    except ImportError:
        return
    hook = actions._output_hook
    if getattr(hook, "__wrapped__", None) is not None:  # loaded twice
        return
    got = tuple(inspect.signature(hook).parameters)
    if got != HOOK_PARAMETERS:
        serverapp.log.warning(
            "hvdnb: jupyter-server-nbmodel's output hook takes %s, not %s: in-place updates "
            "(the live line, progress bars) are drawn only at a page that ran the cell. "
            "Install the release hvdnb's durable extra names: pip install 'hvdnb[durable]'",
            got,
            HOOK_PARAMETERS,
        )
        return
    actions._output_hook = with_display_updates(hook)
    from hvdnb.server import takeover  # noqa: PLC0415  loaded with the extension only

    serverapp.web_app.settings["hvdnb_takeover"] = takeover.install(serverapp, actions._output_hook)
    serverapp.log.info(
        "hvdnb: a running cell's output is written by the server once its page leaves"
    )
