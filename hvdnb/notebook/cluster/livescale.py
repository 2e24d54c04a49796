"""A scale asked for while a cell trains (``Cluster.request_scale``, the panel's
``ranks=N``), carried out at the running elastic loop's next commit.

The cell's wait calls ``LiveScale.tick`` every output interval. Nothing happens until every
rank is inside an elastic loop (``Membership.all_looping``): outside one no rank reaches a
commit, and the request waits for the next cell's start (``elasticcell``). Then:

- **fewer ranks**: the next generation keeps the first N. Every rank hears of it, all reach
  the same commit (``HostsUpdatedInterrupt``), the kept ones re-form, and the others find
  themselves out of it and leave their loop (``RankRemoved``). Their engines are stopped
  once their cell has ended, never while they may still be in a collective.
- **more ranks**: new engines start (cold) and register over the next ticks, not in one
  blocking wait. Once each has connected its side channel, the next generation is
  announced with them, and the cell's wait sends them ``JOIN_CELL``: join that generation,
  then run the cell. They join the group at the loop's next commit and run the cell from its top, as
  Horovod's new workers run the script from its top; the elastic function's
  ``state.sync()`` gives them rank 0's state.

Never: block the cell's wait longer than a remote call to idle engines, or decide
membership itself (``Membership`` does).
"""

from __future__ import annotations

import time
from typing import Any

from hvdnb.notebook.cluster.elastic import Event, connect_new, not_started, start_new

__all__ = ["LiveScale"]


class LiveScale:
    """One running cell's scale requests.

    Parameters
    ----------
    cluster : the elastic cluster (``membership`` set)
    cell : the running cell's number (the events say it)
    """

    def __init__(self, cluster: Any, cell: int) -> None:
        self.cluster = cluster
        self.cell = cell
        self.starting: list[int] = []  #: slots started, not registered yet
        self.deadline = 0.0
        self.events: list[Event] = []
        #: what went wrong (the cell's end says it), "" when nothing did
        self.error = ""

    def tick(self) -> tuple[list[int], list[int]]:
        """``(joined, leaving)``: slots to send the cell to now, and slots that leave at
        the next commit (stop them once their cell has ended)."""
        m = self.cluster.membership
        if m is None:
            return [], []
        if self.starting:
            return self._registered(m), []
        want = m.wanted
        if want is None or not m.all_looping():
            return [], []
        m.wanted = None
        if want < m.size:
            ev = m.shrink_at_commit(want, self.cell)
            self.events.append(ev)
            return [], list(ev.lost_slots)
        if want > m.size:
            try:
                self.starting = start_new(self.cluster, m, want)
            except Exception as exc:
                self.error = f"`ranks={want}`: the new ranks could not start ({exc})"
                return [], []
            self.deadline = time.monotonic() + self.cluster.timeout
        return [], []

    def _registered(self, m: Any) -> list[int]:
        new = self.starting
        if not set(new) <= set(self.cluster.client.ids):
            if time.monotonic() > self.deadline:
                self.error = not_started(self.cluster)
                self.starting = []
                for s in new:
                    m.retire(s)
            return []
        self.starting = []
        connect_new(self.cluster, new, time.monotonic() + 10)
        ev = m.grew(new, self.cell)
        self.events.append(ev)
        return new
