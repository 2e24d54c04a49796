"""A function fits on a screen: none in ``hvdnb/`` is over 100 lines (STYLE.md, "Objects").

A function's length runs from its ``def`` (or first decorator) to its last line, docstring,
comments and nested functions included. Past ~60 lines, look for the state machine or the
table inside it (``notebook/cellwait.py`` is the cell's wait, taken out of a 159-line loop).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 100

#: functions not split yet: ``path:qualified name`` -> their length when listed. Empty since
#: issue 32 split the last ones: a long function is split, not listed. A listed function that
#: grew fails too: the list only holds what was already there.
NOT_YET_SPLIT: dict[str, int] = {}


def _functions(path: Path) -> list[tuple[str, int]]:
    """(qualified name, length in lines) of every function in ``path``, nested included."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                out.append((name, (child.end_lineno or child.lineno) - start + 1))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return out


def _too_long() -> dict[str, int]:
    found = {}
    for path in sorted((ROOT / "hvdnb").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for name, length in _functions(path):
            if length > MAX_LINES:
                found[f"{rel}:{name}"] = length
    return found


def test_no_function_in_hvdnb_is_over_100_lines():
    found = _too_long()
    new = {k: n for k, n in found.items() if k not in NOT_YET_SPLIT}
    assert not new, (
        f"functions over {MAX_LINES} lines: "
        + ", ".join(f"{k} ({n} lines)" for k, n in sorted(new.items()))
        + ": split them (a helper per step, or the state machine / table inside them)"
    )
    grown = {k: n for k, n in found.items() if k in NOT_YET_SPLIT and n > NOT_YET_SPLIT[k]}
    assert not grown, f"listed functions that grew (split them instead): {grown}"
    gone = sorted(k for k in NOT_YET_SPLIT if k not in found)
    assert not gone, f"split or gone: remove {gone} from NOT_YET_SPLIT"


def test_the_measure_counts_a_long_function_and_its_nested_ones(tmp_path):
    src = "class A:\n    @staticmethod\n    def f():\n        def g():\n            pass\n"
    src += "".join(f"        x{i} = {i}\n" for i in range(100))
    (tmp_path / "m.py").write_text(src)
    lengths = dict(_functions(tmp_path / "m.py"))
    assert lengths == {"A.f": 104, "A.f.g": 2}  # from the decorator on
