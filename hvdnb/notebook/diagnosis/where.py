"""``%dist where``: the live Python stack of every rank, identical stacks merged.

Each rank's position is read without stopping it. With py-spy installed and the rank on
this host, ``py-spy dump --pid`` reads the stack from outside the process, so it works even
when the rank holds the GIL in C code and cannot answer anything. Otherwise (py-spy missing,
no permission to attach, a rank on another host) the rank's side-channel thread reports its
main thread's frames (``sys._current_frames``, the faulthandler way), which works whenever
that thread can take the GIL. Frames are shown from the cell's first frame inward; a rank
not running a cell says so.

Owns: asking, reading py-spy's output, merging. Never: interrupt or change the ranks.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from hvdnb.notebook.metrics.ranklabels import format_ranks
from hvdnb.notebook.metrics.store import get_store
from hvdnb.protocol import kinds

__all__ = ["format_stacks", "from_replies", "pyspy_stack", "rank_stacks"]

_PYSPY_FRAME = re.compile(r"^\s+(?P<func>.+?) \((?P<file>.+):(?P<line>\d+)\)\s*$")


def _pyspy() -> str | None:
    exe = Path(sys.executable).parent / "py-spy"
    return str(exe) if exe.exists() else shutil.which("py-spy")


def pyspy_stack(pid: int, timeout: float = 5.0) -> list[str] | None:
    """The main thread's frames from the cell inward, read by py-spy; ``[]`` when no cell
    runs; None when py-spy is missing or cannot attach."""
    exe = _pyspy()
    if exe is None:
        return None
    try:
        res = subprocess.run(
            [exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    frames: list[tuple[str, str, int]] = []
    in_main = False
    for line in res.stdout.splitlines():
        if line.startswith("Thread "):
            in_main = line.split()[1] in (str(pid), hex(pid))
            continue
        m = _PYSPY_FRAME.match(line)
        if in_main and m:
            frames.append((m["func"], m["file"], int(m["line"])))
    frames.reverse()  # py-spy lists the innermost frame first
    first = next((i for i, f in enumerate(frames) if f[1].startswith("<cell ")), None)
    if first is None:
        return []
    out = []
    for func, file, lineno in frames[first:]:
        if not file.startswith("<"):
            parts = file.split("/")
            file = (
                "/".join(parts[parts.index("site-packages") + 1 :])
                if "site-packages" in parts
                else "/".join(parts[-3:])
            )
        out.append(f"{file} line {lineno}, in {func}")
    return out


def _ask(cluster: Any, ranks: list[int], timeout: float) -> dict[int, dict[str, Any]]:
    ch = getattr(cluster, "channel", None)
    if ch is None:
        return {}
    return dict(ch.ask(ranks, kinds.WHERE_ASK, kinds.WHERE, timeout, "where"))


def rank_stacks(
    cluster: Any, timeout: float = 2.0, pyspy: bool = True
) -> dict[int, dict[str, Any]]:
    """rank -> ``{"stack": [frame lines] | None, "how": "py-spy" | "rank" | None,
    "note": text}`` for every live rank of ``cluster``."""
    dead = set(cluster.dead_ranks())
    ranks = [r for r in range(cluster.n) if r not in dead]
    out = from_replies(_ask(cluster, ranks, timeout), ranks, pyspy)
    for r in sorted(dead):
        out[r] = {"stack": None, "how": None, "note": "dead (see %dist status)"}
    return out


def from_replies(
    replies: dict[int, dict[str, Any]], ranks: list[int], pyspy: bool = True
) -> dict[int, dict[str, Any]]:
    """``rank_stacks`` from "where" answers already received (the stall detector's)."""

    info = get_store().rank_info
    here = socket.gethostname()
    out: dict[int, dict[str, Any]] = {}
    for r in ranks:
        rep = replies.get(r) or {}
        pid = rep.get("pid") or info.get(r, {}).get("pid")
        host = info.get(r, {}).get("host")
        stack = None
        how = None
        if pyspy and pid and (host in (None, here)):
            stack = pyspy_stack(int(pid))
            how = "py-spy" if stack is not None else None
        if stack is None and rep:
            stack, how = list(rep.get("stack") or []), "rank"
        note = ""
        if stack is None:
            note = (
                "did not answer and could not be read (install py-spy to read a rank "
                "that holds the GIL)"
            )
        elif not stack:
            note = "not running a cell"
        out[r] = {"stack": stack, "how": how, "note": note, "collective": rep.get("collective")}
    return out


def format_stacks(stacks: dict[int, dict[str, Any]]) -> str:
    """Ranks with identical stacks merged: ``ranks 0,2 (py-spy):`` then the frames."""

    groups: dict[tuple[Any, ...], list[int]] = {}
    for r, s in sorted(stacks.items()):
        key = (tuple(s["stack"]) if s["stack"] else None, s["note"], s["how"])
        groups.setdefault(key, []).append(r)
    lines = []
    for (stack, note, how), ranks in groups.items():
        who = f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}"
        if not stack:
            lines.append(f"{who}: {note}")
            continue
        lines.append(f"{who} ({'read by py-spy' if how == 'py-spy' else 'as the rank reported'}):")
        lines += [f"    {f}" for f in stack]
    return "\n".join(lines)
