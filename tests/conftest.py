"""Shared fixtures: an IPython shell with hvdnb loaded, and a real 2-rank cluster."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

# The suite's CPU tests start CPU ranks (gloo, MPI) on any machine, a GPU node too: every
# process they start inherits a hidden GPU list, and hvdnb's GPU count honours it. Tests
# marked gpu see the GPUs again inside ``gpu_visible()``. Set before torch is imported.
REAL_CUDA_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# The run store (``$HVDNB_HOME/runs.sqlite``): the suite and the kernels and ranks it starts
# write into a directory of their own, never into the user's ~/.hvdnb.
os.environ["HVDNB_HOME"] = tempfile.mkdtemp(prefix="hvdnb-home-")

# The warm standby (``cluster/standby.py``: torch-importing processes and a spare
# controller after every start) is on by default for users. The suite starts hundreds of
# clusters on 2 cores and rarely restarts them: a standby after each start would compete
# with the test's own ranks for the CPU. Its tests (tests/test_standby.py and the real
# kernel's restart test) turn it on themselves.
os.environ.setdefault("HVDNB_STANDBY", "0")


@contextmanager
def gpu_visible() -> Iterator[None]:
    """Give processes started inside the block (and hvdnb's GPU count) the real GPUs."""
    if REAL_CUDA_VISIBLE_DEVICES is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = REAL_CUDA_VISIBLE_DEVICES
    try:
        yield
    finally:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(scope="session")
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "hvdnb")
    return ip


@pytest.fixture(scope="module")
def dist2(shell):
    """`%dist start -n 2` once per module (real mpiexec, real gloo group); stopped after."""
    import hvdnb

    running = hvdnb.current()
    if running is not None and running.running:
        running.stop()
    shell.run_line_magic("dist", "start -n 2 --timeout 120")
    cluster = hvdnb.current()
    assert cluster is not None and cluster.running
    yield cluster
    cluster.stop()


ROOT = Path(__file__).resolve().parents[1]


def _build_lessons_env(venv: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1")
    return subprocess.run(
        ["make", "-C", str(ROOT), "install", f"VENV={venv}", "PIP_OPTS=--no-compile"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


#: the lessons' environment, built in a thread from the session's start (``make install``
#: is a minute of unpacking wheels, which overlaps the browser tests' waiting instead of
#: adding to the suite's time): (folder, future), or empty when no collected test needs it
_LESSONS_BUILD: dict[str, Any] = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    wanted = any(
        "test_lessons_env" in item.nodeid or "2rank]" in item.nodeid
        for item in session.items
        if "tests/notebooks/" in item.nodeid or "test_lessons_env" in item.nodeid
    )
    if wanted and not _LESSONS_BUILD:
        venv = Path(tempfile.mkdtemp(prefix="hvdnb-make-lab-")) / "venv"
        pool = ThreadPoolExecutor(max_workers=1)
        _LESSONS_BUILD.update(venv=venv, future=pool.submit(_build_lessons_env, venv), pool=pool)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _LESSONS_BUILD:
        _LESSONS_BUILD["pool"].shutdown(wait=True)
        shutil.rmtree(_LESSONS_BUILD["venv"].parent, ignore_errors=True)


@pytest.fixture(scope="session")
def lessons_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The environment ``make lab`` installs, built for real: its install step (``make
    install``: a fresh ``python -m venv``, torch, hvdnb with the ``lessons`` extra, the
    kernelspec) into a new folder, with nothing from this test environment. Returns its
    ``bin`` folder. pip reads its cache and configured indexes as a user's would;
    ``--no-compile`` skips byte-compiling (an install-time cost, not what is checked).
    Started when the session's tests were collected (``pytest_collection_finish``)."""
    if _LESSONS_BUILD:
        venv, res = _LESSONS_BUILD["venv"], _LESSONS_BUILD["future"].result()
    else:
        venv = tmp_path_factory.mktemp("make-lab") / "venv"
        res = _build_lessons_env(venv)
    assert res.returncode == 0, f"make install failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    return venv / "bin"


def hvdnb_export(path: Path | str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``hvdnb export PATH`` as a user runs it (this Python, its own process); the caller
    asserts on the result."""
    return subprocess.run(
        [sys.executable, "-m", "hvdnb.notebook.cli", "export", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def alive(pids: list[int], within: float = 5.0) -> list[int]:
    """The pids still alive (zombies count as gone) after waiting up to ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        left = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.fixture
def kernel_sigint():
    """SIGINT raises KeyboardInterrupt for this test, as in a Jupyter kernel running a cell
    (ipykernel installs Python's handler while it executes one). A suite started in the
    background from a non-interactive shell (``make test &``) inherits SIGINT ignored, and
    a test of the stop button would then wait for a signal that never arrives."""
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, prev)
