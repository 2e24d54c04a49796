"""The one place that knows a rank (or the whole job) is dead, and says so.

A rank is dead when its engine has left the controller (``dead_ranks``); the job is dead
when the controller or an engine set's launcher (mpiexec, sbatch) has exited
(``check_alive``). What the notebook saw of a death is noted per rank (``rank_died``: the
cell it died in) and every report of one is worded here: the cell's error
(``rank_died``, ``died_note``), the refusal to run a cell or a debugger on a dead rank
(``require_all_ranks``, ``debug_refusal``), the ``%dist status`` table (``status_rows``,
``status_report``) and ``%dist logs``' verdict on a rank's log (``gone_ranks``,
``log_notes``). MPI ends every rank of a job when one of them dies, so one death usually
shows as all of them.

Never: talk to a rank that may be dead without a timeout, raise from a status report
because a rank is gone, or restart anything (the user or ``hvdnb.notebook.cellout.cells``
does).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterable
from typing import Any, Protocol

from hvdnb.notebook.cluster.spec import ClusterError
from hvdnb.notebook.metrics.ranklabels import format_ranks
from hvdnb.notebook.metrics.store import get_store
from hvdnb.protocol.remote import ENGINE_INFO

__all__ = [
    "Watched",
    "check_alive",
    "dead_in",
    "dead_ranks",
    "debug_refusal",
    "died_note",
    "engine_output",
    "gone_ranks",
    "launcher_exit",
    "log_notes",
    "rank_died",
    "require_all_ranks",
    "status_report",
    "status_rows",
]

#: engine output lines that only bury the message: C++ frames, ipengine start-up chatter
_NOISE = re.compile(
    r"^(frame #\d+:|<omitting python frames>|Exception raised from |.*\[IPEngine\] WARNING"
    r"|.*WARNING \| (Not using CurveZMQ|debugpy_stream)|.*\[KernelNanny)"
)
_GONE = "gone (MPI ends every rank of a job when one of them dies)"
_RESTART = "`%dist restart` starts all ranks afresh (an hvdnb.State you committed is restored)"


class Watched(Protocol):
    """What health reads of a cluster (``hvdnb.notebook.cluster.lifecycle.Cluster``)."""

    client: Any
    #: rank -> what the notebook saw of its death ("died in cell 4 (...)")
    death_notes: dict[int, str]
    #: rank -> its last ``engine_info`` (host, pid, device, backend), kept for dead ranks
    info_seen: dict[int, Any]
    last_cell: dict[int, dict[str, Any]]

    @property
    def n(self) -> int: ...

    @property
    def multi_host(self) -> bool: ...

    @property
    def running(self) -> bool: ...

    @property
    def ipp(self) -> Any: ...

    def engine_launchers(self) -> list[Any]: ...


# ---------------------------------------------------------------------- knowing
def dead_ranks(cluster: Watched) -> list[int]:
    """Ranks of this cluster whose engine has gone away (empty when all are there, or when
    the cluster is not running)."""
    if cluster.client is None:
        return []
    members = getattr(cluster, "membership", None)
    if members is not None:  # an elastic cluster: ranks of its current generation
        gone = set(members.gone())
        return [r for r, s in enumerate(members.members) if s in gone]
    ids = set(cluster.client.ids)
    return [r for r in range(cluster.n) if r not in ids]


def check_alive(cluster: Watched) -> None:
    """Raise ClusterError if the cluster is not running, or its controller or an engine
    set has exited (with the engines' last words)."""
    ipp = cluster.ipp
    if ipp is None:
        raise ClusterError("the cluster is not running; `%dist start` first")
    ctrl = ipp.controller
    if ctrl is not None and ctrl.stop_data is not None:
        raise ClusterError(f"the controller exited ({ctrl.stop_data}); `%dist restart`")
    sets = cluster.engine_launchers()
    if getattr(cluster, "membership", None) is not None:
        # an elastic cluster's engine sets are its slots: one ending is a lost rank, which
        # the membership handles (``elastic.py``); the job is dead only with no slot left
        if sets and all(es.stop_data for es in sets):  # a local set's is {} while it runs
            raise ClusterError(
                "every rank of the elastic cluster has exited. Last output:\n"
                f"{engine_output(cluster)}\n`%dist restart` starts them again."
            )
        return
    for es in sets:
        if es.stop_data is not None:
            code = es.stop_data.get("exit_code")
            where = ""
            if len(sets) > 1:
                where = f" of engine set {getattr(es, 'engine_set_id', '?')}"
            raise ClusterError(
                f"the engines{where} exited (launcher exit code {code}). Last output:\n"
                f"{engine_output(cluster)}\nFix the cause above, then `%dist restart`."
            )


def launcher_exit(cluster: Watched) -> str | None:
    """How the engines' launcher (mpiexec, sbatch) ended, or None while it runs."""
    for es in cluster.engine_launchers():
        if es.stop_data is not None:
            code = es.stop_data.get("exit_code")
            return f"the ranks' launcher exited (exit code {code})"
    return None


def engine_output(cluster: Watched, tail: int = 20) -> str:
    """What the engines said: hvdnb's own one-line reports first, then the last lines
    without C++ stack frames (torch prints dozens when a peer has already gone)."""
    ours, rest = [], []
    for es in cluster.engine_launchers():
        try:
            text = es.get_output(remove=False) or ""
        except Exception:
            text = ""
        for line in text.splitlines():
            if line.startswith("hvdnb:"):
                ours.append(line)
            elif not _NOISE.match(line):
                rest.append(line)
    return "\n".join(ours + rest[-tail:]) or "(no output)"


# ---------------------------------------------------------------------- cells
def rank_died(cluster: Watched | None, rank: int, cell: int) -> dict[str, Any]:
    """A rank's engine went away while it ran ``cell``: note it on ``cluster`` (for
    ``%dist status`` and ``%dist logs``) and return the rank's error record."""
    why = (
        "died or became unreachable (the controller stopped hearing from it: its "
        "host may be down or cut off the network)"
        if getattr(cluster, "multi_host", False)
        else "died while running this cell (killed by a signal, for example out of memory)"
    )
    if cluster is not None and hasattr(cluster, "death_notes"):
        cluster.death_notes[rank] = f"died in cell {cell} ({why.split(' (')[0]})"
    return {"ename": "RankDied", "evalue": f"rank {rank} {why}", "traceback": "", "dead": True}


def require_all_ranks(cluster: Watched) -> None:
    """Raise ClusterError when a rank is dead: a cell's collectives would hang."""
    dead = dead_ranks(cluster)
    if dead:
        raise ClusterError(
            f"rank(s) {format_ranks(dead)} of {cluster.n} are gone, so collectives would hang: "
            "run `%dist restart` first"
        )


def dead_in(errors: dict[int, dict[str, Any]]) -> list[int]:
    """The ranks of a cell's errors whose engine the cell found gone (``rank_died``)."""
    return sorted(r for r, e in errors.items() if e.get("dead"))


def died_note(cluster: Watched, seen: Iterable[int] = ()) -> str | None:
    """After a failed cell: which ranks died and how to get them back (None: none died).

    ``seen``: ranks the cell itself found dead (an ``EngineError`` reply). The controller
    sends that reply and the engine's unregistration on different sockets, so the client's
    list of engines can still hold the dead one for a moment; CI saw that race once.
    """
    dead = sorted(set(dead_ranks(cluster)) | set(seen))
    if not dead:
        return None
    return (
        f"rank(s) {format_ranks(dead)} died: run `%dist restart` to get all "
        f"{cluster.n} ranks back (an hvdnb.State you committed is restored)"
    )


def debug_refusal(cluster: Watched, rank: int) -> str | None:
    """Why ``%dist debug`` cannot open ``rank`` (None: it can)."""
    if rank in dead_ranks(cluster):
        return (
            f"rank {rank} is dead, and its frames with it: `%dist status` "
            "says what is known, `%dist restart` brings the ranks back"
        )
    return None


# ---------------------------------------------------------------------- %dist status
def status_rows(cluster: Watched) -> list[dict[str, Any]]:
    """One row per rank of the job, dead ones included: rank, host, pid, device,
    backend, state, last cell.

    Never raises because a rank is gone: its state says "dead" and what the notebook
    knows of it (the cell it died in; MPI ends every rank of a job when one dies).
    Host and pid of a dead rank are the last ones seen.
    """
    if not cluster.running:
        raise ClusterError("no cluster is running; `%dist start -n 2` first")

    dead = set(dead_ranks(cluster))
    alive = [r for r in range(cluster.n) if r not in dead]
    m = getattr(cluster, "membership", None)
    slot = m.slot_of if m is not None else (lambda r: r)  # an elastic cluster's engines
    infos: dict[int, Any] = {}
    queue: dict[Any, Any] = {}
    if alive:
        try:
            queue = cluster.client.queue_status()
        except Exception:
            queue = {}
        try:
            vals = cluster.client[[slot(r) for r in alive]].apply_async(ENGINE_INFO).get(timeout=5)
            infos = dict(zip(alive, vals if isinstance(vals, list) else [vals]))
        except Exception:
            infos = {}
    cluster.info_seen.update({r: i for r, i in infos.items() if i is not None})
    said_all = get_store().rank_info
    rows = []
    for r in range(cluster.n):
        info = infos.get(r) or cluster.info_seen.get(r)
        row: dict[str, Any] = {"rank": r, "host": "?", "pid": "?", "device": "?", "backend": "?"}
        if info is not None:
            # an EngineInfo (protocol.replies), read by attribute
            row.update({k: getattr(info, k) for k in ("host", "pid", "device", "backend")})
            row["group"] = info.group
        else:  # what the rank told the notebook's side channel before it went
            said = said_all.get(r, {})
            row["host"], row["pid"] = said.get("host") or "?", said.get("pid") or "?"
        if r in dead:
            row["state"] = "dead: " + cluster.death_notes.get(r, _GONE)
        else:
            q = queue.get(slot(r), {}) if isinstance(queue, dict) else {}
            busy = q.get("tasks", 0) > 0 or q.get("queue", 0) > 0
            row["state"] = "busy" if busy else ("idle" if r in infos else "no answer")
        last = cluster.last_cell.get(r)
        row["last cell"] = f"[{last['cell']}] {last['state']}" if last else "-"
        rows.append(row)
    return rows


def status_report(cluster: Watched) -> str:
    """``%dist status``: the table of ``status_rows``, then which ranks are dead and how
    the launcher ended, then the hosts when ranks span several."""
    rows = status_rows(cluster)
    standby = getattr(cluster, "standby", None)
    extra = []
    if standby is not None:  # listed, never numbered: they are not ranks
        for r in standby.rows():
            extra.append(
                {
                    "rank": "standby",
                    "host": r.get("host") or socket.gethostname(),
                    "pid": r["pid"],
                    "state": r["state"],
                }
            )
    lines = [_table(rows + extra)]
    if standby is not None:
        lines.append(standby.line())
    m = getattr(cluster, "membership", None)
    if m is not None:
        lines.append(
            f"elastic: generation {getattr(cluster, 'generation', 0)}, {m.size} rank(s) "
            f"(--min-np {m.min_np}, --max-np {m.max_np}); ranks are engines "
            f"{', '.join(map(str, m.members))} in order"
        )
        lines += [f"  {ev.line(m.min_np)}" for ev in m.events[-5:]]
    dead = [r["rank"] for r in rows if str(r.get("state", "")).startswith("dead")]
    if dead:
        gone = launcher_exit(cluster)
        lines.append(
            f"rank(s) {format_ranks(dead)} dead" + (f"; {gone}" if gone else "") + ": " + _RESTART
        )
    hosts: dict[str, list[int]] = {}
    for r in rows:
        hosts.setdefault(str(r.get("host", "?")), []).append(r["rank"])
    if len(hosts) > 1:
        lines.append(
            "hosts: " + "; ".join(f"{h} (ranks {format_ranks(rs)})" for h, rs in hosts.items())
        )
    return "\n".join(lines)


def _table(rows: list[dict[str, Any]]) -> str:
    cols = ["rank", "host", "pid", "device", "backend", "state", "last cell"]
    cells_ = [[str(r.get(k, "")) for k in cols] for r in rows]
    widths = [max(len(k), *(len(row[i]) for row in cells_)) for i, k in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*cols)] + [fmt.format(*row) for row in cells_])


# ---------------------------------------------------------------------- %dist logs
def gone_ranks(cluster: Watched) -> set[int]:
    """The ranks ``%dist logs`` reports as dead: those whose engine has gone, and every
    rank of a stopped cluster."""
    return set(dead_ranks(cluster)) if cluster.running else set(range(cluster.n))


def log_notes(cluster: Watched, rank: int, log: list[str], dead: bool) -> list[str]:
    """The notebook's notes under a rank's log: how it died, as far as the notebook saw
    it and, for a ``dead`` rank, as far as its log (``log``) tells (a fatal-signal dump,
    or no traceback at all: ended from outside)."""
    out = []
    note = cluster.death_notes.get(rank)
    if note:
        out.append(f"notebook: rank {rank} {note}")
    if dead:
        tail = "\n".join(log)
        if "Fatal Python error" in tail:
            out.append(
                f"notebook: rank {rank} crashed on a fatal signal: its Python stack is "
                "in the log above"
            )
        elif "Traceback (most recent call last)" not in tail:
            out.append(
                f"notebook: rank {rank} left no Python traceback: it was ended from "
                "outside (SIGKILL, as the out-of-memory killer sends, or its job "
                "was cancelled) or called os._exit; MPI then ends the other ranks"
            )
    return out
