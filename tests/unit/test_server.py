"""hvdnb.server on jupyter-server-nbmodel's own output hook and a real shared notebook
(jupyter_ydoc, pycrdt): what the server's copy holds, and what a page that applies its
changes as JupyterLab 4 does draws.

The page model below follows JupyterLab 4.6's ``CodeCellModel._onSharedModelChanged``
(packages/cells/src/model.ts): a change of the outputs array is read as retain / delete
at the index reached / insert **appended at the end**, and a stream's text change is
appended to the last output. The browser test (tests/browser/test_page_browser.py) checks
the same in a real page.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip(
    "jupyter_server_nbmodel", reason="the durable extra: pip install hvdnb[durable]"
)

from jupyter_server_nbmodel import actions
from jupyter_ydoc import YNotebook

from hvdnb import server

ORIGINAL = getattr(actions._output_hook, "__wrapped__", actions._output_hook)


def _cell() -> Any:
    nb = YNotebook()
    nb.set(
        {
            "cells": [
                {
                    "cell_type": "code",
                    "id": "c1",
                    "source": "train()",
                    "metadata": {},
                    "outputs": [],
                    "execution_count": None,
                }
            ],
            "metadata": {},
            "nbformat": 4,
            "nbformat_minor": 5,
        }
    )
    return nb.ycells[0]


class Page:
    """What a JupyterLab 4 page draws from the shared cell's changes (module docstring)."""

    def __init__(self, ycell: Any) -> None:
        self.outputs: list[dict[str, Any]] = []
        self._subscription = ycell["outputs"].observe_deep(self._changed)

    def _changed(self, events: Any) -> None:
        for ev in events:
            path = list(ev.path)
            if len(path) == 2 and path[1] == "text":  # a stream's text
                for d in ev.delta:
                    if "delete" in d:
                        self.outputs[-1]["text"] = self.outputs[-1]["text"][: -d["delete"]]
                    if "insert" in d:
                        self.outputs[-1]["text"] += str(d["insert"])
            elif not path:  # the array itself
                at = 0
                for d in ev.delta:
                    if "retain" in d:
                        at += d["retain"]
                    if "delete" in d:
                        del self.outputs[at : at + d["delete"]]
                    for item in d.get("insert", ()):
                        self.outputs.append(item.to_py() if hasattr(item, "to_py") else item)

    def texts(self) -> list[str]:
        return [
            o["text"] if o["output_type"] == "stream" else o["data"]["text/plain"]
            for o in self.outputs
        ]


def _msg(kind: str, **content: Any) -> dict[str, Any]:
    return {"header": {"msg_type": kind}, "parent_header": {}, "metadata": {}, "content": content}


def _display(text: str, did: str | None = None, update: bool = False) -> dict[str, Any]:
    return _msg(
        "update_display_data" if update else "display_data",
        data={"text/plain": text},
        metadata={},
        transient={"display_id": did} if did else {},
    )


def _stream(text: str) -> dict[str, Any]:
    return _msg("stream", name="stdout", text=text)


def _shared(ycell: Any) -> list[str]:
    out = []
    for o in ycell["outputs"]:
        o = o.to_py() if hasattr(o, "to_py") else o
        out.append(o["text"] if o["output_type"] == "stream" else o["data"]["text/plain"])
    return out


def _run(messages: list[dict[str, Any]], every: float = 0.0) -> tuple[Any, Page, list[Any]]:
    ycell = _cell()
    page = Page(ycell)
    hook = server.with_display_updates(ORIGINAL, every=every)
    outputs: list[Any] = []
    state = actions._StreamState()
    for m in messages:
        hook(outputs, ycell, state, m)
    return ycell, page, outputs


TRAINING = [
    _stream("[0,1] step 0\n"),
    _display("run 1 · step 1", "line"),
    _stream("[0,1] step 10\n"),
    _display("run 1 · step 11", "line", update=True),
    _stream("[0,1] step 20\n"),
    _display("run 1 · step 21", "line", update=True),
    _display("run 1 done · step 30", "line", update=True),
    _stream("[0,1] done\n"),
]


def test_nbmodel_as_shipped_drops_the_update():
    """The gap this extension fills: the live line stays at its first state."""
    ycell = _cell()
    outputs: list[Any] = []
    state = actions._StreamState()
    for m in TRAINING:
        ORIGINAL(outputs, ycell, state, m)
    assert "run 1 · step 1" in _shared(ycell)
    assert "run 1 done · step 30" not in _shared(ycell)


