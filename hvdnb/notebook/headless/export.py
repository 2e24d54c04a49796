"""From notebook to batch job: the ``%%distributed`` cells as a script for mpiexec, torchrun
or Slurm (``%dist export``, ``hvdnb export NOTEBOOK``).

The script is the cells in execution order (failed cells left out unless asked), each under
a ``# --- cell N ---`` heading; a cell that ran on some ranks only (``--targets``) runs under
``if hvdnb.rank.script.rank() in (...)``. It starts with ``hvdnb.rank.script.init(...)``, which does
for the process what ``%dist start`` does for an engine (rank, process group, torchrun
variables, threads) and sets the knob values in force at export time as the starting
values of ``hvdnb.knobs(...)``. Beside it: the launch line (``mpiexec -n N`` or
``torchrun --nproc-per-node N``) in its docstring and printed, or, for Slurm, an sbatch
file with the options the cluster was started with.

A script cannot run what only IPython understands: a cell with a magic or a shell escape is
refused, naming the cell and the line; so is a cell that uses a name no exported cell
defines (it came from the notebook kernel, or from a cell left out). Nothing is written then.

Owns: collecting cells (session history or a saved notebook), those checks, and writing
the files. Never: run the cells, import torch or Jupyter at import time, or write anywhere
but the paths given.
"""

from __future__ import annotations

import builtins
import datetime
import io
import re
import shlex
import symtable
import sys
import textwrap
import tokenize
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hvdnb.notebook.cellout.history import ExportCell

__all__ = ["ExportCell", "ExportError", "export", "from_notebook", "from_session"]

LAUNCHERS = ("mpiexec", "torchrun", "slurm")
_MAGIC_LINE = re.compile(r"^\s*(%|!)|=\s*[!%]")


class ExportError(ValueError):
    """The session or notebook cannot become a script as it is; the message says why."""


# ---------------------------------------------------------------------- collecting
def from_session(cluster: Any, cells: str = "ok") -> list[ExportCell]:
    """The ``%%distributed`` cells this session ran on ``cluster``, in execution order."""
    history = list(getattr(cluster, "history", []) or [])
    if not history:
        raise ExportError(
            "no %%distributed cell has run in this session: nothing to export "
            "(run the training cells first, then %dist export PATH)"
        )
    return _select(history, cells)


def from_notebook(
    path: str | Path, cells: str = "ok"
) -> tuple[list[ExportCell], dict[str, Any], int | None]:
    """The ``%%distributed`` cells of a saved notebook, the knob values its ``%dist knobs``
    lines set (those without ``--at-step``/``--after``, in order) and the rank count of
    its ``%dist start -n N`` (None when not given).

    Order: by execution count where the notebook was run, else the cells' order. A cell
    "failed" when its saved outputs hold an error.
    """
    import nbformat  # noqa: PLC0415  Jupyter's libraries: only for hvdnb run and export

    p = Path(path)
    if not p.exists():
        raise ExportError(f"{p}: no such notebook")
    try:
        nb = nbformat.read(p, as_version=4)
    except Exception as exc:
        raise ExportError(f"{p} is not a notebook nbformat can read: {exc}") from None
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    executed = [c for c in code_cells if c.get("execution_count")]
    ordered = sorted(executed, key=lambda c: c.execution_count) if executed else code_cells
    out: list[ExportCell] = []
    knobs: dict[str, Any] = {}
    n: int | None = None
    for pos, c in enumerate(ordered, 1):
        src = c.source
        number = c.get("execution_count") or pos
        if src.lstrip().startswith("%%distributed"):
            first, _, body = src.lstrip().partition("\n")
            ranks = _targets_of(first)
            failed = any(o.get("output_type") == "error" for o in c.get("outputs", []))
            out.append(ExportCell(number, body, ranks, not failed))
            continue
        for line in src.splitlines():
            words = line.strip().split()
            if words[:2] == ["%dist", "start"] and "-n" in words:
                try:
                    n = int(words[words.index("-n") + 1])
                except (IndexError, ValueError):
                    pass
            if words[:2] == ["%dist", "knobs"] and not {"--at-step", "--after"} & set(words):
                for w in words[2:]:
                    name, eq, raw = w.partition("=")
                    if eq and name.isidentifier():
                        try:
                            knobs[name] = int(raw) if raw.lstrip("+-").isdigit() else float(raw)
                        except ValueError:
                            pass
    if not out:
        raise ExportError(f"{p} has no %%distributed cell: nothing to export")
    return _select(out, cells), knobs, n


