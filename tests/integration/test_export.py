"""From notebook to batch job: ``%dist export`` on a real session, the script run for real
under ``mpiexec -n 2`` and ``torchrun --nproc-per-node 2`` (and sbatch where Slurm runs), and
one clear message for each input a script cannot take.

Same seeds, same result: notebook 03's training (DistributedSampler with a seed, broadcast
from rank 0, averaged gradients) is deterministic, and a sum of two ranks' values is exact
in either order, so the script must print the notebook's epoch losses and accuracy to
every printed digit (tolerance: equal strings at the 4 decimals printed).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from IPython.core.error import UsageError

from hvdnb.notebook.cellout import cells
from hvdnb.notebook.headless.export import from_notebook
from tests.conftest import hvdnb_export

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
NB03 = ROOT / "notebooks" / "03-data-parallel-mlp.ipynb"
BIN = Path(sys.executable).parent
NO_JUPYTER = ("IPython", "ipyparallel", "ipykernel", "jupyter_client", "ipywidgets", "zmq")
# runs the script as __main__, then says which Jupyter modules it imported (none, we hope)
# one os.write per rank: two ranks' print() calls (text, then newline) can interleave
PROBE = (
    "import os, runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__'); "
    "sys.stdout.flush(); "
    f"os.write(1, ('jupyter modules: ' + str(sorted({{m.split('.')[0] for m in sys.modules}} & {set(NO_JUPYTER)!r})) + chr(10)).encode())"
)


def _distributed_cells(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    return [
        c.source.split("\n", 1)[1]
        for c in nb.cells
        if c.cell_type == "code" and c.source.startswith("%%distributed")
    ]


def _results(text: str) -> tuple[list[str], list[str]]:
    """The epoch lines' mean-over-ranks losses and the final accuracy, as printed."""
    means = sorted(set(re.findall(r"epoch (\d+): my loss [\d.]+, mean over ranks ([\d.]+)", text)))
    acc = re.findall(r"final test accuracy ([\d.]+)", text)
    return [f"{e}:{m}" for e, m in means], sorted(set(acc))


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )


@pytest.fixture(scope="module")
def session(dist2):
    """Notebook 03's %%distributed cells run on a real 2-rank session, and what they printed."""
    dist2.history.clear()
    printed = []
    for code in _distributed_cells(NB03):
        res = cells.run_cell(dist2, code, stream=False, quiet=True)
        printed.append("\n".join(res.stdout.values()))
    return dist2, "\n".join(printed), list(dist2.history)


def test_export_runs_under_mpiexec_and_torchrun_with_the_notebooks_result(
    session, shell, tmp_path, capsys
):
    cluster, printed, history = session
    cluster.history[:] = history
    expected = _results(printed)
    assert len(expected[0]) == 4 and expected[1], (expected, printed)
    script = tmp_path / "train03.py"
    shell.run_line_magic("dist", f"export {script}")
    out = capsys.readouterr().out
    assert f"wrote {script}" in out and f"mpiexec -n 2 python {script}" in out, out
    text = script.read_text()
    assert text.count("# --- cell ") == 4 and "hvdnb.rank.script.init(" in text
    for cmd in (
        [str(BIN / "mpiexec"), "-n", "2", sys.executable, "-c", PROBE, str(script)],
        [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node",
            "2",
            "--no-python",
            sys.executable,
            "-c",
            PROBE,
            str(script),
        ],
    ):
        res = subprocess.run(
            cmd, capture_output=True, text=True, timeout=180, env=_env(), cwd=tmp_path
        )
        assert res.returncode == 0, f"{cmd[0]}:\n{res.stdout}\n{res.stderr[-3000:]}"
        assert _results(res.stdout) == expected, (cmd[0], res.stdout)
        assert res.stdout.count("jupyter modules: []") == 2, res.stdout


