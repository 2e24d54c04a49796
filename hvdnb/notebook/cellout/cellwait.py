"""The policy of a running cell's wait: fed time and events, it answers with actions.

While a ``%%distributed`` cell runs, the notebook's waiting loop (``cells._CellRun``) polls
the ranks and reads the clock; everything it decides from that is here, with no I/O, the
way dask/distributed's ``worker_state_machine`` keeps a worker's state apart from its
sockets. The loop tells a ``CellWait`` what happened (``rank_done``, ``ctrl_c``,
``prompt_answered``) and asks it what to do at each ``tick``; it carries out the actions it
gets back (``Pump``, ``Redraw``, ``Interrupt``, ``CheckAlive``, ``LookForStall``,
``Escalate``, ``Finish``) and stops at ``Escalate`` or ``Finish``.

The rules, in the order a tick applies them:

1. every rank is done: finish;
2. the cell ran past its timeout (``%%distributed --timeout``, ``HVDNB_CELL_TIMEOUT``):
   interrupt the ranks still running, and say so;
3. a rank failed ``FAIL_FAST_AFTER`` seconds ago and its peers still run (they were not
   blocked on it, or would have been released): interrupt them (fail fast). A rank that
   *died* is different: its peers' collectives can never complete, so they are interrupted
   at once (``rank_done``);
4. an interrupt sent within ``EARLY_INTERRUPT`` seconds of the submit may have reached a
   rank that had not begun the cell (an idle engine ignores SIGINT): send it once more
   ``RESEND_AFTER`` seconds later;
5. ranks still running ``ESCALATE_AFTER`` seconds after an interrupt ignore it (a C loop, a
   handler swallowing SIGINT): escalate (the notebook restarts the cluster);
6. while nothing failed and nothing was interrupted: check the cluster is alive, and once
   the cell has run ``stall_after`` seconds (``Config.stall_after``) look for a stall.

A Ctrl-C (the stop button) interrupts the running ranks at once; a second one changes
nothing, and rule 5 escalates if the ranks ignore both. A pdb prompt answered in the
notebook (``breakpoint()`` on a rank) restarts the stall countdown and cancels the
timeout: a debugging session is neither a stall nor a cell timing out.

Owns: these rules and their constants. Never: talk to ranks, print, or read the clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from hvdnb.notebook.cellout.output import format_ranks

__all__ = [
    "EARLY_INTERRUPT",
    "ESCALATE_AFTER",
    "FAIL_FAST_AFTER",
    "RESEND_AFTER",
    "Action",
    "CellWait",
    "CheckAlive",
    "Escalate",
    "Finish",
    "Interrupt",
    "LookForStall",
    "Pump",
    "Redraw",
]

#: seconds a failed rank's peers may still run before they are interrupted (fail fast);
#: peers blocked on it are usually released sooner by its torn-down process group
FAIL_FAST_AFTER: Final = 2.0
#: seconds the ranks have to stop after an interrupt before the wait escalates (restart)
ESCALATE_AFTER: Final = 2.0
#: an interrupt sent this soon after the submit may find a rank not yet in the cell ...
EARLY_INTERRUPT: Final = 0.5
#: ... so it is sent once more this many seconds later
RESEND_AFTER: Final = 0.5


# ---------------------------------------------------------------------- actions
@dataclass(frozen=True)
class Pump:
    """Show the ranks' output that arrived (and answer a rank's pdb prompt)."""


@dataclass(frozen=True)
class Redraw:
    """Print the watchers' alarm lines and run the wait hooks (the live panel)."""


@dataclass(frozen=True)
class Interrupt:
    """Send SIGINT to ``ranks``; ``why``: ``ctrl-c``, ``timeout``, ``fail-fast``,
    ``dead-peer`` or ``resend``."""

    ranks: tuple[int, ...]
    why: str


@dataclass(frozen=True)
class CheckAlive:
    """Check the controller and the engines are still there (raise if not)."""


@dataclass(frozen=True)
class LookForStall:
    """Ask the running ranks where they are, and report a stall (``StallWatch.tick``)."""


