"""The framework room's pieces that need no cluster: the version warning, the one-line
notes, Lightning's entry point outside a rank, the install hint, and the panel's line for
a loss logged on the main process only (the HF Trainer's). The frameworks' real code on a
real cluster: tests/integration/test_frameworks.py."""

from __future__ import annotations

import pytest

from hvdnb.extras import pip_target
from hvdnb.rank.frameworks import common


def test_a_version_outside_the_tested_range_warns_once(monkeypatch, capsys):
    from importlib.metadata import version

    pytest.importorskip("accelerate")
    monkeypatch.setattr(common, "_WARNED", set())
    monkeypatch.setitem(common.TESTED, "accelerate", ("0.1", "0.2"))
    common.warn_version("accelerate")
    common.warn_version("accelerate")
    err = capsys.readouterr().err
    assert err.count("hvdnb: accelerate") == 1, err
    assert f"accelerate {version('accelerate')} is installed" in err and ">=0.1,<0.2" in err
    assert f"pip install {pip_target('frameworks')}" in err
    monkeypatch.setitem(common.TESTED, "accelerate", ("0", "999"))  # inside: nothing said
    monkeypatch.setattr(common, "_WARNED", set())
    common.warn_version("accelerate")
    assert capsys.readouterr().err == ""


def test_the_tested_ranges_are_the_extras_pins():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    pins = set(extra["frameworks"])
    assert pins == {f"{d}>={lo},<{hi}" for d, (lo, hi) in common.TESTED.items()}


def test_a_note_is_said_once_per_cell(monkeypatch, capsys):
    monkeypatch.setattr(common, "_SAID", set())
    common.note("kept the group")
    common.note("kept the group")
    common.note("another")
    assert capsys.readouterr().out.splitlines() == ["hvdnb: kept the group", "hvdnb: another"]
    common.new_cell()
    common.note("kept the group")
    assert capsys.readouterr().out == "hvdnb: kept the group\n"


def test_lightnings_entry_point_adds_nothing_outside_a_rank():
    """Installed with the package, so Lightning calls it in every Trainer of every
    process: outside an hvdnb rank it must return no callback."""
    pytest.importorskip("lightning")
    from lightning.fabric.utilities.registry import _load_external_callbacks

    assert common.installed() is None
    assert _load_external_callbacks("lightning.pytorch.callbacks_factory") == []
    assert _load_external_callbacks("pytorch_lightning.callbacks_factory") == []


@pytest.mark.parametrize("module", ["accelerate", "transformers", "lightning", "pytorch_lightning"])
def test_a_missing_framework_names_the_extra(module):
    from hvdnb.extras import hint_for_error

    line = hint_for_error("ModuleNotFoundError", f"No module named '{module}'")
    assert line is not None and f"pip install {pip_target('frameworks')}" in line


def _ingest(st, rank: int, seq: int, cols: dict) -> None:
    st.ingest({"rank": rank, "seq": seq, "pid": 1, "step": 9, "cols": cols})


def test_a_loss_logged_on_the_main_process_only_is_drawn_as_one_line():
    """The HF Trainer logs the mean over ranks on rank 0 (``loss_main``): the loss chart
    draws it as "main process" and the runs chart takes it as the run's curve; a rank's
    own ``loss`` wins where there is one."""
    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel.charts import loss_chart
    from hvdnb.protocol.kinds import MAIN_LOSS

    st = MetricsStore()
    steps = list(range(10))
    t = [1000.0 + s for s in steps]
    _ingest(st, 0, 1, {MAIN_LOSS: [steps, t, [2.0 - s / 10 for s in steps]]})
    _ingest(st, 1, 1, {"time/step": [steps, t, [0.01] * 10]})
    chart = loss_chart(st)
    assert [lab for lab, _, _ in chart.lines] == ["main process"]
    assert chart.lines[0][2][0] == 2.0 and chart.lines[0][1][-1] == 9
    (curve,) = st.run_curves()
    assert curve["ys"][0] == 2.0 and len(curve["ys"]) == 10
    _ingest(st, 1, 2, {"loss": [steps, t, [5.0] * 10]})
    assert [lab for lab, _, _ in loss_chart(st).lines] == ["rank 1"]
