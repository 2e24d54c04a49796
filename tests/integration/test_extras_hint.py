"""A ``%%distributed`` cell that imports a missing optional module, on a real 2-rank cluster:
the error shown in the notebook names the command that installs it, once, and the cluster
goes on. The module is a fake entry of ``hvdnb.extras.OPTIONAL`` (surely not installed),
registered in the notebook kernel, where the error is rendered."""

from __future__ import annotations

import pytest

import hvdnb
from hvdnb import extras

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]

FAKE = "hvdnb_surely_missing_optional"


def test_a_missing_optional_module_in_a_distributed_cell_names_its_extra(
    dist2, shell, monkeypatch, capsys
):
    monkeypatch.setitem(
        extras.OPTIONAL, FAKE, extras.OptionalModule("tf", None, what="a test's fake")
    )
    with pytest.raises(hvdnb.DistributedCellError) as info:
        shell.run_cell_magic("distributed", "", f"import json\nimport {FAKE}.layers")
    text = "\n".join(info.value._render_traceback_())
    assert "ranks 0,1 raised ModuleNotFoundError" in text
    assert f"No module named '{FAKE}'" in text
    assert text.count(f"pip install {extras.pip_target('tf')}") == 1, text

    # as a notebook shows it: the cell run by the shell, the traceback printed
    capsys.readouterr()
    res = shell.run_cell(f"%%distributed\nimport {FAKE}")
    shown = "".join(capsys.readouterr())
    assert isinstance(res.error_in_exec, hvdnb.DistributedCellError)
    assert shown.count(f"pip install {extras.pip_target('tf')}") == 1, shown

    # a module hvdnb does not know: Python's error only
    with pytest.raises(hvdnb.DistributedCellError) as info:
        shell.run_cell_magic("distributed", "", "import not_in_the_table_zz")
    assert "pip install" not in "\n".join(info.value._render_traceback_())
    shell.run_cell_magic("distributed", "-q -o ok", "1 + 1")
    assert shell.user_ns["ok"] == {0: 2, 1: 2}
