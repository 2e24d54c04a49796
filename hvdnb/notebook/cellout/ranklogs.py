"""``%dist logs``: what each rank wrote, and what the notebook knows of how it ended.

Per rank: the rank's own log, ``<state dir>/logs/rank<N>.log``, written by the engine: its
stderr outside cells (ipyparallel's engine log, warnings, C libraries) and, on a fatal
signal it can catch (SIGSEGV, SIGABRT, SIGFPE, SIGBUS), every thread's Python stack
(faulthandler); appended across ``%dist restart``. Then the notebook's note: the cell a rank
died in, and, when its log ends without a Python traceback or a fatal-signal dump, that it
was ended from outside or by ``os._exit`` (a SIGKILL is what the out-of-memory killer sends).
Then what it printed in cells, whole (``<state dir>/logs/rank<N>.cells.log``, written by the
notebook as each message arrives: the cell's view merges lines and draws bars in place, this
file keeps every byte).

Known gap: the exact signal or exit code is not shown. The ranks are children of MPICH's
launcher, not of the notebook, and the launcher does not report them to us.

Owns: reading and formatting those; which ranks are dead and what is noted of their death
is ``hvdnb.notebook.cluster.health``'s to say. Never: talk to the ranks (a dead one cannot
answer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hvdnb.notebook.cellout.terminal import strip_controls
from hvdnb.notebook.cluster import health
from hvdnb.notebook.metrics.store import get_store

__all__ = ["format_logs", "rank_log"]


def rank_log(cluster: Any, rank: int, lines: int = 20) -> list[str]:
    """The last ``lines`` lines of the rank's own log ([] when it wrote nothing)."""
    d = getattr(cluster, "state_dir", None)
    if not d:
        return []
    path = Path(d) / "logs" / f"rank{rank}.log"
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:] if lines > 0 else []


def _fatal_dump(log: list[str]) -> list[str]:
    """faulthandler's report in the log: its header and the crashing thread's frames
    (innermost first, as faulthandler writes them); [] when there is none."""
    starts = [i for i, ln in enumerate(log) if ln.startswith("Fatal Python error")]
    if not starts:
        return []
    i = starts[-1]
    out = log[i : i + 2]
    cur = next((j for j in range(i, len(log)) if log[j].startswith("Current thread")), None)
    if cur is not None:
        end = next((j for j in range(cur + 1, len(log)) if not log[j].strip()), len(log))
        out += log[cur:end]
    return out


def format_logs(cluster: Any, ranks: list[int], lines: int = 20) -> str:
    """The ``%dist logs`` report for ``ranks``."""
    dead = health.gone_ranks(cluster)
    info = get_store().rank_info
    out = []
    for r in ranks:
        said = info.get(r, {})
        where = ", ".join(
            x
            for x in (
                f"pid {said['pid']}" if said.get("pid") else "",
                f"host {said['host']}" if said.get("host") else "",
            )
            if x
        )
        state = "dead" if r in dead else "alive"
        out.append(f"--- rank {r} ({state}{', ' + where if where else ''}) ---")
        log = rank_log(cluster, r, max(lines, 400))
        crash = _fatal_dump(log)
        if crash:  # what matters is the crashing thread's stack, not the log's last lines
            out += crash
        else:
            out += log[-lines:] if lines else []
        if not log:
            out.append("(its log is empty)")
        out += health.log_notes(cluster, r, log, r in dead)
        out += _cell_output(cluster, r, lines)
    return "\n".join(out)


def _cell_output(cluster: Any, rank: int, lines: int) -> list[str]:
    """The last ``lines`` lines the rank printed in cells (a bar's redraws shown at their
    last state here; the file keeps every one), and where the whole is: the notebook
    condenses what it shows (merged lines, bars drawn in place), this copy does not."""
    d = getattr(cluster, "state_dir", None)
    if not d or lines <= 0:
        return []
    path = Path(d) / "logs" / f"rank{rank}.cells.log"
    try:  # newline="": the carriage returns as written (universal newlines make them lines)
        with path.open(encoding="utf-8", errors="replace", newline="") as fh:
            text = fh.read()
    except OSError:
        return []
    shown = [strip_controls(ln.rstrip("\r").split("\r")[-1]) for ln in text.split("\n")]
    tail = [ln for ln in shown if ln.strip()][-lines:]
    return [f"cell output (the last {len(tail)} lines; all of it in {path}):", *tail]
