"""The how-to guides' code runs: each page's blocks, in order, on a real 2-rank CPU cluster.

A page's ``ipython3``/``python`` blocks run as cells of one IPython shell with hvdnb loaded
(``%dist`` and ``%%distributed`` included), its ``bash`` blocks as shell commands, all in one
temporary directory (``notebooks/`` linked in), so a page reads like a notebook session and
is tested as one. Markers written above a block, invisible on the page:

- ``<!-- skip: REASON -->``: not run, the reason is reported (a GPU, Slurm, several hosts,
  a prompt that waits for an answer);
- ``<!-- needs: tensorflow -->``: skipped where TensorFlow is not installed;
- ``<!-- howto: raises -->``: the block must fail (it shows what an error looks like).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOWTO = ROOT / "docs" / "howto"
PAGES = sorted(p for p in HOWTO.glob("*.md") if p.stem != "index")

_BLOCK = re.compile(
    r"(?:^<!-- (skip|needs|howto): ([^\n]*?) -->\n)?^```(ipython3|python|bash)\n(.*?)^```$",
    re.M | re.S,
)


@dataclass
class Block:
    line: int
    lang: str
    code: str
    marker: str | None
    arg: str


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(text.count("\n", 0, m.start(3)) + 1, m.group(3), m.group(4), m.group(1), m.group(2))
        for m in _BLOCK.finditer(text)
    ]


def test_every_page_is_parsed() -> None:
    """A block this test cannot see would go unchecked: count the fences another way."""
    for page in PAGES:
        fences = re.findall(r"^```(ipython3|python|bash)$", page.read_text(), re.M)
        assert len(fences) == len(blocks(page)), page.name
        for b in blocks(page):
            if b.marker == "needs":
                assert b.arg == "tensorflow", f"{page.name}:{b.line}: unknown need {b.arg!r}"
            if b.marker == "howto":
                assert b.arg == "raises", f"{page.name}:{b.line}: unknown marker {b.arg!r}"


def _bash(code: str, cwd: Path, where: str) -> None:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    res = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, f"{where} failed:\n{code}\n{res.stdout}\n{res.stderr}"


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_howto_page_runs(page: Path, shell, tmp_path: Path, monkeypatch) -> None:
    import hvdnb

    todo = blocks(page)
    if not todo:
        pytest.skip(f"{page.name} has no code blocks")
    (tmp_path / "notebooks").symlink_to(ROOT / "notebooks")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    skipped = []
    has_tf = importlib.util.find_spec("tensorflow") is not None
    try:
        for b in todo:
            where = f"{page.name}:{b.line}"
            if b.marker == "skip":
                skipped.append(f"{where}: {b.arg}")
                continue
            if b.marker == "needs" and not has_tf:
                skipped.append(f"{where}: tensorflow is not installed (pip install -e '.[tf]')")
                continue
            if b.lang == "bash":
                _bash(b.code, tmp_path, where)
                continue
            result = shell.run_cell(b.code, store_history=False)
            if b.marker == "howto":
                assert not result.success, f"{where} should have raised:\n{b.code}"
            else:
                err = result.error_before_exec or result.error_in_exec
                assert result.success, f"{where} failed: {err!r}\n{b.code}"
    finally:
        running = hvdnb.current()
        if running is not None and running.running:
            running.stop()
    if skipped:
        print("skipped blocks:\n  " + "\n  ".join(skipped))
