"""The how-to guides' code runs: each page's blocks, in order, on a real 2-rank CPU cluster.

A page's ``ipython3``/``python`` blocks run as cells of one IPython shell with hvdnb loaded
(``%dist`` and ``%%distributed`` included), its ``bash`` blocks as shell commands, all in one
temporary directory (``notebooks/`` linked in), so a page reads like a notebook session and
is tested as one. Markers written above a block, invisible on the page:

- ``<!-- skip: REASON -->``: not run, the reason is reported (a GPU, Slurm, several hosts,
  a prompt that waits for an answer);
- ``<!-- needs: tensorflow -->``: skipped where TensorFlow is not installed;
- ``<!-- howto: raises -->``: the block must fail (it shows what an error looks like).

A ``text`` block right after a block that runs (nothing but blank lines between) is what the
page says that block prints: each of its lines must be a line of the block's output (stdout
and stderr), in the page's order; ``...`` in a shown line stands for any text. A ``text``
block after prose is an illustration and is not compared. Every fence on every docs page
(and the README) names its language: a bare one would swallow the prose after it.
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

from hvdnb.notebook.metrics.ranklabels import parse_ranks

ROOT = Path(__file__).resolve().parents[2]
HOWTO = ROOT / "docs" / "howto"
PAGES = sorted(p for p in HOWTO.glob("*.md") if p.stem != "index")

DOCS = ROOT / "docs"
#: a fence opens or closes a code block; a closing one carries no info string
_FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")
_MARKER = re.compile(r"^<!-- (skip|needs|howto): (.*?) -->$")
RUNS = ("ipython3", "python", "bash")


@dataclass
class Fence:
    line: int  # the opening fence's line, 1-based
    info: str  # its info string: the language, or ``{directive}``
    code: str
    before: list[str]  # the lines between the previous block's closing fence and this one
    closed: bool = True  # False: no fence closes it, so it runs to the page's end


def fences(text: str) -> list[Fence]:
    """Every fenced block of a Markdown page, as CommonMark closes them."""
    found: list[Fence] = []
    lines = text.split("\n")
    opened: tuple[int, str, str] | None = None  # line index, fence, info
    gap_from = 0
    for i, line in enumerate(lines):
        m = _FENCE.match(line)
        if not m:
            continue
        fence, info = m.group(1), m.group(2).strip()
        if opened is None:
            opened = (i, fence, info)
        elif fence[0] == opened[1][0] and len(fence) >= len(opened[1]) and not info:
            start, _, inf = opened
            code = "\n".join(lines[start + 1 : i]) + "\n"
            found.append(Fence(start + 1, inf, code, lines[gap_from:start]))
            opened, gap_from = None, i + 1
    if opened is not None:
        start, _, inf = opened
        code = "\n".join(lines[start + 1 :])
        found.append(Fence(start + 1, inf, code, lines[gap_from:start], closed=False))
    return found


@dataclass
class Block:
    line: int
    lang: str
    code: str
    marker: str | None
    arg: str
    output: str | None = None  # the text block right after it: what the page says it prints


def blocks(page: Path) -> list[Block]:
    """The blocks the test runs, in order, each with its marker and its shown output."""
    todo: list[Block] = []
    last: Block | None = None
    for f in fences(page.read_text()):
        if f.info in RUNS:
            above = [ln for ln in f.before if ln.strip()]
            m = _MARKER.match(above[-1]) if above else None
            last = Block(f.line, f.info, f.code, m and m.group(1), m.group(2) if m else "")
            todo.append(last)
            continue
        if f.info == "text" and last is not None and not any(ln.strip() for ln in f.before):
            last.output = f.code
        last = None
    return todo


def bare_fences(text: str) -> list[int]:
    """The lines of fences that open a block without naming its language, or that no fence
    closes (either swallows what follows)."""
    return [f.line for f in fences(text) if not f.info or not f.closed]


_TAG = re.compile(r"^\[(\d+(?:[-,]\d+)*)\] (.*)$")


def _tagged(line: str) -> tuple[set[int] | None, str]:
    """A line's ranks and text (``[0,1] x``: ({0, 1}, "x")); None: the line has no tag."""
    m = _TAG.match(line)
    return (set(parse_ranks(m[1])), m[2]) if m else (None, line)


