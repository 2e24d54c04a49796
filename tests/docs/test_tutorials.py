"""``make docs`` builds a tutorial page only from a run in which every cell ran.

The staging code (``docs/_ext/hvdnb_docs.py``) against executed copies written here: a copy
with an error output is never taken (a failed ``hvdnb run -o`` leaves one behind), a cell
tagged ``raises-exception`` may raise, and a lesson without a good copy stops the build
naming the notebook and the cell. The last test runs a failing notebook for real (``hvdnb
run`` on 2 ranks) through the same path ``make docs`` takes.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import hvdnb_docs  # noqa: E402

LESSON = ROOT / "notebooks" / "01-ranks-and-collectives.ipynb"


def _executed(tmp_path: Path, *, error_in: int | None, tag: bool = False) -> Path:
    """An executed copy of lesson 01 with a stream output in every code cell, and an error
    output in code cell ``error_in`` (tagged ``raises-exception`` when ``tag``)."""
    nb = json.loads(LESSON.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for i, cell in enumerate(code):
        cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "ran\n"}]
        if i == error_in:
            cell["outputs"].append(
                {"output_type": "error", "ename": "ValueError", "evalue": "boom", "traceback": []}
            )
            if tag:
                cell["metadata"]["tags"] = ["raises-exception"]
    folder = tmp_path / "executed"
    folder.mkdir(exist_ok=True)
    (folder / LESSON.name).write_text(json.dumps(nb))
    return folder


def test_a_copy_in_which_a_cell_raised_is_never_taken(tmp_path):
    folder = _executed(tmp_path, error_in=None)
    assert hvdnb_docs.executed_copy(LESSON, folder) == folder / LESSON.name
    folder = _executed(tmp_path, error_in=2)
    assert hvdnb_docs.executed_copy(LESSON, folder) is None
    failed = hvdnb_docs.failed_cells(json.loads((folder / LESSON.name).read_text()))
    assert len(failed) == 1 and "ValueError: boom" in failed[0], failed
    # on purpose: a cell tagged raises-exception may show its error
    folder = _executed(tmp_path, error_in=2, tag=True)
    assert hvdnb_docs.executed_copy(LESSON, folder) == folder / LESSON.name


def test_a_lesson_without_a_good_copy_stops_the_build_naming_it(tmp_path):
    folder = _executed(tmp_path, error_in=1)
    with pytest.raises(hvdnb_docs.TutorialNotRun, match=LESSON.name):
        hvdnb_docs.stage_tutorials(folder, "", "main", execute=False, log=lambda _: None)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_failing_run_names_the_notebook_and_the_cell(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext hvdnb\n%dist start"),
        nbformat.v4.new_code_cell("%%distributed\nraise ValueError('a lesson that broke')"),
        nbformat.v4.new_code_cell("%dist stop"),
    ]
    src = tmp_path / "99-broken.ipynb"
    nbformat.write(nb, src)
    folder = tmp_path / "executed"
    with pytest.raises(hvdnb_docs.TutorialNotRun) as info:
        hvdnb_docs._execute(src, folder, 2, log=lambda _: None)
    text = str(info.value)
    assert "99-broken.ipynb" in text and "cell 2 ('%%distributed')" in text, text
    assert "a lesson that broke" in text, text
    # hvdnb run left its copy with the error; a later build does not take it
    assert (folder / src.name).exists()
    assert hvdnb_docs.executed_copy(src, folder) is None
    shutil.rmtree(folder)
