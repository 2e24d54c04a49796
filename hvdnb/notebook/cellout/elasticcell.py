"""An elastic cluster's side of one running cell: ranks lost while it runs, and how the
cell ends when they were.

A rank lost inside an elastic loop (``hvd.elastic.run``, ``hvdnb.elastic.run``) costs the
survivors a step, not the cell: they re-form at the new size and finish. So the cell's
wait (``cells._CellRun``) asks ``CellMembers.tick`` each output interval which ranks were
lost (``Membership.watch`` forms the next generation), marks them done without
interrupting their peers, and at the end ``settle`` turns a cell whose survivors all
finished into a normal one: one line per membership change, and the traceback of a rank
whose code raised (it left) shown once. A cell whose survivors failed too (code outside an
elastic loop), or that went below ``--min-np``, fails as any cell does, naming the deaths.

Ranks are numbered as when the cell was sent (``slots`` maps them to engines) for the
whole cell; the next cell uses the new generation's numbers.

Never: decide membership (``hvdnb.notebook.cluster.elastic``), or interrupt a rank.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from hvdnb.notebook.cluster.livescale import LiveScale
from hvdnb.notebook.cluster.spec import ClusterError
from hvdnb.notebook.metrics.ranklabels import format_ranks
from hvdnb.notebook.metrics.store import get_store
from hvdnb.protocol.remote import REBUILD_GROUP

__all__ = ["CellMembers", "elastic_between_cells", "rejoin_note"]


def elastic_between_cells(cluster: Any) -> Callable[[int], int]:
    """Before a cell is sent: an elastic cluster that lost ranks since the last cell forms
    its next generation (one line says so), and its idle ranks are brought to it. Returns
    the map from a rank to its engine. Raises ClusterError below ``--min-np``."""
    m = getattr(cluster, "membership", None)
    if m is None:
        return lambda r: r
    ev = cluster.watch_members(None)
    if ev is not None:
        sys.stderr.write(ev.line(m.min_np) + "\n")
        sys.stderr.flush()
        get_store().mark(ev.line(m.min_np))  # between cells: no run to mark, the size follows
    if m.size < m.min_np:
        raise ClusterError(
            f"the elastic cluster has {m.size} rank{'s' if m.size != 1 else ''}, fewer than its "
            f"--min-np {m.min_np}: `%dist scale {m.min_np}` (or more) adds ranks, `%dist "
            "restart` starts them all afresh"
        )
    if m.wanted is not None:  # asked for while no loop ran (the panel's ranks=N)
        ev = cluster.scale(m.wanted)
        sys.stderr.write(ev.line(m.min_np) + "\n")
        get_store().mark(ev.line(m.min_np))
    m.catch_up()
    slot_of: Callable[[int], int] = m.slot_of
    return slot_of


def rejoin_note(cluster: Any, note: str) -> str:
    """After a failed cell on an elastic cluster: bring its ranks to the current
    generation (a new one with the same ranks when none changed: the failing ranks
    released their group). Returns the cell's note, with what went wrong doing so."""
    m = cluster.membership
    try:
        if m.size >= m.min_np and m.behind is not None:
            m.catch_up()
        elif m.size >= m.min_np:
            cluster.generation += 1
            cluster.view.apply_async(REBUILD_GROUP, cluster.generation).get(timeout=30)
    except Exception as exc:
        extra = f"the process group could not be re-formed ({exc}); run `%dist restart`"
        return f"{note}; {extra}" if note else extra
    return note


