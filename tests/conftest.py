"""Shared fixtures: an IPython shell with hvdnb loaded, and a real 2-rank cluster."""

from __future__ import annotations

import fcntl
import json
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


def _build_lessons_env(venv: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1")
    res = subprocess.run(
        ["make", "-C", str(ROOT), "install", f"VENV={venv}", "PIP_OPTS=--no-compile"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return {
        "returncode": res.returncode,
        "stdout": res.stdout[-4000:],
        "stderr": res.stderr[-4000:],
    }


# ------------------------------------------------------------------------------ two lanes
# ``make test`` runs the suite in two lanes, pytest-xdist workers (``-n 2 --dist loadfile
# --no-loadscope-reorder``). Run in one process it kept this 2-core box busy for three
# quarters of its time: the rest was tests waiting (a timeout to fire, a browser's page,
# Slurm's scheduler, a killed kernel's restart), and a second lane fills it. A test module
# is one unit (its module-scoped cluster stays on one worker); each lane takes the next
# unit when it is done with one, the costliest first (COSTLIEST_FIRST: a big unit started
# last would keep one lane busy alone). A test marked ``alone`` reads times, or host-wide
# state (``/dev/shm``), that a second test on the box would change: it holds the lanes' lock exclusively, every other test
# holds it shared, so the other lane pauses for it.
#: modules by what they cost in a run in one process (wall seconds on a 2-core box): these
#: first, the rest in collection order. The notebooks come third: their 2-rank runs wait
#: for the lessons' environment, built from the session's start
COSTLIEST_FIRST = (
    "tests/spmd/test_spmd.py",  # 165 s
    # one unit (MULTIHOST below), about 330 s here in all
    "tests/multihost/test_elastic_hosts.py",
    "tests/multihost/test_slurm_nodes.py",
    "tests/multihost/test_tf_nodes.py",
    "tests/multihost/test_hosts_ssh.py",
    "tests/multihost/test_two_hosts.py",
    # with Horovod's two TF2 examples from the harness beside the clone (../shared): 438 s
    # at a load of 8 here, the examples 221 + 98 s of it
    "tests/integration/test_hvdnb_tensorflow.py",
    "tests/docs/test_howto.py",  # 93 s
    "tests/notebooks/test_notebooks.py",  # 249 s
    # builds an environment with ipykernel 6 (pip: much of it waits on disk and network)
    "tests/integration/test_ipykernel6.py",  # 142 s at a load of 7
    "tests/faults/test_elastic.py",  # 62 s
    "tests/integration/test_frameworks.py",  # 59 s
    "tests/integration/test_standby.py",  # 54 s
    "tests/browser/test_drawing_browser.py",  # 51 s
    "tests/integration/test_drawing.py",  # 49 s
    "tests/faults/test_faults.py",  # 49 s
    "tests/browser/test_edges_browser.py",  # 46 s
    "tests/integration/test_tf_strategies.py",  # 43 s
    "tests/integration/test_headless.py",  # 40 s
)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):
        rank = {m: i for i, m in enumerate(COSTLIEST_FIRST)}
        items.sort(key=lambda it: rank.get(_module(it), len(rank)))  # stable: the rest in order


#: the namespace hosts' tests, one unit for the lanes: every module there puts the same
#: bridge address (``tests/multihost/hosts.py``) on the root namespace, and two at once, one
#: per lane, broke each other's routes (a login kernel that never answered, seen once)
MULTIHOST = "tests/multihost/"


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with ``tests/multihost`` as one unit, so its modules take turns."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Lanes(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(MULTIHOST):
                return MULTIHOST
            return str(super()._split_scope(nodeid))

    return Lanes(config, log)


#: an ``alone`` run's turnstile and lock, held from one ``alone`` test to the next: released
#: between them, the other lane slipped a test in each time, and each lane waited on the other
_HELD: list[int] = []


def _alone(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under two lanes, around a test's set-up, call and teardown: an ``alone`` test holds
    the lanes' lock exclusively (and keeps it for the next test when that one is ``alone``
    too), every other test shared."""
    if not hasattr(item.config, "workerinput"):
        yield
        return
    if not _HELD:
        how = fcntl.LOCK_EX if _alone(item) else fcntl.LOCK_SH
        run = Path(os.environ[RUN_DIR])
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        gate, lock = os.open(run / "lanes.turnstile", flags), os.open(run / "lanes.lock", flags)
        # the turnstile lets an ``alone`` test in before the other lane's next test: it holds
        # it while it waits for the lock, and every test passes it on its way in
        fcntl.flock(gate, fcntl.LOCK_EX)
        if how == fcntl.LOCK_SH:
            fcntl.flock(gate, fcntl.LOCK_UN)
        fcntl.flock(lock, how)
        _HELD[:] = [gate, lock]
    try:
        yield
    finally:
        if not (_alone(item) and _alone(nextitem)):
            gate, lock = _HELD
            _HELD.clear()
            for fd in (lock, gate):
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)


# ----------------------------------------------------------------- the lessons' environment
#: a folder for the whole run, made by its first process (the only one, or pytest-xdist's
#: controller) and named to its workers in this variable: the lanes' lock, and
#: ``lessons_env``, built once per run
RUN_DIR = "HVDNB_TEST_RUN_DIR"
#: this process's build thread, if it is the one building
_LESSONS_BUILD: dict[str, Any] = {}


def _lessons_build(root: Path) -> None:
    """Build into ``root/venv`` and write the result to ``root/result.json`` (last, whole)."""
    try:
        got = _build_lessons_env(root / "venv")
    except Exception as exc:  # a timeout: the fixture reports it
        got = {"returncode": -1, "stdout": "", "stderr": repr(exc)}
    tmp = root / "result.json.part"
    tmp.write_text(json.dumps(got))
    tmp.rename(root / "result.json")


def _start_lessons_build() -> None:
    """Claim the build (one process of the run wins) and start it in a thread."""
    root = Path(os.environ[RUN_DIR])
    try:
        (root / "claimed").mkdir()
    except FileExistsError:
        return
    pool = ThreadPoolExecutor(max_workers=1)
    _LESSONS_BUILD.update(pool=pool, future=pool.submit(_lessons_build, root))


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the run's first process: workers inherit this
        os.environ[RUN_DIR] = tempfile.mkdtemp(prefix="hvdnb-test-run-")


def pytest_collection_finish(session: pytest.Session) -> None:
    # ``make install`` is a minute of unpacking wheels: started when the tests are known, it
    # overlaps the first tests' waiting instead of adding to the suite's time
    wanted = any(
        "test_lessons_env" in item.nodeid or "2rank]" in item.nodeid
        for item in session.items
        if "tests/notebooks/" in item.nodeid or "test_lessons_env" in item.nodeid
    )
    if wanted:
        _start_lessons_build()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _LESSONS_BUILD:
        _LESSONS_BUILD["pool"].shutdown(wait=True)
    if not hasattr(session.config, "workerinput"):  # every worker has ended
        shutil.rmtree(os.environ[RUN_DIR], ignore_errors=True)


@pytest.fixture(scope="session")
def lessons_env() -> Path:
    """The environment ``make lab`` installs, built for real: its install step (``make
    install``: a fresh ``python -m venv``, torch, hvdnb with the ``lessons`` extra, the
    kernelspec) into a new folder, with nothing from this test environment. Returns its
    ``bin`` folder. pip reads its cache and configured indexes as a user's would;
    ``--no-compile`` skips byte-compiling (an install-time cost, not what is checked).
    Started when the session's tests were collected (``pytest_collection_finish``), by
    one process of the run; the others wait for its result."""
    root = Path(os.environ[RUN_DIR])
    _start_lessons_build()  # a no-op where a process of this run has claimed it
    result = root / "result.json"
    deadline = time.monotonic() + 1000
    while not result.exists():
        assert time.monotonic() < deadline, "the lessons' environment was not built in 1000 s"
        time.sleep(0.5)
    res = json.loads(result.read_text())
    assert res["returncode"] == 0, f"make install failed:\n{res['stdout']}\n{res['stderr']}"
    return root / "venv" / "bin"


def hvdnb_export(path: Path | str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``hvdnb export PATH`` as a user runs it (this Python, its own process); the caller
    asserts on the result."""
    return subprocess.run(
        [sys.executable, "-m", "hvdnb.notebook.headless.cli", "export", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def alive(pids: list[int], within: float = 60.0) -> list[int]:
    """The pids still alive (zombies count as gone) after waiting up to ``within`` s: it
    returns as soon as none is left, so the bound only says how long counts as hanging."""
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
