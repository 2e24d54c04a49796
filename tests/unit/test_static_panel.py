"""What the saved ``%dist start`` cell says without a kernel."""

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


def test_the_saved_picture_never_says_the_panel_is_beside_the_notebook(sent):
    _, (stub, _, _) = _executed(sent)
    assert "beside" not in stub["data"]["text/html"]