def _targets_of(magic_line: str) -> list[int] | None:
    words = shlex.split(magic_line)
    for i, w in enumerate(words):
        spec = None
        if w in ("-t", "--targets") and i + 1 < len(words):
            spec = words[i + 1]
        elif w.startswith("--targets="):
            spec = w.split("=", 1)[1]
        if spec is not None:
            out = []
            for part in spec.split(","):
                if ":" in part:
                    raise ExportError(
                        f"cannot export --targets {spec!r} from a saved notebook "
                        "without its rank count: list the ranks (0,2)"
                    )
                out.append(int(part))
            return out
    return None


def _select(history: Sequence[ExportCell], cells: str) -> list[ExportCell]:
    if cells not in ("ok", "all"):
        raise ExportError(f"--cells {cells!r}: use ok (leave failed cells out) or all")
    chosen = [c for c in history if cells == "all" or c.ok]
    if not chosen:
        raise ExportError(
            "every %%distributed cell of this session failed: nothing to export "
            "(--cells all exports them anyway)"
        )
    return chosen


# ---------------------------------------------------------------------- checking
def check(cells: Sequence[ExportCell]) -> None:
    """Refuse what a script cannot run: IPython syntax, syntax errors, undefined names."""
    from IPython.core.inputtransformer2 import TransformerManager  # noqa: PLC0415  IPython: only inside a kernel

    tm = TransformerManager()
    defined = set(dir(builtins)) | {"__name__", "__file__", "__doc__", "hvdnb"}
    late: list[tuple[int, str]] = []  # names used inside functions: defined by the end?
    star = False
    for cell in cells:
        code = cell.code
        if "get_ipython()" in tm.transform_cell(code):  # magics, !cmd, obj? all become it
            line = next(
                (ln.strip() for ln in code.splitlines() if _MAGIC_LINE.search(ln)),
                "a magic or shell escape",
            )
            raise ExportError(
                f"cell {cell.number} uses IPython syntax a script cannot run ({line!r}): "
                "rewrite it in Python (subprocess for !commands) or leave the cell out"
            )
        try:
            table = symtable.symtable(code, f"<cell {cell.number}>", "exec")
        except SyntaxError as exc:
            raise ExportError(
                f"cell {cell.number} is not valid Python (line {exc.lineno}: {exc.msg})"
            ) from None
        top = table.get_symbols()
        bound = {
            s.get_name() for s in top if s.is_assigned() or s.is_imported() or s.is_namespace()
        }
        # a function's `global W` then `W = ...` (PyTorch's DDP tutorial keeps results so)
        # defines W once it is called
        bound |= {
            s.get_name()
            for child in _walk(table)
            for s in child.get_symbols()
            if s.is_declared_global() and s.is_assigned()
        }
        star = star or ("*" in code and re.search(r"import\s+\*", code) is not None)
        used = {s.get_name() for s in top if s.is_referenced()}
        missing = sorted(used - defined - bound)
        if missing and not star:
            raise _undefined(cell, missing)
        defined |= bound
        for child in _walk(table):
            for s in child.get_symbols():
                if s.is_referenced() and s.is_global() and not s.is_declared_global():
                    late.append((cell.number, s.get_name()))
    if not star:
        for number, name in late:
            if name not in defined:
                cell = next(c for c in cells if c.number == number)
                raise _undefined(cell, [name])


def _undefined(cell: ExportCell, names: list[str]) -> ExportError:
    shown = ", ".join(f"`{n}`" for n in names[:5])
    return ExportError(
        f"cell {cell.number} uses {shown}, which no exported cell defines: it came from the "
        "notebook kernel (or from a cell left out); define it in a %%distributed cell, "
        "then export again"
    )


def _walk(table: Any) -> list[Any]:
    out = []
    for child in table.get_children():
        out.append(child)
        out.extend(_walk(child))
    return out


# ---------------------------------------------------------------------- writing
def launch_line(launcher: str, n: int, script: Path) -> str:
    py = "python"
    if launcher == "mpiexec":
        return f"mpiexec -n {n} {py} {shlex.quote(str(script))}"
    if launcher == "torchrun":
        return f"torchrun --standalone --nproc-per-node {n} {shlex.quote(str(script))}"
    return f"sbatch {shlex.quote(str(script.with_suffix('.sbatch')))}"


