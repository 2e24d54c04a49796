"""Target parsing and error merging, with no processes."""

from __future__ import annotations

import pytest

from hvdnb.notebook.cellout.cells import CellResult, DistributedCellError, parse_targets


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


def test_output_past_the_limit_goes_to_a_file_with_head_tail_and_one_note(tmp_path, capsys):
    """A cell printing more than a browser tab should hold: the notebook gets the first
    ``limit`` bytes, one note naming the file, and the last lines; the file has all of it,
    in order, the shown part included."""
    from hvdnb.notebook.cellout.streaming import Streamer

    spill = tmp_path / "output" / "cell7.txt"
    s = Streamer([0, 1], window=10.0, limit=2000, spill=str(spill), tail=5)
    lines = [f"step {i} loss 0.5\n" for i in range(1000)]
    for chunk in range(0, 1000, 100):  # both ranks print the same lines, in chunks
        for r in (0, 1):
            s.receive(r, "stream", {"name": "stdout", "text": "".join(lines[chunk : chunk + 100])})
        s.pump()
    s.pump(final=True)
    out = capsys.readouterr().out
    head, _note, tail = out.partition("hvdnb: this cell's output passed")
    assert len(head) <= 2000 and head.startswith("[0,1] step 0 loss 0.5\n")
    assert f"The whole output is in {spill}" in tail
    assert tail.splitlines()[1:] == [f"[0,1] step {i} loss 0.5" for i in range(995, 1000)]
    assert spill.read_text() == "".join(f"[0,1] {line}" for line in lines)
    assert out.count("hvdnb: this cell's output passed") == 1


def test_output_under_the_limit_writes_no_file(tmp_path, capsys):
    from hvdnb.notebook.cellout.streaming import Streamer

    s = Streamer([0], window=0.0, limit=2000, spill=str(tmp_path / "x.txt"))
    s.receive(0, "stream", {"name": "stdout", "text": "a\n"})
    s.pump(final=True)
    assert capsys.readouterr().out == "[0] a\n" and not (tmp_path / "x.txt").exists()
