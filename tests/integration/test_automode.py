"""``%dist auto on`` on a real 2-rank cluster, through a real IPython shell: every cell runs
on the ranks with ``%%distributed``'s behaviour; ``%dist`` lines and ``%%local`` cells run in
the notebook; an error does not end the mode; ``%dist auto off``, ``%autopx`` and ``%dist
stop`` end it, each with one line."""

from __future__ import annotations

import re

import pytest

import hvdnb
from hvdnb.notebook.cellout import automode

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


def test_auto_mode_runs_cells_on_the_ranks_until_it_ends(dist2, shell, capsys, monkeypatch):
    # a merge window (read by the notebook at each cell) far longer than any rank lags on a
    # loaded box: the line both ranks print is "[0,1] yes" however far apart they print it
    monkeypatch.setenv("HVDNB_COLLAPSE_WINDOW", "60")
    shell.run_line_magic("dist", "auto on")
    assert "auto mode on" in capsys.readouterr().out
    try:
        res = shell.run_cell(
            "import torch.distributed as d\nprint('rank', d.get_rank(), 'of', d.get_world_size())"
        )
        out = capsys.readouterr().out
        assert res.success, res.error_in_exec
        assert "[0] rank 0 of 2" in out and "[1] rank 1 of 2" in out, out
        # magics in an auto cell run on the ranks, as in a %%distributed cell
        res = shell.run_cell(
            "%env HVDNB_AUTO_PROBE=yes\nimport os\nprint(os.environ['HVDNB_AUTO_PROBE'])"
        )
        assert res.success and "[0,1] yes" in capsys.readouterr().out
        # an error names its rank and does not end the mode
        res = shell.run_cell(
            "import torch.distributed as d\nif d.get_rank() == 1:\n    raise ValueError('only on one')"
        )
        assert isinstance(res.error_in_exec, hvdnb.DistributedCellError)
        assert "rank 1 raised ValueError" in "\n".join(res.error_in_exec._render_traceback_())
        assert automode.enabled(shell)
        # %%local and %dist lines run in the notebook
        res = shell.run_cell("%%local\nlocal_value = 41 + 1")
        assert res.success and shell.user_ns["local_value"] == 42
        capsys.readouterr()
        res = shell.run_cell("%dist auto")
        assert res.success and "auto mode is on" in capsys.readouterr().out
        # the cells ran as %%distributed cells: they are in the export
        assert any("get_world_size" in c.code for c in dist2.history)
        # %autopx toggles the mode off (it would otherwise send %dist to the engines)
        res = shell.run_cell("%autopx")
        assert res.success and "auto mode off" in capsys.readouterr().out
        assert not automode.enabled(shell)
        res = shell.run_cell("plain = 'notebook'")
        assert res.success and shell.user_ns["plain"] == "notebook"
        # on again, then %dist auto off
        shell.run_line_magic("dist", "auto on")
        shell.run_line_magic("dist", "auto off")
        assert "auto mode off (`%dist auto off`)" in capsys.readouterr().out
    finally:
        automode.off(shell)


def test_auto_mode_refuses_bad_values_and_needs_a_cluster(shell):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="on or off"):
        shell.run_line_magic("dist", "auto maybe")


def test_help_on_a_name_only_the_ranks_have_comes_from_rank_0(dist2, shell, capsys, monkeypatch):
    # rank 0 answers within 0.5 s when idle; a loaded box (the suite's other lane) can take
    # longer, and then the notebook's own answer is given alone, by design
    monkeypatch.setattr("hvdnb.notebook.cellout.introspect.ANSWER_WITHIN", 30.0)
    shell.run_cell_magic(
        "distributed",
        "",
        "def rank_only_fn(alpha, beta=2):\n    'Defined on the ranks only.'\n    return alpha",
    )
    capsys.readouterr()
    res = shell.run_cell("rank_only_fn?")
    out = capsys.readouterr().out
    assert res.success, res.error_in_exec
    assert (
        "alpha, beta=2" in re.sub(r"\x1b\[[0-9;]*m", "", out)
        and "Defined on the ranks only." in out
    ), out


def test_dist_stop_ends_auto_mode(dist2, shell, capsys):
    shell.run_line_magic("dist", "auto on")
    capsys.readouterr()
    res = shell.run_cell("%dist stop")
    out = capsys.readouterr().out
    assert res.success and "auto mode off (%dist stop)" in out and "cluster stopped" in out, out
    assert not automode.enabled(shell)


def test_losing_a_rank_ends_auto_mode_naming_it(shell, capsys):
    import hvdnb

    shell.run_line_magic("dist", "start -n 2 --timeout 120")
    try:
        shell.run_line_magic("dist", "auto on")
        capsys.readouterr()
        res = shell.run_cell(
            "import os, signal, torch.distributed as d\n"
            "if d.get_rank() == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
            "d.barrier()"
        )
        out = capsys.readouterr().out
        assert isinstance(res.error_in_exec, hvdnb.DistributedCellError), res.error_in_exec
        assert "rank 1" in str(res.error_in_exec), str(res.error_in_exec)
        assert "auto mode off (a rank was lost)" in out, out
        assert not automode.enabled(shell)
    finally:
        automode.off(shell)
        c = hvdnb.current()
        if c is not None:
            c.stop()