def render(
    cells: Sequence[ExportCell],
    *,
    n: int,
    launcher: str,
    knobs: dict[str, Any],
    backend: str | None,
    source: str,
    script: Path,
) -> str:
    """The script's text."""
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    numbers = ", ".join(str(c.number) for c in cells)
    lines = [
        "#!/usr/bin/env python",
        f'"""Exported by hvdnb from {source} on {when}: %%distributed cells {numbers},',
        "in execution order (notebook order for a notebook never run).",
        "",
        f"Run on {n} ranks (any of these):",
        "",
        f"    {launch_line('mpiexec', n, script)}",
        f"    {launch_line('torchrun', n, script)}",
    ]
    if launcher == "slurm":
        lines.append(f"    {launch_line('slurm', n, script)}")
    lines += [
        "",
        "hvdnb.log / phase / knobs work as in the notebook. Without a notebook their points",
        "stay in a small in-memory buffer; HVDNB_METRICS_DIR=dir writes each rank's to",
        "dir/rank<N>.jsonl. The knobs start from the values in force at export time.",
        '"""',
        "import hvdnb.rank.script",
        "",
        f"hvdnb.rank.script.init(backend={backend!r}, knobs={knobs!r})",
        "",
    ]
    for c in cells:
        head = f"# --- cell {c.number}"
        if c.ranks is not None:
            head += f" (ranks {','.join(map(str, c.ranks))} only)"
        if not c.ok:
            head += " (failed in the notebook)"
        lines.append(head + " ---")
        body = c.code.rstrip() or "pass"
        if c.ranks is None:
            lines.append(body)
        else:
            guard = f"if hvdnb.rank.script.rank() in {tuple(c.ranks)!r}:"
            if _has_multiline_string(body):  # indenting would change the string's text
                lines.append(guard)
                lines.append(f"    exec(compile({body!r}, '<cell {c.number}>', 'exec'))")
            else:
                lines.append(guard)
                lines.append(textwrap.indent(body, "    "))
        lines.append("")
    return "\n".join(lines)


def _has_multiline_string(code: str) -> bool:
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.STRING and "\n" in tok.string:
                return True
    except (tokenize.TokenError, SyntaxError):
        return True
    return False


def sbatch_text(script: Path, n: int, slurm: dict[str, Any], extra: Sequence[str]) -> str:
    """An sbatch file that runs the script on ``n`` ranks with the cluster's Slurm options.

    The ranks start with this environment's ``mpiexec`` (MPICH's hydra uses the job's
    allocation), so MPI sees the whole job whatever ``--mpi`` plugin the site defaults to.
    """
    bindir = Path(sys.executable).parent
    opts = [
        f"#SBATCH --job-name={script.stem}",
        f"#SBATCH --ntasks={n}",
        f"#SBATCH --output={script.with_suffix('')}-%j.out",
    ]
    for k, v in slurm.items():
        if v:
            opts.append(f"#SBATCH --{k}={v}")
    opts += [f"#SBATCH {a}" for a in extra]
    return "\n".join(
        [
            "#!/bin/bash",
            *opts,
            f"# written by hvdnb export for {script.name}",
            "set -euo pipefail",
            f"cd {shlex.quote(str(script.parent.resolve()))}",
            f"exec {shlex.quote(str(bindir / 'mpiexec'))} -n {n} "
            f"{shlex.quote(sys.executable)} {shlex.quote(str(script.resolve()))}",
            "",
        ]
    )


def export(
    path: str | Path,
    cells: Sequence[ExportCell],
    *,
    n: int,
    launcher: str = "mpiexec",
    knobs: dict[str, Any] | None = None,
    backend: str | None = None,
    source: str = "a notebook session",
    slurm: dict[str, Any] | None = None,
    sbatch_args: Sequence[str] = (),
) -> tuple[list[Path], str]:
    """Check the cells, write the script (and the sbatch file for Slurm).

    Returns
    -------
    (paths written, the launch command)
    """
    if launcher not in LAUNCHERS:
        raise ExportError(f"--launcher {launcher!r}: use one of {', '.join(LAUNCHERS)}")
    script = Path(path)
    if script.suffix != ".py":
        raise ExportError(f"{script}: the script's name must end in .py")
    if script.is_dir():
        raise ExportError(f"{script} is a directory: give the script's file name")
    if not script.parent.exists():
        raise ExportError(f"{script.parent} does not exist: create it first")
    if n < 1:
        raise ExportError(f"the script needs at least one rank, not {n}")
    check(cells)
    text = render(
        cells,
        n=n,
        launcher=launcher,
        knobs=dict(knobs or {}),
        backend=backend,
        source=source,
        script=script,
    )
    compile(text, str(script), "exec")  # what we wrote must parse
    script.write_text(text)
    written = [script]
    if launcher == "slurm":
        sb = script.with_suffix(".sbatch")
        sb.write_text(sbatch_text(script, n, dict(slurm or {}), sbatch_args))
        written.append(sb)
    return written, launch_line(launcher, n, script)


def knobs_in_force(store: Any) -> dict[str, Any]:
    """The knob values the ranks use now (the store's spec, updated by every change)."""
    return {
        k: v.get("value") for k, v in getattr(store, "knob_spec", {}).items() if isinstance(v, dict)
    }
