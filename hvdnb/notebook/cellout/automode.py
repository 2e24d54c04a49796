"""``%dist auto on``: every following cell runs on the ranks, without ``%%distributed``.

A cell is rewritten before IPython reads it (an input transformer, the first of
``input_transformers_cleanup``): its text becomes ``%%distributed`` + the cell, so it gets
everything that magic does (merged output, errors named by rank, timeouts, the panel,
export). Other magics and ``!`` lines in it run on the ranks, as in a ``%%distributed``
cell. Left in the notebook: a cell that starts with ``%%local`` (the line is dropped), one
that already starts with ``%%distributed``, and one made only of ``%dist`` lines (and
comments), so the cluster stays in reach.

The mode ends with ``%dist auto off``, ``%dist stop``, or the loss of a rank, each time with
one line that says so; an exception in a cell does not end it. ipyparallel's ``%autopx``
sends every cell, ``%dist`` lines included, to the engines, where ``%dist`` does not exist,
so the notebook could not leave it: where hvdnb is loaded, ``%autopx`` toggles this mode.

Owns: the mode's state and the rewriting. Never: run a cell itself (``%%distributed`` does).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["enabled", "install", "off", "on", "rewrite"]

_SHELLS: dict[int, Any] = {}  # id(shell) -> shell, while the mode is on there


#: ``name?``, ``name??``, ``?name``: IPython's help on a name, answered in the notebook (from
#: rank 0 when only the ranks have it: ``hvdnb.notebook.cellout.introspect``)
_HELP = re.compile(r"^\?{0,2}[A-Za-z_][\w.]*\?{0,2}$")


def _is_local(lines: list[str]) -> bool:
    """A cell of ``%dist`` lines and comments only (or empty), or one help request: the
    notebook's."""
    body = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    if len(body) == 1 and "?" in body[0] and _HELP.match(body[0]):
        return True
    return all(ln.startswith("%dist ") or ln == "%dist" for ln in body)


def rewrite(lines: list[str]) -> list[str]:
    """The cell as IPython will run it in auto mode (``lines`` keep their newlines)."""
    first = next((ln for ln in lines if ln.strip()), "")
    head = first.strip()
    if [ln.strip() for ln in lines if ln.strip()] == ["%autopx"]:
        return ["%dist auto off\n"]
    if head == "%%local" or head.startswith("%%local "):
        i = lines.index(first)
        return lines[:i] + lines[i + 1 :]
    if head.startswith("%%distributed") or _is_local(lines):
        return lines
    return ["%%distributed\n", *lines]


def enabled(shell: Any) -> bool:
    return id(shell) in _SHELLS


def on(shell: Any) -> str:
    if not enabled(shell):
        shell.input_transformers_cleanup.insert(0, rewrite)
        _SHELLS[id(shell)] = shell
    return (
        "hvdnb: auto mode on: every cell runs on the ranks as %%distributed; a cell that "
        "starts with %%local runs here, and so do %dist lines; `%dist auto off` ends it"
    )


def off(shell: Any, why: str = "`%dist auto off`") -> str | None:
    """End the mode in ``shell``; the line that says so, or None when it was off."""
    if not enabled(shell):
        return None
    del _SHELLS[id(shell)]
    try:
        shell.input_transformers_cleanup.remove(rewrite)
    except ValueError:
        pass
    return f"hvdnb: auto mode off ({why}): cells run in the notebook again"


def _autopx(lines: list[str]) -> list[str]:
    """``%autopx`` alone in a cell toggles auto mode (``%dist auto on|off``), as it toggles
    ipyparallel's: sending ``%dist`` itself to the engines would leave the notebook no way
    out of the mode."""
    body = [ln.strip() for ln in lines if ln.strip()]
    if body == ["%autopx"]:
        shell = next(iter(_SHELLS.values()), None)
        return ["%dist auto off\n" if shell is not None else "%dist auto on\n"]
    return lines


def install(shell: Any) -> None:
    """Make ``%autopx`` mean ``%dist auto on``/``off`` in ``shell`` (once)."""
    if _autopx not in shell.input_transformers_cleanup:
        shell.input_transformers_cleanup.append(_autopx)