@dataclass(frozen=True)
class Escalate:
    """``ranks`` ignored an interrupt: record them as unresponsive and end the wait (the
    notebook then restarts the cluster). The cluster's health is checked first."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Finish:
    """Every rank is done: end the wait."""


#: what ``CellWait`` asks the waiting loop to do
Action = Pump | Redraw | Interrupt | CheckAlive | LookForStall | Escalate | Finish


# ---------------------------------------------------------------------- the policy
class CellWait:
    """One cell's wait, as a state machine. Times are ``time.monotonic()`` seconds.

    Parameters
    ----------
    ranks : the ranks running the cell
    t0 : when the cell was sent
    timeout : seconds before the ranks still running are interrupted (None: no limit)
    stall_after : seconds before the stall detector looks (0 or less: never)
    """

    def __init__(
        self,
        ranks: list[int],
        t0: float,
        timeout: float | None,
        stall_after: float,
        elastic: bool = False,
    ) -> None:
        self.ranks = list(ranks)
        #: an elastic cluster: a lost rank costs its peers a step, not the cell (``lost``)
        self.elastic = elastic
        self.t0 = t0
        self.timeout = timeout
        self.deadline = None if timeout is None else t0 + timeout
        self.stall_after = stall_after
        #: when the stall countdown began (the submit, or the last answered pdb prompt)
        self.stall_t0 = t0
        self.done: set[int] = set()
        self.failed_at: float | None = None
        self.interrupted_at: float | None = None
        self.resent = False
        self.finished = False
        #: what the cell's error says about how the wait ended ("" when nothing to say)
        self.note = ""

    # ------------------------------------------------------------------ state
    @property
    def interrupted(self) -> bool:
        return self.interrupted_at is not None

    @property
    def running(self) -> tuple[int, ...]:
        """The ranks not done yet, in order."""
        return tuple(r for r in self.ranks if r not in self.done)

    def _interrupt(self, now: float, why: str) -> list[Action]:
        self.interrupted_at = now
        return [Interrupt(self.running, why)]

    # ------------------------------------------------------------------ events
    def rank_done(
        self, rank: int, now: float, failed: bool = False, dead: bool = False
    ) -> list[Action]:
        """``rank`` answered (``failed``: with an error; ``dead``: its engine is gone)."""
        self.done.add(rank)
        if (failed or dead) and self.failed_at is None:
            self.failed_at = now
        if dead and not self.interrupted:
            # a dead peer: the others' collectives can never complete, so no grace period
            return self._interrupt(now, "dead-peer")
        return []

    def lost(self, rank: int, now: float, below: bool) -> list[Action]:
        """An elastic cluster lost ``rank`` (died, or its code raised and it left): its
        peers go on at the new size, so nothing is interrupted; ``below``: fewer than
        ``--min-np`` are left, and the cell ends as with a fixed cluster's death."""
        self.done.add(rank)
        return self._give_up(now) if below else []

    def _give_up(self, now: float) -> list[Action]:
        if self.failed_at is None:
            self.failed_at = now
        if self.interrupted:
            return []
        return self._interrupt(now, "dead-peer")

    def ctrl_c(self, now: float) -> list[Action]:
        """The stop button (or Ctrl-C): interrupt the running ranks, once."""
        self.note = "interrupted from the notebook"
        if self.interrupted:
            return []
        return self._interrupt(now, "ctrl-c")

    def prompt_answered(self, now: float) -> None:
        """A rank sat at ``breakpoint()`` and the notebook answered it: its peers' waiting
        is no stall (the countdown starts again), and the cell is not timing out."""
        self.stall_t0 = now
        self.deadline = None

    def tick(self, now: float) -> list[Action]:
        """One pass of the waiting loop, after the ranks were polled: output first, then
        what the rules above decide."""
        if self.finished:
            return []
        return [Pump(), Redraw(), *self._decide(now)]

    def _decide(self, now: float) -> list[Action]:
        if len(self.done) == len(self.ranks):
            self.finished = True
            return [Finish()]
        out: list[Action] = []
        if self.deadline is not None and now > self.deadline and not self.interrupted:
            self.note = (
                f"cell timed out after {self.timeout:g} s; the ranks still running were interrupted"
            )
            out += self._interrupt(now, "timeout")
        if (
            self.failed_at is not None
            and not self.interrupted
            and now - self.failed_at > FAIL_FAST_AFTER
        ):
            out += self._interrupt(now, "fail-fast")
        sent = self.interrupted_at
        if (
            sent is not None
            and not self.resent
            and sent - self.t0 < EARLY_INTERRUPT
            and now - sent > RESEND_AFTER
        ):
            self.resent = True
            out.append(Interrupt(self.running, "resend"))
        if sent is not None and now - sent > ESCALATE_AFTER:
            return out + self._escalate()
        if self.failed_at is None and not self.interrupted:
            out.append(CheckAlive())
            if self.stall_after > 0 and now - self.stall_t0 >= self.stall_after:
                out.append(LookForStall())
        return out

    def _escalate(self) -> list[Action]:
        stuck = self.running
        self.note = (
            f"{self.note + '; ' if self.note else ''}rank(s) {format_ranks(stuck)} did not "
            f"stop within {ESCALATE_AFTER:g} s of an interrupt"
        )
        self.finished = True
        return [Escalate(stuck)]
