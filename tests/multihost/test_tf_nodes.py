"""Lesson 08 (TensorFlow's MultiWorkerMirroredStrategy) from the notebook across two Slurm
nodes: the lesson's own cells, run in order in the notebook kernel on the login node, with
its ``%dist start`` given the two-node Slurm (one CPU per node, so one worker on each host).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

from hvdnb.notebook.headless.runner import Kernel
from tests.multihost.hosts import MACHINES, two_node_slurm

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(420)]

LESSON = Path(__file__).resolve().parents[2] / "notebooks" / "08-tensorflow-multiworker.ipynb"
LOGIN = MACHINES["login"]


@pytest.fixture(scope="module")
def slurm():
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("TensorFlow is not installed (the tf extra)")
    yield from two_node_slurm(cpus=1)


def test_lesson_08_trains_across_two_slurm_nodes(slurm):
    nb = nbformat.read(LESSON, as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "code"]
    start = f"%dist start --launcher slurm -n 2 --ip {LOGIN} --time 10 --timeout 180"
    assert any("%dist start" in c for c in cells)
    cells = [re.sub(r"%dist start\b.*", start, c) for c in cells]
    env = {**slurm.env(), "HVDNB_PANEL": "inline"}
    text = []
    with Kernel(env, prefix=slurm.hosts.on("login", []), reach=LOGIN) as k:
        for i, source in enumerate(cells):
            got = k.run(source, timeout=300)
            assert got.error is None, (i, source[:200], got.traceback[-3000:])
            text.append(got.text + "".join(got.displayed.values()))
        k.run("%dist stop", timeout=60)
    out = "\n".join(text)
    h1, h2 = MACHINES["h1"], MACHINES["h2"]
    # TF_CONFIG: one worker on each host, at its own address, each rank its own index
    assert re.search(
        rf"\[0\] task \{{'type': 'worker', 'index': 0\}} of workers \['{h1}:\d+', '{h2}:\d+'\]", out
    ), out[:3000]
    assert "[1] task {'type': 'worker', 'index': 1}" in out, out[:3000]
    for line in (
        "2 replicas in sync",
        "weights identical on every rank: True",
        "every step of every rank reached the notebook: True",
    ):
        assert line in out, (line, out[-4000:])
    assert re.search(r"final test accuracy 0\.(9\d|8[5-9])", out), out[-4000:]
