"""Nothing hangs headless: ``hvdnb run`` ends a cell stuck in a collective or a ``recv``
(``--timeout``, exit 124) and a run stopped by SIGTERM or SIGINT (exit 143, 130), saves the
notebook with the output so far and the stall report, and leaves no process behind. Also
the stall detector's wording for a rank that waits alone (1-rank world), fed answers, no
processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import nbformat
import psutil
import pytest

from hvdnb.notebook.diagnosis.stall import StallWatch, describe, waits_alone

ROOT = Path(__file__).resolve().parents[2]
HVDNB = [sys.executable, "-m", "hvdnb.notebook.headless.cli"]
#: a kernel, its cluster's start and teardown on a loaded 2-core box; the hang itself is
#: bounded by --timeout + 10 s, so a run past START + timeout + 10 s has hung
START = 60.0
#: the hung cells' ``--timeout``, and the stall detector's start (``hvdnb run`` passes the
#: lower of it and half the timeout to the kernel): the report comes two looks (1 s apart)
#: after it, ~3 s into the cell, far inside the timeout however loaded the box is
TIMEOUT = 20.0
STALL_AFTER = "1"


def _notebook(tmp_path: Path, cell: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext hvdnb\n%dist start"),
        nbformat.v4.new_code_cell("%%distributed\n" + textwrap.dedent(cell)),
        nbformat.v4.new_code_cell("print('never reached')"),
        nbformat.v4.new_code_cell("%dist stop"),
    ]
    src = tmp_path / "hang.ipynb"
    nbformat.write(nb, src)
    return src


def _start(src: Path, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    out = src.with_suffix(".out.ipynb")
    return subprocess.Popen(
        [*HVDNB, "run", str(src), "-o", str(out), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _watch(proc: subprocess.Popen[str], until: Any, limit: float) -> dict[int, psutil.Process]:
    """Every process descending from ``proc`` (looked at every 0.2 s) until ``until()``."""
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and not until():
        try:
            for p in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(p.pid, p)
        except psutil.Error:
            pass
        time.sleep(0.2)
    return seen


def _left(seen: dict[int, psutil.Process]) -> list[str]:
    left = []
    for p in seen.values():
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(p.cmdline())[:120])
        except psutil.Error:
            pass
    return left


def _text(path: Path) -> str:
    parts = []
    for cell in nbformat.read(path, as_version=4).cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out["text"])
            elif out.get("output_type") == "error":
                parts.append("\n".join(out.get("traceback", [])))
    return "".join(parts)


def _run_to_end(src: Path, timeout: float, *args: str) -> tuple[int, str, dict[int, Any]]:
    proc = _start(src, *args)
    seen = _watch(proc, lambda: proc.poll() is not None, START + timeout + 10)
    try:
        _, err = proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"hvdnb run still running after {START + timeout + 15:.0f} s:\n{err}")
    return proc.returncode, err, seen


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_timeout_ends_a_one_rank_recv_that_ignores_the_interrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 rank blocked in C (an MPI recv no rank can ever answer): the interrupt does not
    reach it, so the runner's backstop stops the kernel and the cluster."""
    monkeypatch.setenv("HVDNB_STALL_AFTER", STALL_AFTER)
    src = _notebook(
        tmp_path,
        """\
        from mpi4py import MPI
        print('before the hang', flush=True)
        MPI.COMM_WORLD.recv(source=MPI.ANY_SOURCE)
        """,
    )
    rc, err, seen = _run_to_end(src, TIMEOUT, "-n", "1", "--timeout", f"{TIMEOUT:g}")
    assert rc == 124, err
    assert f"--timeout {TIMEOUT:g} s" in err
    text = _text(src.with_suffix(".out.ipynb"))
    assert "before the hang" in text and "never reached" not in text
    assert "rank 0 waits in MPI recv" in text and "the cluster has 1 rank" in text, text
    assert "the kernel and its cluster were stopped" in text
    assert len(seen) >= 3, seen  # the kernel, mpiexec and the engine were seen
    assert _left(seen) == []


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_timeout_ends_a_two_rank_collective(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 in all_reduce, rank 1 elsewhere: the cell's own timeout interrupts them and
    the stall report names both."""
    monkeypatch.setenv("HVDNB_STALL_AFTER", STALL_AFTER)
    src = _notebook(
        tmp_path,
        """\
        import time, torch, torch.distributed as dist
        print('before the hang', flush=True)
        t = torch.zeros(1)
        if dist.get_rank() == 0:
            dist.all_reduce(t)
        else:
            time.sleep(100000)
        """,
    )
    rc, err, seen = _run_to_end(src, TIMEOUT, "-n", "2", "--timeout", f"{TIMEOUT:g}")
    assert rc == 124, err
    text = _text(src.with_suffix(".out.ipynb"))
    assert "before the hang" in text and "never reached" not in text
    assert "rank 0 waits in all_reduce" in text, text
    assert "rank 1 is at" in text and "not in a collective" in text
    assert f"cell timed out after {TIMEOUT:g} s" in text
    assert _left(seen) == []


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sigterm_mid_cell_saves_and_leaves_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "in-the-cell"
    src = _notebook(
        tmp_path,
        f"""\
        import time
        print('before the hang', flush=True)
        open({str(marker)!r}, "w").close()
        time.sleep(100000)
        """,
    )
    proc = _start(src, "-n", "1")
    seen = _watch(proc, lambda: marker.exists() or proc.poll() is not None, START)
    assert marker.exists(), "the cell never started"
    time.sleep(0.5)  # its output reaches the notebook
    seen.update(_watch(proc, lambda: True, 0))
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=15)  # 10 s promised, 5 s of slack for the box
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("hvdnb run ignored SIGTERM for 15 s")
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM" in err
    text = _text(src.with_suffix(".out.ipynb"))
    assert "before the hang" in text and "never reached" not in text
    assert "stopped by SIGTERM" in text
    assert len(seen) >= 3, seen
    assert _left(seen) == []


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sigint_mid_cell_exits_130_saves_and_leaves_nothing(tmp_path: Path) -> None:
    """Ctrl-C in the terminal (SIGINT to ``hvdnb run``'s process group) while a 2-rank cell
    runs: exit 130 (128 + SIGINT), the notebook saved with the output so far and the note,
    and no process of the kernel or its cluster left."""
    marker = tmp_path / "in-the-cell"
    src = _notebook(
        tmp_path,
        f"""\
        import time, torch.distributed as dist
        print('before the hang', flush=True)
        if dist.get_rank() == 0:
            open({str(marker)!r}, "w").close()
        time.sleep(100000)
        """,
    )
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.Popen(
        [*HVDNB, "run", str(src), "-o", str(src.with_suffix(".out.ipynb")), "-n", "2"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a group of its own, as a terminal's foreground job
    )
    try:
        seen = _watch(proc, lambda: marker.exists() or proc.poll() is not None, START)
        assert marker.exists(), "the cell never started"
        time.sleep(0.5)  # its output reaches the notebook
        seen.update(_watch(proc, lambda: True, 0))
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends
        _, err = proc.communicate(timeout=15)  # 10 s promised, 5 s of slack for the box
    except subprocess.TimeoutExpired:
        pytest.fail("hvdnb run ignored SIGINT for 15 s")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "stopped by SIGINT" in err, err
    text = _text(src.with_suffix(".out.ipynb"))
    assert "before the hang" in text and "never reached" not in text, text
    assert "stopped by SIGINT" in text, text
    assert len(seen) >= 4, seen  # the kernel, mpiexec and two engines were seen
    assert _left(seen) == []


class _Channel:
    def __init__(self) -> None:
        self.sent: list[tuple[int, Any]] = []

    def on(self, kind: Any, fn: Any) -> None:
        self.fn = fn

    def off(self, kind: Any, fn: Any) -> None:
        pass

    def send(self, rank: int, kind: Any, **kw: Any) -> None:
        self.sent.append((rank, kw["ask"]))


class _Cluster:
    def __init__(self, n: int) -> None:
        self.n = n
        self.channel = _Channel()
        self.last_stall: dict[str, Any] | None = None


def _answer(watch: StallWatch, **info: Any) -> None:
    base = {"cell": "<cell 2>", "line": 3, "code": "comm.recv()", "progress": [0, 0, 0]}
    watch._on_where({"ask": watch.ask, "rank": 0, **base, **info})


def _looks(watch: StallWatch, info: dict[str, Any], looks: int) -> list[str | None]:
    """``looks`` looks 1 s apart on a fake clock, rank 0 answering ``info`` each time."""
    out = []
    for _ in range(looks):
        watch.t0 -= 1.0
        if watch.asked_at is not None:
            watch.asked_at -= 1.0
        out.append(watch.tick(set()))
        _answer(watch, **info)
    return out


def test_one_rank_waiting_alone_is_a_stall(capsys: pytest.CaptureFixture[str]) -> None:
    cluster = _Cluster(1)
    watch = StallWatch(cluster, [0], after=2.0)
    reports = _looks(watch, {"collective": "MPI recv"}, 6)
    said = [r for r in reports if r]
    assert len(said) == 1, reports  # once, not once a second
    assert "rank 0 waits in MPI recv at <cell 2> line 3 (comm.recv())" in said[0]
    assert "the cluster has 1 rank: no other rank can ever send to or wait with rank 0" in said[0]
    assert cluster.last_stall is not None and "the cluster has 1 rank" in cluster.last_stall["text"]
    assert "the cluster has 1 rank" in capsys.readouterr().err


def test_one_rank_busy_outside_a_collective_is_no_stall() -> None:
    watch = StallWatch(_Cluster(1), [0], after=2.0)
    assert not any(_looks(watch, {"collective": None}, 6))


def test_a_peer_past_the_world_size_is_named() -> None:
    info = {"cell": "<cell 2>", "line": 3, "code": "dist.recv(t, 3)", "collective": "recv"}
    assert describe({**info, "peer": 3}) == (
        "waits in recv from rank 3 at <cell 2> line 3 (dist.recv(t, 3))"
    )
    assert describe({**info, "collective": "send", "peer": 1}).startswith("waits in send to rank 1")
    assert waits_alone({**info, "peer": 3}, 2) and not waits_alone({**info, "peer": 1}, 2)
    assert waits_alone(info, 1) and not waits_alone({**info, "collective": None}, 1)
