"""Run every ``spmd_*.py`` script in this folder under ``mpiexec -n 2`` (Horovod's test/parallel),
and at 1 rank; some at 3 and 4.

Contract for scripts (yours too): every rank runs every check and asserts against
``hvd.size()``; call ``_spmd.setup()`` first (faulthandler dump + exit on a hung rank, exit on
an uncaught exception); print ``OK <script stem>`` on each rank at the end. A script passes
when mpiexec exits 0 and every rank printed its OK line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from hvdnb.extras import pip_target

HERE = Path(__file__).parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"
SCRIPTS = sorted(HERE.glob("spmd_*.py"))
NP = 2
HANG_S = 60  # a rank dumps its stack and exits after this (faulthandler)
TF_HANG_S = 180  # ... a TensorFlow script's (its import and shutdown are slow under load)
#: what a script imports beyond the test extra: where one is not installed its runs skip,
#: saying so; the scripts import them plainly, so an ImportError there (hvdnb's own) fails
NEEDS = {
    "spmd_tf_ops": ("tensorflow",),
    "spmd_tf_keras": ("tensorflow", "tf_keras"),
}
TF_INSTALL = f"pip install {pip_target('tf')}"


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["HVDNB_SPMD_TIMEOUT"] = str(HANG_S)
    env["PYTHONFAULTHANDLER"] = "1"
    env.update(extra)
    return env


def _report(proc: subprocess.CompletedProcess[str]) -> str:
    return (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
        f"\n--- stderr\n{proc.stderr[-6000:]}"
    )


def mpiexec(
    script: str | Path, np: int, *args: str, timeout: float = HANG_S + 30
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (a path, or a name in this folder) on ``np`` ranks from this folder;
    skips when mpiexec or a module the script ``NEEDS`` is missing, returns the finished
    process."""
    if not MPIEXEC.exists():
        pytest.skip(f"{MPIEXEC} not found: pip install mpich")
    for module in NEEDS.get(Path(script).stem, ()):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{Path(script).name} needs {module}, not installed: {TF_INSTALL}")
    hang = HANG_S
    if Path(script).stem in NEEDS:
        # TensorFlow's import alone took 17 s of a 1-rank run on the loaded box, and its
        # shutdown more: a whole run past 60 s was killed after it had printed OK
        hang = TF_HANG_S
        timeout = max(timeout, TF_HANG_S + 30)
    return subprocess.run(
        [str(MPIEXEC), "-n", str(np), sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(HVDNB_SPMD_TIMEOUT=str(hang)),
        cwd=HERE,
    )


@pytest.mark.mpi
@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_spmd_under_mpiexec(script: Path) -> None:
    proc = mpiexec(script, NP)
    assert proc.returncode == 0, _report(proc)
    assert proc.stdout.count(f"OK {script.stem}") == NP, _report(proc)


@pytest.fixture(scope="module")
def one_rank_runs() -> dict[str, Any]:
    """Every script under ``mpiexec -n 1``, two at a time (one process each: on 2 cores the
    pair takes the time of one), run once for the module; stem -> finished process or the
    exception its run raised (a skip included)."""
    out: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {s.stem: pool.submit(mpiexec, s, 1) for s in SCRIPTS}
        for stem, fut in futures.items():
            try:
                out[stem] = fut.result()
            except BaseException as exc:  # pytest's Skipped is a BaseException
                out[stem] = exc
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_spmd_one_rank(script: Path, one_rank_runs: dict[str, Any]) -> None:
    """World size 1, the default on a one-GPU node: every script's checks hold with nobody
    to talk to (a collective is the identity, a "mismatch" is an ordinary call, ``{0}`` is
    the global process set). Found at 1 rank only: ``hvd.allreduce_async(param)`` raised
    numpy's "requires grad" error (no inline round takes small tensors there)."""
    proc = one_rank_runs[script.stem]
    if isinstance(proc, BaseException):
        raise proc
    assert proc.returncode == 0, _report(proc)
    assert proc.stdout.count(f"OK {script.stem}") == 1, _report(proc)


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("script", "np"),
    [
        ("spmd_ops", 3),
        ("spmd_errors", 3),
        ("spmd_threads", 3),
        ("spmd_horovod", 3),
        ("spmd_cache", 3),
        ("spmd_cache", 4),
        ("spmd_errors", 4),
        ("spmd_horovod", 4),
    ],
)
def test_spmd_more_ranks(script: str, np: int) -> None:
    """More than two ranks (oversubscribed where cores are few): every round is a butterfly
    of point-to-point messages; 3 folds one rank into a partner, 4 is recursive doubling."""
    proc = mpiexec(f"{script}.py", np)
    assert proc.returncode == 0, _report(proc)
    assert proc.stdout.count(f"OK {script}") == np, _report(proc)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [3, 4])
