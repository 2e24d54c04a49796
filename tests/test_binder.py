"""Binder set-up (``binder/``): requirements install into a fresh venv and postBuild succeeds.

Decision, for speed and to stay offline-safe: the slow test installs ``binder/requirements.txt``
into a fresh ``python -m venv`` (no system site-packages) with pip's configured index, but
without the requirement file's ``--extra-index-url`` line (the PyTorch CPU index, which Binder
needs to avoid CUDA wheels but which this machine cannot reach; here ``torch==2.13.0`` comes
from the local CPU wheel through pip's find-links instead). Every package line is installed
as written, then ``binder/postBuild`` runs unchanged with the venv first on PATH, and the
resulting environment executes a teaching notebook on 2 ranks. About 2-3 minutes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"


def _requirement_lines() -> list[str]:
    lines = (BINDER / "requirements.txt").read_text().splitlines()
    return [ln.split("#")[0].strip() for ln in lines if ln.split("#")[0].strip()]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_requirements_cover_the_package_and_pin_cpu_torch() -> None:
    reqs = [r for r in _requirement_lines() if not r.startswith("-")]
    names = {_name(r) for r in reqs}
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    missing = {_name(d) for d in deps} - names
    assert not missing, f"binder/requirements.txt lacks {sorted(missing)}"
    pin = [
        ln for ln in (ROOT / "constraints.txt").read_text().splitlines() if ln.startswith("torch")
    ]
    assert pin and pin[0].strip() in reqs, "torch must be pinned as in constraints.txt"
    assert "scikit-learn" in names, "the notebooks load sklearn's digits"
    assert any("download.pytorch.org/whl/cpu" in r for r in _requirement_lines())
    post = BINDER / "postBuild"
    assert os.access(post, os.X_OK), "postBuild must be executable"
    text = post.read_text()
    assert text.startswith("#!") and "hvdnb install-kernel" in text
    assert not (BINDER / "apt.txt").exists() or (BINDER / "apt.txt").read_text().strip()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_binder_environment_builds_and_runs_a_notebook(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py, bindir = venv / "bin" / "python", venv / "bin"
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("\n".join(r for r in _requirement_lines() if not r.startswith("--")) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(PATH=f"{bindir}{os.pathsep}{env['PATH']}", PIP_DISABLE_PIP_VERSION_CHECK="1")
    res = subprocess.run(
        # --no-compile: byte-compiling every installed module (transformers alone has
        # thousands) is what Binder does at build time, not what this test checks
        [str(py), "-m", "pip", "install", "-q", "--no-compile", "-r", str(reqs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    res = subprocess.run(
        [str(BINDER / "postBuild")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "hvdnb ready, torch 2.13.0" in res.stdout
    spec = json.loads((venv / "share/jupyter/kernels/hvdnb/kernel.json").read_text())
    assert Path(spec["argv"][0]) == py and "--ext=kernels_ext.autoload" in spec["argv"]
    res = subprocess.run(
        [str(bindir / "jupyter"), "kernelspec", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert re.search(r"^\s*hvdnb\s", res.stdout, re.M), res.stdout

    # the environment Binder would build runs the first lesson end to end
    out = tmp_path / "01.ipynb"
    res = subprocess.run(
        [
            str(bindir / "hvdnb"),
            "run",
            "notebooks/01-ranks-and-collectives.ipynb",
            "-n",
            "2",
            "-o",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "allreduce matches the formula: True" in out.read_text()
