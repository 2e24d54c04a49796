"""The panel's pin control (``hvdnb/notebook/panel/pins.py``) with a recording dummy
comm: it lists the run store's runs with their knobs and date, pins the selected ones to
the runs chart as ``%dist compare`` does, and says why when it cannot."""

from __future__ import annotations

import pytest

from hvdnb.notebook.metrics.store import MetricsStore

pytest.importorskip("ipywidgets")
pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    monkeypatch.setenv("HVDNB_HOME", str(h))
    return h


def _run(st: MetricsStore, cell: int, batch_size: int) -> str:
    st.knob_spec = {"batch_size": {"kind": "int", "min": 1, "max": 4096, "value": batch_size}}
    st.begin_cell(cell)
    for r in range(2):
        steps = list(range(10))
        cols = {"loss": [steps, [1000.0 + s for s in steps], [1.0 / (s + cell) for s in steps]]}
        st.ingest({"rank": r, "seq": 1, "pid": 100 + cell, "cols": cols})
    st.end_cell("done")
    return st.run_log.key(st.run_id)


def test_pin_control_lists_and_pins_runs_like_dist_compare(sent, home):
    from hvdnb.notebook.panel.charts import runs_chart
    from hvdnb.notebook.panel.layout import Panel

    st = MetricsStore(keep_runs=True)
    first, second = _run(st, 1, 16), _run(st, 2, 64)
    p = Panel(st, render_interval=0.0)
    pins = p.pins
    assert pins.box in p.box.children
    pins.pin.click()  # nothing selected: a note, nothing pinned
    p.render()
    assert "select runs in the list first" in pins.status.value
    assert st.pinned_curves() == []
    pins.list.click()
    assert pins.runs.options == ()  # the handler reads; the main thread's redraw shows
    p.render()
    labels = [o[0] for o in pins.runs.options]
    assert [o[1] for o in pins.runs.options] == [second, first]  # newest first
    assert labels[0].startswith(f"{second} (") and labels[0].endswith(
        "batch_size=64 · this session"
    )
    assert "2 runs in the run store" in pins.status.value
    pins.runs.value = (first,)
    pins.pin.click()
    p.render()
    assert f"pinned to the runs chart: {first}" in pins.status.value
    chart = runs_chart(st)
    pinned = [chart.lines[i] for i in chart.earlier]
    # the same label as the list's (which also says the run is this session's)
    assert [line[0] + " · this session" for line in pinned] == [labels[1]]
    pins.list.click()  # listing again keeps the selection
    p.render()
    assert pins.runs.value == (first,)
    pins.unpin.click()
    p.render()
    assert st.pinned_curves() == [] and "no earlier runs pinned" in pins.status.value
    st.run_log.store().delete([first])
    pins.pin.click()  # a run deleted since it was listed: refused, said
    p.render()
    assert f"refused: no run '{first}'" in pins.status.value
    assert st.pinned_curves() == []


def test_pin_control_without_a_run_store_says_so(sent, home):
    from hvdnb.notebook.panel.layout import Panel

    st = MetricsStore()  # keeps no runs on disk (tests, benches, hvdnb.metrics.load)
    p = Panel(st, render_interval=0.0)
    p.pins.list.click()
    p.render()
    assert p.pins.status.value.startswith("no run store:")
    assert p.pins.runs.options == ()
