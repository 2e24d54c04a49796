"""hvdnb.tensorflow beyond two ranks, and its errors when TensorFlow is missing.

``tests/spmd/test_spmd.py`` runs every ``spmd_*.py`` at 2 ranks (``spmd_tf_ops``,
``spmd_tf_keras`` among them); here the TensorFlow scripts run at 3 (a butterfly round,
an odd size: no Adasum, uneven reducescatter rows) and the install hints are checked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.spmd.test_spmd import HANG_S, MPIEXEC, _env, _report

SPMD = Path(__file__).resolve().parents[1] / "spmd"
INSTALL = "pip install 'hvdnb[tf]'"


def _need(module: str) -> None:
    pytest.importorskip(module, reason=f"{module} is not installed: {INSTALL}")


def _run(script: str, np: int) -> None:
    if not MPIEXEC.exists():
        pytest.skip(f"{MPIEXEC} not found: pip install mpich")
    proc = subprocess.run(
        [str(MPIEXEC), "-n", str(np), sys.executable, str(SPMD / f"{script}.py")],
        capture_output=True,
        text=True,
        timeout=HANG_S + 60,
        env=_env(),
        cwd=SPMD,
    )
    assert proc.returncode == 0, _report(proc)
    assert proc.stdout.count(f"OK {script} (rank") == np, _report(proc)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tf_ops_at_three_ranks() -> None:
    _need("tensorflow")
    _run("spmd_tf_ops", 3)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tf_keras_fit_at_three_ranks() -> None:
    _need("tensorflow")
    _need("tf_keras")
    _run("spmd_tf_keras", 3)


@pytest.mark.timeout(60)
def test_missing_tensorflow_names_the_install_command() -> None:
    """With TensorFlow hidden, importing hvdnb.tensorflow fails with the command to run."""
    code = (
        "import sys; sys.modules['tensorflow'] = None\n"
        "try:\n"
        "    import hvdnb.tensorflow\n"
        "except ModuleNotFoundError as e:\n"
        "    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "ERR hvdnb.tensorflow needs tensorflow" in out.stdout, out.stdout + out.stderr
    assert INSTALL in out.stdout, out.stdout


@pytest.mark.timeout(120)
def test_missing_tf_keras_names_the_install_command() -> None:
    _need("tensorflow")
    code = (
        "import sys; sys.modules['tf_keras'] = None\n"
        "try:\n"
        "    import hvdnb.tensorflow.keras\n"
        "except ModuleNotFoundError as e:\n"
        "    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR hvdnb.tensorflow.keras needs tf_keras" in out.stdout, out.stdout + out.stderr
    assert "hvdnb[tf]" in out.stdout, out.stdout
