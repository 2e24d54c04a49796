"""The executed copy of ``hvdnb run`` keeps the panel as its picture: the widget view goes
from the ``%dist start`` cell's outputs (nbconvert would draw it with a script from a CDN,
and offline it shows nothing), widgets the ranks made keep theirs."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")

VIEW = "application/vnd.jupyter.widget-view+json"
STATE = "application/vnd.jupyter.widget-state+json"


def _output(bundle: dict) -> dict:
    return {"output_type": "display_data", "data": dict(bundle), "metadata": {}}


def _executed(sent) -> tuple[dict, list[dict]]:
    """An executed notebook as nbclient saves it: the stand-in, the panel shown in a cell
    and a rank's progress bar, each with its widget state in the metadata."""
    import ipywidgets as w

    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel import Panel
    from hvdnb.notebook.panel.layout import _Stub

    p = Panel(MetricsStore())
    p._idle.stop()
    p._png = b"\x89PNG fake"
    stub = _Stub(p)
    bar = w.HBox([w.HTML("12%"), w.FloatProgress(0.12)])  # tqdm.notebook's, from a rank
    widgets = [stub.box, p.box, bar]
    state = {}
    for wid in widgets:
        state[wid.model_id] = {"model_name": "x", "state": wid.get_state()}
    outs = [_output(stub._repr_mimebundle_()), _output(p._repr_mimebundle_())]
    outs.append(_output({**bar._repr_mimebundle_(), "text/plain": "12%"}))
    nb = {
        "cells": [
            {"cell_type": "code", "outputs": outs[:2]},
            {"cell_type": "code", "outputs": outs[2:]},
        ],
        "metadata": {"widgets": {STATE: {"state": state}}},
    }
    return nb, outs


def test_the_panel_and_its_stand_in_keep_their_picture_a_ranks_widget_its_view(sent):
    from hvdnb.notebook.headless.runner import static_panel

    nb, (stub, panel, bar) = _executed(sent)
    assert all(VIEW in o["data"] for o in (stub, panel, bar))
    assert static_panel(nb) == 2
    assert VIEW not in stub["data"] and VIEW not in panel["data"]
    # what static renderers then draw: the picture, and the stand-in's words
    assert stub["data"]["image/png"] and "<img" in stub["data"]["text/html"]
    assert panel["data"]["image/png"]
    assert VIEW in bar["data"]  # a rank's widget is the rank's: untouched
    assert static_panel(nb) == 0  # once


def test_the_saved_picture_never_says_the_panel_is_beside_the_notebook(sent):
    _, (stub, _, _) = _executed(sent)
    assert "beside" not in stub["data"]["text/html"]


def test_a_notebook_without_widget_state_is_left_as_it_is():
    from hvdnb.notebook.headless.runner import static_panel

    out = _output({VIEW: {"model_id": "m1"}, "image/png": "AAAA", "text/plain": "x"})
    nb = {"cells": [{"cell_type": "code", "outputs": [out]}], "metadata": {}}
    assert static_panel(nb) == 0 and VIEW in out["data"]
