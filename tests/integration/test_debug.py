"""Debugging a distributed cell on a real 2-rank cluster: post-mortem per rank
(``%dist debug``), live stacks of every rank during a deliberate deadlock (``%dist where``,
py-spy and the ranks' own report), tracebacks with the user's frames only, ``%dist status``
after a rank died, and one clear message per bad argument."""

from __future__ import annotations

import builtins
import time

import pytest
from IPython.core.error import UsageError

from hvdnb.notebook.cellout import cells
from hvdnb.notebook.cellout.cells import DistributedCellError
from hvdnb.notebook.diagnosis.where import format_stacks, rank_stacks

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(240)]

FAILS_ON_1 = """import torch.distributed as dist
def check(batch):
    total = sum(batch)
    if dist.get_rank() == 1:
        raise ValueError(f"bad batch, total {total}")
    return total
secret = 40 + dist.get_rank()
check([secret, 1])
"""

DEADLOCK = """import time, torch.distributed as dist
def wait_for_peer():
    dist.barrier()
if dist.get_rank() == 0:
    wait_for_peer()
else:
    time.sleep(120)
"""


def test_debug_reads_the_failing_ranks_frames(dist2, shell, capsys, monkeypatch):
    with pytest.raises(DistributedCellError):
        shell.run_cell_magic("distributed", "", FAILS_ON_1)
    capsys.readouterr()
    # default: the lowest failing rank; scripted commands
    shell.run_line_magic("dist", 'debug -c "p total" -c up -c "p secret * 2" -c "p batch"')
    out = capsys.readouterr().out
    assert "post-mortem of cell" in out and "on rank 1" in out
    assert "ValueError: bad batch, total 42" in out
    lines = out.splitlines()
    assert lines[lines.index("(Pdb rank 1) p total") + 1] == "42"
    assert lines[lines.index("(Pdb rank 1) p secret * 2") + 1] == "82"
    assert "kernels_ext" not in out and "engine.py" not in out  # the cell's frames only
    # interactively, through input(), as Jupyter asks for it
    answers = iter(["where", "p [secret, total]", "q"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(answers))
    shell.run_line_magic("dist", "debug 1")
    out = capsys.readouterr().out
    assert "[41, 42]" in out and "<cell" in out and "check()" in out
    # rank 0 did not fail: nothing to debug there
    with pytest.raises(UsageError, match="rank 0: no failed cell on this rank"):
        shell.run_line_magic("dist", "debug 0")


def _both_placed(text: str) -> bool:
    """The stacks show rank 0 in the barrier (line 5 -> 3) and rank 1 in its sleep (line 7)."""
    if "rank 0 (" not in text or "rank 1 (" not in text:
        return False
    r0, r1 = text.split("rank 1 (")[0], text.split("rank 1 (")[1]
    return (
        "line 5, in <module>" in r0
        and "line 3, in wait_for_peer" in r0
        and "barrier" in r0
        and "line 7, in <module>" in r1
    )


def test_where_during_a_deadlock_names_both_ranks_lines(dist2, shell, capsys):
    # each view is read again (twice a second at most) until it shows both ranks where they
    # wait, however long a loaded box takes to get them there; then the test stops the cell
    # as the stop button does (a Ctrl-C in the waiting loop). The cell's timeout bounds the
    # looking at 30 s
    seen = {"py-spy": "", "report": ""}
    last = [0.0]
    stopped: list[bool] = []

    def look(final: bool) -> None:
        if final or stopped or time.monotonic() - last[0] < 0.5:
            return
        for key, pyspy in (("py-spy", True), ("report", False)):
            if not _both_placed(seen[key]):
                seen[key] = format_stacks(rank_stacks(dist2, pyspy=pyspy))
        last[0] = time.monotonic()
        if all(_both_placed(text) for text in seen.values()):
            stopped.append(True)
            raise KeyboardInterrupt

    cells.add_wait_hook(look)
    try:
        with pytest.raises(DistributedCellError):
            cells.run_cell(dist2, DEADLOCK, timeout=30)
    finally:
        cells.remove_wait_hook(look)
    assert stopped, f"the ranks' positions never showed in 30 s:\n{seen}"
    for text in seen.values():
        assert "rank 0 (" in text and "rank 1 (" in text, text
        r0, r1 = text.split("rank 1 (")[0], text.split("rank 1 (")[1]
        assert "line 5, in <module>" in r0 and "line 3, in wait_for_peer" in r0, text
        assert "barrier" in r0, text
        assert "line 7, in <module>" in r1, text
    assert "read by py-spy" in seen["py-spy"] and "as the rank reported" in seen["report"]
    # the interrupted rank's frames are kept for the debugger until the next cell
    shell.run_line_magic("dist", 'debug 0 -c "where"')
    assert "wait_for_peer" in capsys.readouterr().out
    shell.run_line_magic("dist", "where")  # idle now: merged into one line
    assert "ranks 0,1: not running a cell" in capsys.readouterr().out


def test_syntax_errors_show_the_users_line_only(dist2):
    with pytest.raises(DistributedCellError) as exc:
        cells.run_cell(dist2, "x = 1\nif x\n    print(x)")
    text = "".join(exc.value._render_traceback_())
    assert "line 2" in text and "if x" in text and "SyntaxError" in text and "^" in text
    assert "engine.py" not in text and "Traceback" not in text


@pytest.mark.parametrize(
    "line, message",
    [
        ("debug 7", "unknown rank 7: the ranks are 0..1"),
        ("debug one", "'one' is not a rank number"),
        ("debug 0 1", "%dist debug takes one rank"),
    ],
)
def test_bad_debug_arguments(dist2, shell, line, message):
    with pytest.raises(UsageError, match=message):
        shell.run_line_magic("dist", line)


def test_debug_with_no_failed_cell(dist2, shell):
    cells.run_cell(dist2, "ok = 1", quiet=True)
    with pytest.raises(UsageError, match="no failed cell to debug"):
        shell.run_line_magic("dist", "debug")


BREAK_ON_1 = """import torch, torch.distributed as dist
t = torch.ones(2) * (dist.get_rank() + 1)
if dist.get_rank() == 1:
    x = 41
    breakpoint()
    x = x + 1
dist.all_reduce(t)
print(f"sum {t.tolist()} x {globals().get('x')}")
"""


def test_breakpoint_on_one_rank_while_the_other_waits_in_allreduce(
    dist2, shell, capsys, monkeypatch
):
    asked: list[str] = []
    answers = iter(["p x", "n", "p x", "c"])

    def answer(prompt: str = "") -> str:
        asked.append(prompt)
        line = next(answers)
        if line == "c":  # past HVDNB_STALL_AFTER (5 s) with rank 0 waiting in all_reduce
            time.sleep(6)
        return line

    monkeypatch.setattr(builtins, "input", answer)
    shell.run_cell_magic("distributed", "", BREAK_ON_1)
    captured = capsys.readouterr()
    out = captured.out
    assert asked == ["(Pdb rank 1) "] * 4
    assert "<cell" in out and "-> x = x + 1" in out  # stopped at the line after breakpoint()
    assert "41\n" in out and "42\n" in out  # p x, then next, then p x
    assert "[1] sum [3.0, 3.0] x 42" in out and "[0] sum [3.0, 3.0] x None" in out  # completed
    assert "stalled" not in captured.err, captured.err


@pytest.mark.parametrize(
    "line, message",
    [
        ("logs 9", "unknown rank 9: the ranks are 0..1"),
        ("logs x", "'x' is not a rank number"),
        ("logs 0 -n -1", "-n must be a number of lines >= 0"),
    ],
)
def test_bad_logs_arguments(dist2, shell, line, message):
    with pytest.raises(UsageError, match=message):
        shell.run_line_magic("dist", line)


def test_logs_after_a_sigkill_and_after_a_segfault(dist2, shell, capsys):
    """An out-of-memory style kill leaves no traceback: the log says what that means. A
    segfault leaves the crashing thread's Python stack in the rank's own log."""
    cells.run_cell(dist2, "import sys\nprint('hello stderr', file=sys.stderr)", quiet=True)
    shell.run_line_magic("dist", "logs 0 -n 50")
    out = capsys.readouterr().out
    assert "--- rank 0 (alive" in out and "hvdnb: rank 0 started, pid" in out
    kill = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"
    with pytest.raises(DistributedCellError, match="rank 1 died"):
        shell.run_cell_magic("distributed", "-t 1", kill)
    capsys.readouterr()
    shell.run_line_magic("dist", "logs 1")
    out = capsys.readouterr().out
    assert "--- rank 1 (dead" in out and "died in cell" in out
    assert "left no Python traceback" in out and "SIGKILL" in out
    shell.run_line_magic("dist", "restart")
    crash = "import ctypes\ndef read_null():\n    ctypes.string_at(0)\nread_null()"
    with pytest.raises(DistributedCellError, match="rank 0 died"):
        shell.run_cell_magic("distributed", "-t 0", crash)
    capsys.readouterr()
    shell.run_line_magic("dist", "logs 0")
    out = capsys.readouterr().out
    assert "Fatal Python error: Segmentation fault" in out
    assert 'File "<cell' in out and "read_null" in out
    assert "crashed on a fatal signal" in out
    shell.run_line_magic("dist", "restart")


def test_status_after_a_rank_died_is_a_table(dist2, shell, capsys):
    """Last in this module: the job is gone afterwards (MPI ends every rank)."""
    with pytest.raises(DistributedCellError, match="rank 1 died"):
        shell.run_cell_magic("distributed", "-t 1", "import os\nos._exit(3)")
    capsys.readouterr()
    deadline = time.monotonic() + 60  # MPI ends rank 0 too; it returns once it has
    while time.monotonic() < deadline and len(dist2.dead_ranks()) < 2:
        time.sleep(0.2)
    shell.run_line_magic("dist", "status")
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln[:1].isdigit()]
    assert len(rows) == 2 and all("dead" in r for r in rows), out
    assert "died in cell" in rows[1] and "Traceback" not in out
    assert "`%dist restart` starts all ranks afresh" in out
    with pytest.raises(UsageError, match="rank 1 is dead"):
        shell.run_line_magic("dist", "debug 1")
    shell.run_line_magic("dist", "restart")
    assert dist2.dead_ranks() == []


def test_where_and_debug_without_a_cluster(shell):
    import hvdnb

    c = hvdnb.current()
    if c is not None and c.running:
        c.stop()
    for line in ("where", "debug"):
        with pytest.raises(UsageError, match="no cluster is running"):
            shell.run_line_magic("dist", line)