class CellMembers:
    """What one cell saw of an elastic cluster's membership (inactive for a fixed one).

    Parameters
    ----------
    cluster : the cluster (``membership`` None: a fixed-size cluster, nothing to do)
    ranks, slots : the cell's ranks and their engines, in one order
    cell : the cell's number
    """

    def __init__(self, cluster: Any, ranks: list[int], slots: list[int], cell: int) -> None:
        self.cluster = cluster
        self.active = getattr(cluster, "membership", None) is not None
        self.rank_of = dict(zip(slots, ranks))
        self.cell = cell
        #: send-time rank -> "died" / "left"
        self.lost: dict[int, str] = {}
        self.events: list[Any] = []
        #: a change left fewer than --min-np ranks: the cell fails as a fixed cluster's
        self.below = False
        #: a scale asked for while the cell runs (``Cluster.request_scale``)
        self.live = LiveScale(cluster, cell) if self.active else None
        #: cell rank -> slot: ranks that leave at a commit (a scale down), and ranks that
        #: joined the running cell (a scale up)
        self.leaving: dict[int, int] = {}
        self.joined: dict[int, int] = {}
        #: why a cell whose survivors finished fails all the same (``outside_loop``)
        self.note = ""

    def tick(self) -> list[tuple[int, bool]]:
        """Ranks lost since the last tick, as ``(rank, died)``; ``died`` False: its code
        raised and it left (its error reply is on its way)."""
        if not self.active:
            return []
        ev = self.cluster.watch_members(self.cell)
        if ev is None:
            return []
        self.events.append(ev)
        self.below = self.below or ev.size == 0
        lost = ",".join(f"r{r}" for r in ev.lost)
        get_store().mark(f"{lost} {'left' if ev.why == 'left' else 'lost'} → {ev.size}")
        out = []
        for s in ev.lost_slots:
            r = self.rank_of.get(s)
            if r is not None and r not in self.lost:
                self.lost[r] = "left" if ev.why == "left" else "died"
                out.append((r, self.lost[r] == "died"))
        return out

    def scale_tick(self) -> list[tuple[int, int]]:
        """Carry out a scale asked for while the cell runs (``LiveScale``); returns the
        ranks that join now, as (cell rank, slot): numbered after the cell's highest."""
        if self.live is None:
            return []
        joined, leaving = self.live.tick()
        while self.live.events:
            ev = self.live.events.pop(0)
            self.events.append(ev)
            get_store().mark(f"scaled → {ev.size}")
        for s in leaving:
            r = self.rank_of.get(s)
            if r is not None:
                self.leaving[r] = s
        out = []
        for s in joined:
            r = max(self.rank_of.values(), default=-1) + 1
            self.rank_of[s] = r
            self.joined[r] = s
            out.append((r, s))
        return out

    def deciding(self, rank: int) -> bool:
        """Is ``rank`` seen lost, with the notebook still waiting to see whether the rest
        of its host goes too (``HOST_WINDOW``)? Its failed reply waits for that change."""
        m = getattr(self.cluster, "membership", None)
        if not self.active or m is None:
            return False
        slot = next((s for s, r in self.rank_of.items() if r == rank), None)
        return slot is not None and slot in m.members and slot in m.first_seen

    def ended(self, rank: int, err: dict[str, Any] | None) -> bool:
        """``rank``'s cell ended (``err``: its error record, or None); True when that
        error is not the cell's: it left an elastic loop, or a scale took it out. A rank
        that joined the running cell and failed leaves as if its code had raised in the
        loop, so that its peers re-form without it."""
        if rank in self.leaving:
            self.cluster.membership.retire(self.leaving[rank])  # out of the group: stop it
            if err and err.get("ename") == "RankRemoved":
                err["scaled"] = True
        elif rank in self.joined and err and not err.get("left") and not self.below:
            text = f"{err.get('ename')}: {err.get('evalue')}"
            self.cluster.membership.on_left({"slot": self.joined[rank], "error": text})
            err["left"] = True
        return self.excused(err)

    def excused(self, err: dict[str, Any] | None) -> bool:
        """Is this failed rank's error its leaving an elastic loop (not the cell's end)?"""
        return bool(
            self.active and not self.below and err and (err.get("left") or err.get("scaled"))
        )

    def settle(self, result: Any) -> bool:
        """At the cell's end: True when the cell ends normally although ranks were lost
        (every error is a lost rank's, and a survivor finished); its lines are printed.
        False: the cell's errors stand (``lines`` then goes into its error note)."""
        if self.live is not None and self.live.error:
            sys.stderr.write(f"hvdnb: {self.live.error}\n")
        for s in self.leaving.values():  # no longer in the group, whatever its cell did
            self.cluster.membership.retire(s)
        if not self.active or not self.events:
            return False
        lost = set(self.lost) | {r for r, e in result.errors.items() if self.excused(e)}
        survivors_ok = any(r not in lost and r not in result.errors for r in result.ranks)
        if self.below or not survivors_ok or not set(result.errors) <= lost:
            return False
        outside = self.outside_loop(result, lost)
        if outside:
            self.note = outside
            return False
        out = sys.stderr
        for r in sorted(result.errors):
            e = result.errors[r]
            if e.get("left") and e.get("traceback"):
                out.write(f"--- rank {r} raised {e['ename']} and left the cluster ---\n")
                out.write(e["traceback"].rstrip("\n") + "\n")
                if r in self.joined:
                    out.write(
                        f"(rank {r} joined while the cell ran: it runs this cell from its top "
                        "without the earlier cells' variables, so make what the loop uses "
                        "in this cell)\n"
                    )
        out.write(self.lines() + "\n")
        out.flush()
        result.lost = {r: result.errors.pop(r) for r in list(result.errors)}
        return True

    def outside_loop(self, result: Any, lost: set[int]) -> str:
        """Why the cell fails although its survivors finished: a rank died while they ran
        no elastic loop, so none re-formed at the new size (its generation is still the
        one before the death) and nothing went on training; "" when every survivor went
        through the death inside a loop (or a rank only left, or a scale happened)."""
        deaths = [ev for ev in self.events if ev.why not in ("left", "scaled")]
        if not deaths:
            return ""
        needed = max(ev.generation for ev in deaths)
        behind = sorted(
            r for r in result.ranks if r not in lost and -1 < result.generations.get(r, -1) < needed
        )
        if not behind:
            return ""
        dead = format_ranks(sorted(r for r, why in self.lost.items() if why == "died"))
        return (
            f"rank {dead} died while this cell ran outside an elastic loop: the other ranks "
            f"finished the cell without it, and nothing went on training (only code inside "
            f"hvd.elastic.run / hvdnb.elastic.run survives a death). The next cell runs on "
            f"the {len(result.ranks) - len(lost)} survivors"
        )

    def with_lines(self, note: str) -> str:
        """A failed cell's note, with this cell's membership changes after it."""
        note = "\n".join(filter(None, [self.note, note]))
        return "\n".join(filter(None, [note, self.lines() if self.events else ""]))

    def lines(self) -> str:
        """One line per membership change this cell saw."""
        m = self.cluster.membership
        min_np = m.min_np if m is not None else 0
        return "\n".join(ev.line(min_np) for ev in self.events)
