"""Target parsing and error merging, with no processes."""

from __future__ import annotations

import pytest

from hvdnb.notebook.cells import CellResult, DistributedCellError, parse_targets


@pytest.mark.parametrize(
    "spec, ranks",
    [
        (None, [0, 1, 2, 3]),
        ("all", [0, 1, 2, 3]),
        ("0", [0]),
        ("0,2", [0, 2]),
        ("::2", [0, 2]),
        ("1:3", [1, 2]),
        (3, [3]),
        ([2, 1], [1, 2]),
    ],
)
def test_parse_targets(spec, ranks):
    assert parse_targets(spec, [0, 1, 2, 3]) == ranks


@pytest.mark.parametrize("spec", ["7", "0,9", "x", "1:2:3:4", "5:"])
def test_bad_targets_name_the_problem(spec):
    with pytest.raises(ValueError, match="--targets"):
        parse_targets(spec, [0, 1, 2, 3])


def _err(ename, evalue, tb='Traceback:\n  File "<cell 1>", line 1\n'):
    return {"ename": ename, "evalue": evalue, "traceback": tb + f"{ename}: {evalue}\n"}


def test_same_error_on_all_ranks_is_shown_once_with_its_ranks():
    res = CellResult(cell=1, ranks=[0, 1, 2])
    res.errors = {r: _err("NameError", "name 'x' is not defined") for r in range(3)}
    text = "\n".join(DistributedCellError(res)._render_traceback_())
    assert text.count("NameError: name 'x' is not defined") == 1
    assert "ranks 0-2 raised NameError" in text


def test_root_cause_first_and_released_peers_summarised():
    res = CellResult(cell=1, ranks=[0, 1])
    res.errors = {
        1: _err("RuntimeError", "[pair.cc:553] Connection closed by peer [127.0.0.1]:1"),
        0: _err("ZeroDivisionError", "division by zero"),
    }
    exc = DistributedCellError(res)
    lines = exc._render_traceback_()
    assert lines[0] == "--- rank 0 raised ZeroDivisionError ---"
    assert any("released because rank 0 failed" in ln for ln in lines)
    assert exc.failed_ranks == [0, 1]
    assert str(exc).startswith("--- rank 0")