def test_targets_cells_keep_their_ranks_and_knobs_their_last_values(dist2, shell, tmp_path):
    dist2.history.clear()
    cells.run_cell(dist2, "import hvdnb\nk = hvdnb.knobs(batch_size=16, lr=0.1)", quiet=True)
    shell.run_line_magic("dist", "knobs batch_size=64")
    cells.run_cell(
        dist2,
        'doc = """two\nlines"""\nprint(f"only rank 1 {k.batch_size}")',
        targets="1",
        quiet=True,
    )
    cells.run_cell(dist2, "print(f'everyone {k.batch_size} {k.lr}')", quiet=True)
    script = tmp_path / "knobs.py"
    shell.run_line_magic("dist", f"export {script} --launcher torchrun")
    res = subprocess.run(
        [str(BIN / "mpiexec"), "-n", "2", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("only rank 1 64") == 1  # one rank, and the knob's last value
    assert res.stdout.count("everyone 64 0.1") == 2


@pytest.mark.parametrize(
    "setup, line, message",
    [
        ([], "export {p}", "no %%distributed cell has run in this session"),
        (
            ["x = 5\nraise ValueError('boom')", "print(x)"],
            "export {p}",
            "cell {1} uses `x`, which no exported cell defines",
        ),
        (
            ["import os\nfiles = !ls"],
            "export {p} --cells all",
            "cell {0} uses IPython syntax a script cannot run ('files = !ls')",
        ),
        (["%time y = 1"], "export {p} --cells all", "uses IPython syntax a script cannot run"),
        (["z = 1"], "export {d}", "the script's name must end in .py"),
        (["z = 1"], "export {p} --launcher pbs", "--launcher 'pbs': use one of mpiexec, torchrun"),
        (["z = 1"], "export {p} --cells some", "--cells 'some': use ok"),
        (["z = 1"], "export", "%dist export needs the script's path"),
    ],
)
def test_bad_export_input_is_one_clear_message(dist2, shell, tmp_path, setup, line, message):
    dist2.history.clear()
    numbers = []
    for code in setup:
        try:
            res = cells.run_cell(dist2, code, quiet=True, stream=False)
            numbers.append(res.cell)
        except Exception:
            numbers.append(dist2.cell_no)
    p = tmp_path / "out.py"
    with pytest.raises(UsageError) as exc:
        shell.run_line_magic("dist", line.format(p=p, d=tmp_path))
    assert message.format(*numbers) in str(exc.value), str(exc.value)
    assert not p.exists(), "a refused export wrote a file"


def test_hvdnb_export_reads_a_saved_notebook(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext hvdnb\n%dist start -n 3"),
        nbformat.v4.new_code_cell("%%distributed\nimport hvdnb\nk = hvdnb.knobs(lr=0.1)"),
        nbformat.v4.new_code_cell("%dist knobs lr=0.05"),
        nbformat.v4.new_code_cell("%%distributed -t 0\nprint('rank 0 says', k.lr)"),
    ]
    path = tmp_path / "saved.ipynb"
    nbformat.write(nb, path)
    res = hvdnb_export(path, _env())
    assert res.returncode == 0, res.stderr
    assert "run it with: mpiexec -n 3 python" in res.stdout
    cells_, knobs, n = from_notebook(path)
    assert [c.ranks for c in cells_] == [None, [0]] and knobs == {"lr": 0.05} and n == 3
    script = path.with_suffix(".py")
    run = subprocess.run(
        [str(BIN / "mpiexec"), "-n", "2", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert run.returncode == 0 and run.stdout.count("rank 0 says 0.05") == 1, run
    bad = hvdnb_export(tmp_path / "no.ipynb", _env())
    assert bad.returncode == 2 and "no such notebook" in bad.stderr


def _slurm_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    return out.returncode == 0 and any(
        s.strip().rstrip("*") in ("idle", "mixed") for s in out.stdout.splitlines()
    )


def test_sbatch_script_runs_on_slurm(session, shell, tmp_path):
    if not _slurm_up():
        pytest.skip("Slurm is not running here: tests/slurm/setup_slurm.sh (as root) starts it")
    cluster, printed, history = session
    cluster.history[:] = history
    script = tmp_path / "job03.py"
    shell.run_line_magic("dist", f"export {script} --launcher slurm")
    sb = script.with_suffix(".sbatch")
    assert "#SBATCH --ntasks=2" in sb.read_text()
    res = subprocess.run(
        ["sbatch", "--wait", str(sb)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=_env(),
    )
    outs = list(tmp_path.glob("job03-*.out"))
    log = outs[0].read_text() if outs else ""
    assert res.returncode == 0, f"{res.stdout}{res.stderr}\n{log[-3000:]}"
    assert _results(log) == _results(printed), log