def test_an_update_above_the_last_output_is_drawn_in_place_on_the_page_and_in_the_file():
    ycell, page, outputs = _run(TRAINING)
    want = ["[0,1] step 0\n", "run 1 done · step 30", "[0,1] step 10\n[0,1] step 20\n[0,1] done\n"]
    assert _shared(ycell) == want  # the server's copy, which it saves
    assert page.texts() == want  # what the page draws: the line in its place
    assert [o["data"]["text/plain"] for o in outputs if "data" in o] == ["run 1 done · step 30"]


def test_an_update_of_the_last_output_and_an_unknown_id():
    msgs = [
        _stream("a\n"),
        _display("bar 0%", "bar"),
        _display("bar 50%", "bar", update=True),
        _display("elsewhere", "not-this-cell", update=True),
        _display("bar 100%", "bar", update=True),
    ]
    ycell, page, _ = _run(msgs)
    assert _shared(ycell) == ["a\n", "bar 100%"]
    assert page.texts() == ["a\n", "bar 100%"]


def test_two_displays_updated_in_turn_keep_their_order():
    """The ranks' bars: one display each, updated alternately."""
    msgs = [_display("r0 0%", "r0"), _display("r1 0%", "r1"), _stream("x\n")]
    for pct in (10, 20, 30):
        msgs += [_display(f"r0 {pct}%", "r0", update=True), _display(f"r1 {pct}%", "r1", True)]
    ycell, page, _ = _run(msgs)
    assert _shared(ycell) == ["r0 30%", "r1 30%", "x\n"]
    assert page.texts() == ["r0 30%", "r1 30%", "x\n"]


def test_a_stream_after_a_rewrite_keeps_growing_the_same_output():
    msgs = [_display("l 1", "l"), _stream("a\n"), _display("l 2", "l", update=True)]
    msgs += [_stream("b\n"), _stream("c\n")]
    ycell, page, _ = _run(msgs)
    assert _shared(ycell) == ["l 2", "a\nb\nc\n"]
    assert page.texts() == ["l 2", "a\nb\nc\n"]


def test_a_later_execution_updates_an_earlier_cells_display():
    """hvdnb puts a training cell's picture under its line with the next cell's messages;
    the protocol applies a display id's update wherever it was displayed."""
    first, second = _cell(), _cell()
    page = Page(first)
    hook = server.with_display_updates(ORIGINAL, every=0.0)
    state1, state2 = actions._StreamState(), actions._StreamState()
    for m in (_display("run 1 · step 5", "line"), _stream("[0,1] done\n")):
        hook([], first, state1, m)
    hook([], second, state2, _display("run 1 done + picture", "line", update=True))
    hook([], second, state2, _stream("next cell\n"))
    assert _shared(first) == ["run 1 done + picture", "[0,1] done\n"]
    assert page.texts() == _shared(first)
    assert _shared(second) == ["next cell\n"]


def test_clear_output_forgets_the_places():
    msgs = [_display("l 1", "l"), _msg("clear_output", wait=False), _display("l 2", "l", True)]
    msgs += [_stream("after\n")]
    ycell, page, _ = _run(msgs)
    assert _shared(ycell) == ["after\n"]
    assert page.texts() == ["after\n"]


def test_a_page_that_cleared_the_cell_is_not_written_over():
    ycell = _cell()
    hook = server.with_display_updates(ORIGINAL, every=0.0)
    outputs: list[Any] = []
    state = actions._StreamState()
    for m in (_display("l 1", "l"), _stream("a\n")):
        hook(outputs, ycell, state, m)
    del ycell["outputs"][:]  # the person cleared the outputs meanwhile
    ycell["outputs"].append(
        {"output_type": "display_data", "data": {"text/plain": "other"}, "metadata": {}}
    )
    hook(outputs, ycell, state, _display("l 2", "l", update=True))
    assert _shared(ycell) == ["other"]