def test_spmd_adasum_ranks(ranks: int) -> None:
    """Adasum's DistributedOptimizer on four ranks (a two-level tree; oversubscribed is fine)
    and Horovod's error on every rank of three (not a power of two)."""
    proc = mpiexec("spmd_adasum.py", ranks)
    assert proc.returncode == 0, _report(proc)
    assert proc.stdout.count("OK spmd_adasum") == ranks, _report(proc)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "script",
    [
        "spmd_ops",
        "spmd_errors",
        "spmd_comm_timing",
        "spmd_horovod",
        "spmd_teardown",
        "spmd_adasum",
        "spmd_cache",
        "spmd_optimizer",
        "spmd_threads",
    ],
)
def test_torchrun_style_gloo(script: str) -> None:
    """The same checks without MPI: torchrun's variables, every collective over gloo.

    As under torchrun, the rendezvous store lives in the launcher (this process), not in
    rank 0 (``TORCHELASTIC_USE_AGENT_STORE``).
    """
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(
        "127.0.0.1", 0, NP, True, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    port = str(store.port)
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / f"{script}.py")],
            cwd=HERE,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_env(
                RANK=str(r),
                WORLD_SIZE=str(NP),
                LOCAL_RANK=str(r),
                LOCAL_WORLD_SIZE=str(NP),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                TORCHELASTIC_USE_AGENT_STORE="True",
            ),
        )
        for r in range(NP)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=HANG_S + 30)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for code, out, err in outs:
        assert code == 0 and f"OK {script}" in out, f"exit {code}\n{out[-4000:]}\n{err[-4000:]}"
        if script == "spmd_ops":
            assert "backend gloo" in out, out[-2000:]


@pytest.mark.mpi
@pytest.mark.slow
def test_example_pytorch_mnist_adasum() -> None:
    """Horovod's MNIST example (on scikit-learn's digits) trains with ``--use-adasum``."""
    pytest.importorskip("sklearn")
    example = HERE.parents[1] / "examples" / "pytorch_mnist_adasum.py"
    args = ["--use-adasum", "--epochs", "3", "--lr", "0.05", "--batch-size", "32"]
    proc = mpiexec(example, NP, *args, timeout=120)
    assert proc.returncode == 0, _report(proc)
    accs = re.findall(r"Accuracy: ([0-9.]+)%", proc.stdout)
    assert len(accs) == 3, _report(proc)  # one line per epoch, rank 0 only
    assert float(accs[-1]) > 50.0, _report(proc)  # chance is 10% (about 88% here)


@pytest.mark.mpi
def test_timeline_valid_after_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "tl.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "timeline_killed.py"), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
        cwd=HERE,
    )
    assert proc.returncode == -9 and "recorded" in proc.stdout, _report(proc)
    events = json.loads((tmp_path / "tl.rank0.json").read_text())
    steps = [e for e in events if e.get("name", "").startswith("step.")]
    assert len(steps) == 200 and all(e["ph"] == "X" and e["dur"] >= 0 for e in steps)


LIMITS = r"""
import torch
import hvdnb.torch as hvd
from hvdnb.torch.process_sets import STATE
hvd.init()
t = torch.full((2048,), float(hvd.rank() + 1))  # 8 KB: the butterfly on some ranks only
for _ in range(3):
    hvd.allreduce_(t, op=hvd.Sum, name="limits")
    t.fill_(float(hvd.rank() + 1))
r = hvd.allreduce(t, op=hvd.Sum, name="limits")
from mpi4py import MPI  # one line from rank 0: ranks' prints can interleave
got = MPI.COMM_WORLD.gather([STATE.inline_bytes, STATE.butterfly_bytes, r[0].item()], root=0)
if hvd.rank() == 0:
    print("LIMITS", got)
"""


@pytest.mark.mpi
def test_ranks_agree_on_the_small_allreduce_limits() -> None:
    """Ranks started with different limits (hosts with other core counts, other HVDNB_*
    settings) take the smallest at init, so one call takes one path on every rank."""
    if not MPIEXEC.exists():
        pytest.skip(f"{MPIEXEC} not found: pip install mpich")
    part = [sys.executable, "-c", LIMITS]
    proc = subprocess.run(
        [str(MPIEXEC), "-n", "2", "-env", "HVDNB_BUTTERFLY_BYTES", "65536", *part, ":"]
        + ["-n", "2", "-env", "HVDNB_BUTTERFLY_BYTES", "4096"]
        + ["-env", "HVDNB_INLINE_BYTES", "32768", *part],
        capture_output=True,
        text=True,
        timeout=HANG_S + 30,
        env=_env(),
        cwd=HERE,
    )
    assert proc.returncode == 0, _report(proc)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("LIMITS")]
    assert lines == ["LIMITS " + str([[32768, 4096, 10.0]] * 4)], _report(proc)
