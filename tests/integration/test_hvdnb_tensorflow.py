"""hvdnb.tensorflow beyond two ranks, and its errors when TensorFlow is missing.

``tests/spmd/test_spmd.py`` runs every ``spmd_*.py`` at 2 ranks (``spmd_tf_ops``,
``spmd_tf_keras`` among them); here the TensorFlow scripts run at 3 (a butterfly round,
an odd size: no Adasum, uneven reducescatter rows) and the install hints are checked.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hvdnb
from hvdnb.extras import pip_target
from tests.spmd.test_spmd import HANG_S, MPIEXEC, _env, _report, mpiexec

INSTALL = f"pip install {pip_target('tf')}"


def _need(module: str) -> None:
    pytest.importorskip(module, reason=f"{module} is not installed: {INSTALL}")


def _run(script: str, np: int) -> None:
    proc = mpiexec(f"{script}.py", np, timeout=HANG_S + 60)
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


def _import_without(hidden: str, module: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Import ``module`` in a fresh interpreter with ``hidden`` made unimportable; prints
    ``ERR <message>`` for the ModuleNotFoundError it raises."""
    code = (
        f"import sys; sys.modules[{hidden!r}] = None\n"
        "try:\n"
        f"    import {module}\n"
        "except ModuleNotFoundError as e:\n"
        "    print('ERR', e)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.timeout(60)
def test_missing_tensorflow_names_the_install_command() -> None:
    """With TensorFlow hidden, importing hvdnb.tensorflow fails with the command to run."""
    out = _import_without("tensorflow", "hvdnb.tensorflow", timeout=60)
    assert "ERR hvdnb.tensorflow needs tensorflow" in out.stdout, out.stdout + out.stderr
    assert INSTALL in out.stdout, out.stdout


@pytest.mark.timeout(120)
def test_missing_tf_keras_names_the_install_command() -> None:
    _need("tensorflow")
    out = _import_without("tf_keras", "hvdnb.tensorflow.keras", timeout=120)
    assert "ERR hvdnb.tensorflow.keras needs tf_keras" in out.stdout, out.stdout + out.stderr
    assert INSTALL in out.stdout, out.stdout


#: a user who did not set TF_USE_LEGACY_KERAS: tf.keras is Keras 3, and its optimizer is
#: refused, naming the fix; a tf-keras one, in the same process, is wrapped
KERAS3 = """
import os
os.environ.pop("TF_USE_LEGACY_KERAS", None)
import tensorflow as tf
import tf_keras
import hvdnb.tensorflow.keras as hvd
k3 = tf.keras.optimizers.SGD()
assert not isinstance(k3, tf_keras.optimizers.Optimizer), type(k3).__mro__
print("KERAS3", type(k3).__module__)
try:
    hvd.DistributedOptimizer(k3)
    print("ACCEPTED")
except TypeError as exc:
    print("ERR", exc)
k2 = hvd.DistributedOptimizer(tf_keras.optimizers.SGD())
print("K2", type(k2).__name__, isinstance(k2, tf_keras.optimizers.SGD))
"""


def _keras3_version() -> str:
    """The installed Keras 3's version; skips, saying why, where there is none."""
    try:
        version = md.version("keras")
    except md.PackageNotFoundError:
        pytest.skip(
            "keras (Keras 3) is not installed, so there is no Keras 3 optimizer to refuse: "
            "TensorFlow >= 2.16 installs it"
        )
    if int(version.split(".")[0]) < 3:
        pytest.skip(f"keras {version} is Keras 2: there is no Keras 3 optimizer to refuse")
    return version


@pytest.mark.timeout(120)
def test_a_keras_3_optimizer_is_refused_naming_the_fix() -> None:
    """Horovod's Keras API is Keras 2's: ``hvd.DistributedOptimizer`` refuses a Keras 3
    optimizer (``tf.keras``'s without ``TF_USE_LEGACY_KERAS=1``) with the variable to set
    and the install command; the check runs wherever Keras 3 is installed, and skips,
    saying so, where it is not."""
    _need("tensorflow")
    _need("tf_keras")
    version = _keras3_version()
    env = _env(TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, "-c", KERAS3], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, _report(proc)
    out = proc.stdout
    assert "KERAS3 keras." in out, f"keras {version}: " + out  # Keras 3's own class
    assert "ACCEPTED" not in out, out
    err = next((ln for ln in out.splitlines() if ln.startswith("ERR ")), "")
    assert "wraps Keras 2 (tf-keras) optimizers; this is Keras 3's SGD" in err, out
    assert "set TF_USE_LEGACY_KERAS=1 before TensorFlow is imported" in err, err
    assert INSTALL in err, err
    assert "K2 SGD True" in out, out


# -- Horovod's TF2 examples, unchanged -------------------------------------------------------
#: where Horovod's ``examples/tensorflow2`` files are looked for (Apache-2.0 code, not vendored)
EXAMPLES = Path(
    os.environ.get(
        "HVDNB_HOROVOD_EXAMPLES",
        str(
            Path(__file__).resolve().parents[2]
            / ".."
            / "shared"
            / "conformance"
            / "horovod"
            / "examples"
            / "tensorflow2"
        ),
    )
)

#: put on the examples' path: ``horovod.X`` is hvdnb's module of the same role, and MNIST
#: (no download here) is scikit-learn's digits; the test's doing, never hvdnb's
SITECUSTOMIZE = '''
import importlib, importlib.abc, importlib.util, sys, types

ALIASES = {"horovod.tensorflow": "hvdnb.tensorflow", "horovod.keras": "hvdnb.tensorflow.keras"}


class _Loader(importlib.abc.Loader):
    def __init__(self, real):
        self.real = real

    def create_module(self, spec):
        return importlib.import_module(self.real)

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        for alias, real in ALIASES.items():
            if fullname == alias or fullname.startswith(alias + "."):
                return importlib.util.spec_from_loader(
                    fullname, _Loader(real + fullname[len(alias):])
                )
        return None


sys.meta_path.insert(0, _Finder())
_pkg = types.ModuleType("horovod")  # the examples' `import horovod`
_pkg.__path__ = []  # a package: its submodules come from the finder above
sys.modules["horovod"] = _pkg


def _digits(path="mnist.npz"):
    """MNIST's (x_train, y_train), (x_test, y_test) as uint8 images: scikit-learn's 1797
    8x8 digits (0..16 scaled to 0..255), 80/20."""
    import numpy as np
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images * (255 / 16)).astype(np.uint8)
    y = d.target.astype(np.uint8)
    cut = len(x) * 4 // 5
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


import tensorflow as tf

tf.keras.datasets.mnist.load_data = _digits
'''


def _example(tmp_path: Path, name: str) -> subprocess.CompletedProcess[str]:
    _need("tensorflow")
    _need("tf_keras")
    _need("sklearn")
    src = EXAMPLES / name
    if not src.exists():
        pytest.skip(
            f"Horovod's example {name} not found in {EXAMPLES}: it is Apache-2.0 code this "
            "project does not vendor. Point HVDNB_HOROVOD_EXAMPLES at a Horovod checkout's "
            "examples/tensorflow2 (git clone https://github.com/horovod/horovod)"
        )
    if not MPIEXEC.exists():
        pytest.skip(f"{MPIEXEC} not found: pip install mpich")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = _env(TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="2")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = f"{site}:{root}"
    proc = subprocess.run(
        [str(MPIEXEC), "-n", "2", sys.executable, str(src)],
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
        cwd=tmp_path,  # checkpoints land here
    )
    assert proc.returncode == 0, _report(proc)
    return proc


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_horovod_example_tensorflow2_mnist(tmp_path: Path) -> None:
    """DistributedGradientTape and broadcast_variables: 5000 steps on 2 ranks, rank 0
    prints the loss every 10 steps and saves a checkpoint."""
    proc = _example(tmp_path, "tensorflow2_mnist.py")
    losses = [float(x) for x in re.findall(r"Step #\d+\tLoss: ([0-9.]+)", proc.stdout)]
    assert len(losses) == 10000 // 2 // 10, _report(proc)  # rank 0 only
    assert min(losses[-10:]) < losses[0] / 2, losses[:3] + losses[-10:]
    assert list(tmp_path.glob("checkpoints-1.index")), sorted(p.name for p in tmp_path.iterdir())


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_horovod_example_tensorflow2_keras_mnist_in_a_distributed_cell(
    tmp_path: Path, shell, capsys
) -> None:
    """DistributedOptimizer and the three callbacks in ``fit``, unchanged, run by ``runpy``
    in a ``%%distributed`` cell on 2 ranks (the engines get the same ``sitecustomize`` as
    under mpiexec): 24 epochs, the warm-up reported, checkpoints written by rank 0 alone.

    Each example runs once, on one launcher (the tape one under mpiexec, above; this one in
    a cell, where Keras' progress bar meets the notebook's output): both on both launchers
    took 97 + 78 + 77 s, too much of the suite's 20 minutes for what the second launcher
    adds; ``spmd_tf_keras`` and ``tests/integration/test_tensorflow.py`` cover the rest."""
    name = "tensorflow2_keras_mnist.py"
    if not (EXAMPLES / name).exists():
        _example(tmp_path, name)  # skips, saying where the examples are looked for
    _need("tensorflow")
    _need("tf_keras")
    _need("sklearn")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    root = str(Path(__file__).resolve().parents[2])
    env = {"PYTHONPATH": f"{site}:{root}", "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    running = hvdnb.current()
    if running is not None and running.running:
        running.stop()
    cluster = hvdnb.Cluster(n=2, timeout=240, engine_env=env).start()
    work = tmp_path / "keras"
    work.mkdir()
    try:
        capsys.readouterr()
        code = (
            f"import os, runpy\nos.chdir({str(work)!r})\n"
            f"_ = runpy.run_path({str(EXAMPLES / name)!r}, run_name='__main__')\n"
        )
        shell.run_cell_magic("distributed", "", code)
        out = capsys.readouterr().out
    finally:
        cluster.stop()
    # fit is verbose on rank 0 only (a progress line of rank 1 would be labelled "[1]" or
    # "[0,1]"; the warm-up callback's own line comes from every rank, as Horovod's does)
    assert re.search(r"^\[0\] Epoch 24/24", out, re.M), out[-3000:]
    assert not re.search(r"^\[(1|0,1)\] Epoch \d+/24", out, re.M), out[-3000:]
    accs = [float(a) for a in re.findall(r" accuracy: ([0-9.]+)", out)]
    assert accs and accs[-1] > 0.5, accs[-5:]  # chance is 0.1
    assert "learning rate" in out.lower(), out[-3000:]  # LearningRateWarmupCallback, verbose
    assert len(list(work.glob("checkpoint-*.h5"))) == 24