def test_updates_above_the_last_are_spaced_and_the_last_one_is_written():
    """Under an event loop, rewrites of the tail come at most every ``every`` seconds, and
    the newest pending update is written when the time comes, with no message after it."""

    async def main() -> tuple[list[str], list[str], list[str]]:
        ycell = _cell()
        page = Page(ycell)
        hook = server.with_display_updates(ORIGINAL, every=0.3)
        outputs: list[Any] = []
        state = actions._StreamState()
        for m in (_display("l 0", "l"), _stream("a\n")):
            hook(outputs, ycell, state, m)
        for i in range(1, 6):
            hook(outputs, ycell, state, _display(f"l {i}", "l", update=True))
        soon = _shared(ycell)
        await asyncio.sleep(0.6)
        return soon, _shared(ycell), page.texts()

    soon, later, page = asyncio.run(main())
    assert soon == ["l 1", "a\n"]  # the first went at once; the next four waited
    assert later == ["l 5", "a\n"] and page == later  # ... and the newest was written


def test_the_server_loads_the_wrapper_once():
    from jupyter_server.services.kernels.connection.channels import (
        ZMQChannelsWebsocketConnection as Connection,
    )

    class App:
        class web_app:
            settings: dict[str, Any] = {}

        class log:
            @staticmethod
            def info(*a: Any) -> None: ...

            @staticmethod
            def warning(*a: Any) -> None:
                raise AssertionError(a)

    saved = actions._output_hook
    methods = {
        m: getattr(Connection, m) for m in ("handle_incoming_message", "connect", "disconnect")
    }
    try:
        actions._output_hook = ORIGINAL
        server._load_jupyter_server_extension(App())
        server._load_jupyter_server_extension(App())
        assert actions._output_hook.__wrapped__ is ORIGINAL
        assert App.web_app.settings["hvdnb_takeover"].hook is actions._output_hook
    finally:
        actions._output_hook = saved
        for name, method in methods.items():
            setattr(Connection, name, method)


class NotebookPage:
    """A page's cells: a cell the server deletes and inserts again is drawn afresh from
    the inserted copy (JupyterLab makes a new cell model for it)."""

    def __init__(self, nb: YNotebook) -> None:
        self.nb = nb
        self.page = Page(nb.ycells[0])
        self._subscription = nb.ycells.observe(self._cells_changed)

    def _cells_changed(self, event: Any) -> None:
        for d in event.delta:
            for item in d.get("insert", ()):
                self.page = Page(item)
                self.page.outputs = [
                    o.to_py() if hasattr(o, "to_py") else o for o in item["outputs"]
                ]


def test_the_take_over_puts_a_fresh_copy_of_the_cell_in_its_place():
    """The two-tab gap: a tab that stayed open while the tab that ran the cell left kept a
    stale live line above the server's. Its copy of the outputs had drifted while the
    first tab updated displays in place (JupyterLab 4 sends "remove at i, insert at i",
    which the other pages apply as "remove at i, append"). The take-over now deletes the
    cell and inserts a new copy, which every page draws from the server's copy alone."""
    from pycrdt import Map, Text

    from hvdnb.server.takeover import rebuilt_cell

    ycell = _cell()
    nb = YNotebook(ycell.doc)
    b = NotebookPage(nb)
    before = b.page
    outputs = ycell["outputs"]
    line = {"output_type": "display_data", "data": {"text/plain": "run 1 · step 1"}}
    outputs.append(Map({"output_type": "stream", "name": "stdout", "text": Text("step 0\n")}))
    outputs.append({**line, "metadata": {}})
    outputs.append(Map({"output_type": "stream", "name": "stdout", "text": Text("step 10\n")}))
    with ycell.doc.transaction():  # tab A updates the live line in place, as JupyterLab does
        del outputs[1]
        outputs.insert(1, {**line, "data": {"text/plain": "run 1 · step 11"}, "metadata": {}})
    assert b.page.texts() != _shared(ycell)  # tab B's copy drifted: the line went last
    fresh = rebuilt_cell(nb, "c1", execution_count=3)
    assert b.page is not before  # tab B draws a new cell, from the server's copy
    assert b.page.outputs == [] and len(nb.ycells) == 1 and nb.ycells[0]["id"] == "c1"
    assert fresh["execution_state"] == "running" and fresh["execution_count"] == 3
    assert fresh["source"].to_py() == "train()"
    hook = server.with_display_updates(ORIGINAL, every=0.0)
    state, written = actions._StreamState(), []
    for m in TRAINING:
        hook(written, fresh, state, m)
    assert b.page.texts() == _shared(fresh), (b.page.texts(), _shared(fresh))
    assert _shared(fresh)[1] == "run 1 done · step 30"  # the live line, in its place
    assert rebuilt_cell(nb, "no-such-cell", None) is None