def _shown_lines_missing(shown: str, got: str) -> list[str]:
    """The shown lines not found in ``got``'s lines in order (``...`` matches any text). A
    shown ``[0,1] x`` is found where the printed lines say ``x`` for ranks 0 and 1, merged
    into one line or not: whether both ranks' lines reach the notebook close enough in time
    to be merged is scheduling, not what the page teaches."""
    lines = [_tagged(ln.rstrip()) for ln in got.splitlines()]
    missing, at = [], 0
    for want in (ln.rstrip() for ln in shown.splitlines() if ln.strip()):
        ranks, text = _tagged(want)
        pattern = re.compile(".*".join(map(re.escape, text.split("..."))) + "$")
        covered: set[int] = set()
        hit = None
        for j in range(at, len(lines)):
            got_ranks, got_text = lines[j]
            if not pattern.match(got_text) or (ranks is None) != (got_ranks is None):
                continue
            if ranks is None or got_ranks is None:
                hit = j
                break
            if got_ranks <= ranks:
                covered |= got_ranks
                if covered == ranks:
                    hit = j
                    break
        if hit is None:
            missing.append(want)
        else:
            at = hit + 1
    return missing


def _doc_pages() -> list[Path]:
    pages = [p for p in DOCS.rglob("*.md") if "generated" not in p.relative_to(DOCS).parts]
    return sorted(pages) + [ROOT / "README.md"]


def test_no_page_opens_a_bare_fence() -> None:
    """A fence with no language opens a block that runs on to the next fence: the prose
    between, and the next code block, would show as one block of code."""
    bad = [
        f"{page.relative_to(ROOT)}:{line}"
        for page in _doc_pages()
        for line in bare_fences(page.read_text())
    ]
    assert not bad, "fences that name no language or are never closed: " + ", ".join(bad)


def test_the_checks_catch_what_they_are_for() -> None:
    """The fence and output checks on a made-up page: a bare fence, and a shown output that
    the block does not print, are caught."""
    page = "a\n\n```ipython3\nprint(1)\n```\n\n```\n4 cells\n```\n\nprose\n\n```bash\nls\n```\n"
    assert bare_fences(page) == [7]
    assert [f.info for f in fences(page)] == ["ipython3", "", "bash"]
    fixed = page.replace("```\n4", "```text\n4")
    assert bare_fences(fixed) == []
    assert [f.info for f in fences(fixed)] == ["ipython3", "text", "bash"]
    assert _shown_lines_missing("wrote x (4 cells)", "wrote x (1 cells)\n") == ["wrote x (4 cells)"]
    assert _shown_lines_missing("wrote x (... cells)\nb", "a\nwrote x (1 cells)\nb\n") == []
    # a line two ranks printed is found merged or not, never with a rank missing
    assert _shown_lines_missing("[0,1] same", "[1] same\n[0] same\n") == []
    assert _shown_lines_missing("[0,1] same", "[0,1] same\n") == []
    assert _shown_lines_missing("[0,1] same", "[1] same\n") == ["[0,1] same"]
    assert _shown_lines_missing("b\na", "a\nb\n") == ["a"]  # order counts
    assert bare_fences("```bash\nls\n") == [1]  # never closed


def test_every_page_is_parsed() -> None:
    """A block this test cannot see would go unchecked: count the fences another way."""
    for page in PAGES:
        runs = re.findall(r"^```(ipython3|python|bash)$", page.read_text(), re.M)
        assert len(runs) == len(blocks(page)), page.name
        for b in blocks(page):
            if b.marker == "needs":
                assert b.arg == "tensorflow", f"{page.name}:{b.line}: unknown need {b.arg!r}"
            if b.marker == "howto":
                assert b.arg == "raises", f"{page.name}:{b.line}: unknown marker {b.arg!r}"


def _bash(code: str, cwd: Path, where: str) -> str:
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
    return res.stdout + res.stderr


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_howto_page_runs(page: Path, shell, tmp_path: Path, monkeypatch, capsys) -> None:
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
            capsys.readouterr()  # what earlier blocks printed is theirs
            if b.lang == "bash":
                got = _bash(b.code, tmp_path, where)
            else:
                result = shell.run_cell(b.code, store_history=False)
                if b.marker == "howto":
                    assert not result.success, f"{where} should have raised:\n{b.code}"
                else:
                    err = result.error_before_exec or result.error_in_exec
                    assert result.success, f"{where} failed: {err!r}\n{b.code}"
                printed = capsys.readouterr()
                got = printed.out + printed.err
            if b.output is not None:
                missing = _shown_lines_missing(b.output, got)
                assert not missing, (
                    f"{where}: the page shows output the block did not print: {missing}\n"
                    f"it printed:\n{got}"
                )
    finally:
        running = hvdnb.current()
        if running is not None and running.running:
            running.stop()
    if skipped:
        print("skipped blocks:\n  " + "\n  ".join(skipped))
