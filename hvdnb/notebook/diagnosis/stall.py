"""Stall detector: which rank is where, when some wait in a collective others never enter.

While a cell runs longer than ``Config.stall_after`` seconds, the client asks every
running rank, once a second, over the side channel where its main thread is (the rank's
channel thread answers even while the main thread is blocked in a collective). When the answers show
ranks waiting in a collective while others are elsewhere, or in different collectives,
and neither the picture nor any rank's progress counters (collective sequence number,
hvdnb.torch calls, last logged step) changed since the previous look, it prints once, e.g.::

    hvdnb: stalled for 6 s: rank 0 waits in all_reduce at <cell 3> line 4
    (dist.all_reduce(x)); rank 1 is at <cell 3> line 6 (time.sleep(60)), not in a collective

A rank that waits alone is a stall too: in a 1-rank cluster (nothing else can ever send or
arrive) or on a peer that does not exist (the rank reports the peer of its ``recv``/``send``).
It is reported once it sat unchanged for two looks::

    hvdnb: stalled for 6 s: rank 0 waits in MPI recv at <cell 2> line 3 (comm.recv()); the
    cluster has 1 rank: no other rank can ever send to or wait with rank 0 (run it on more
    ranks: `%dist restart -n 2`)

(Horovod's stall inspector only warns after 60 s.) The last report is kept on
``cluster.last_stall`` for the panel.

Never: interrupt or change anything on the ranks; it only looks.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from hvdnb.notebook.debug import router as visual
from hvdnb.notebook.diagnosis.where import format_stacks, from_replies
from hvdnb.notebook.metrics.ranklabels import format_ranks
from hvdnb.notebook.metrics.store import get_store
from hvdnb.protocol import kinds

__all__ = ["StallWatch", "alone_note", "describe", "waits_alone"]


def describe(info: dict[str, Any] | None, finished: bool = False) -> str:
    """One rank's position in words."""
    if finished:
        return "has finished the cell"
    if not info:
        return "did not answer"
    if info.get("idle") or not info.get("cell"):
        return "is not running user code"
    place = f"{info['cell']} line {info['line']} ({info.get('code') or '?'})"
    if info.get("collective"):
        op = str(info["collective"])
        peer = info.get("peer")
        if isinstance(peer, int):
            op += f" {'to' if 'send' in op.lower() else 'from'} rank {peer}"
        return f"waits in {op} at {place}"
    return f"is at {place}, not in a collective"


def waits_alone(info: dict[str, Any] | None, world: int) -> bool:
    """A rank waiting in an operation that no other rank can ever complete: in a 1-rank
    world, or on a peer numbered past the world's size."""
    if not info or not info.get("collective"):
        return False
    peer = info.get("peer")
    return world == 1 or (isinstance(peer, int) and peer >= world)


def alone_note(replies: dict[int, dict[str, Any]], world: int) -> str:
    """Why the ranks that wait alone can never go on, in words ("" when none does)."""
    alone = sorted(r for r, info in replies.items() if waits_alone(info, world))
    if not alone:
        return ""
    who = ", ".join(f"rank {r}" for r in alone)
    ranks = f"{world} rank{'s' if world != 1 else ''}"
    if world == 1:
        why = f"no other rank can ever send to or wait with {who}"
    else:
        why = f"{who} wait{'s' if len(alone) == 1 else ''} on a rank that does not exist"
    return f"the cluster has {ranks}: {why} (run it on more ranks: `%dist restart -n 2`)"


class StallWatch:
    """Looks at the ranks once a second after a cell has run ``after`` seconds; reports a
    stall seen the same way twice in a row."""

    def __init__(self, cluster: Any, ranks: list[int], after: float) -> None:
        self.cluster = cluster
        self.ranks = ranks
        self.after = after
        self.t0 = time.monotonic()
        self.asked_at: float | None = None
        self.ask = 0
        self.replies: dict[int, dict[str, Any]] = {}
        self.previous: dict[int, tuple[Any, ...]] | None = None
        self.reported: set[str] = set()
        self.channel = getattr(cluster, "channel", None)
        if self.channel is not None and after > 0:
            self.channel.on(kinds.WHERE, self._on_where)

    def _on_where(self, msg: dict[str, Any]) -> None:
        if msg.get("ask") == self.ask and isinstance(msg.get("rank"), int):
            self.replies[msg["rank"]] = msg

    def tick(self, done: set[int]) -> str | None:
        """Call from the cell's waiting loop; returns (and prints) a report when stalled."""
        if self.channel is None or self.after <= 0:
            return None
        now = time.monotonic()
        if now - self.t0 < self.after:
            return None
        report = None
        period = min(1.0, self.after)
        if self.asked_at is not None and now - self.asked_at >= period:
            report = self._judge(done, now)
        if self.asked_at is None or now - self.asked_at >= period:
            self.ask += 1
            self.replies = {}
            self.asked_at = now
            for r in self.ranks:
                if r not in done:
                    self.channel.send(r, kinds.WHERE_ASK, ask=self.ask)
        return report

    def _judge(self, done: set[int], now: float) -> str | None:
        running = [r for r in self.ranks if r not in done]
        if not running:
            return None
        stopped = [r for r in visual.paused() if r in running]
        if stopped:  # held in JupyterLab's debugger: its peers wait on it, and that is no stall
            self.previous = None
            return self._paused(stopped, running)
        get_store().set_notice("")
        # position *and* progress counters: in a training loop every step passes the same
        # lines, so only unchanged counters (collectives, hvdnb.torch calls, logged step)
        # show that nobody moved between two looks
        state = {
            r: (
                self.replies.get(r, {}).get("collective"),
                self.replies.get(r, {}).get("cell"),
                self.replies.get(r, {}).get("line"),
                tuple(self.replies.get(r, {}).get("progress") or ()),
            )
            for r in running
        }
        waiting = {r: s[0] for r, s in state.items() if s[0]}
        world = int(getattr(self.cluster, "n", 0) or len(self.ranks))
        note = alone_note({r: self.replies.get(r, {}) for r in running}, world)
        stalled = bool(waiting) and (
            len(waiting) < len(self.ranks) or len(set(waiting.values())) > 1 or bool(note)
        )
        persisted = self.previous is not None and all(
            self.previous.get(r) == s for r, s in state.items()
        )
        self.previous = state
        if not (stalled and persisted):
            return None
        parts = []
        for r in self.ranks:
            parts.append(f"rank {r} {describe(self.replies.get(r), finished=r in done)}")
        if note:
            parts.append(note)
        text = f"hvdnb: stalled for {now - self.t0:.0f} s: " + "; ".join(parts)
        key = "; ".join(parts)
        self.cluster.last_stall = {
            "time": time.time(),
            "ranks": {r: self.replies.get(r) for r in running},
            "finished": sorted(done),
            "text": text,
        }
        if key in self.reported:
            return None
        self.reported.add(key)
        try:  # the same stacks %dist where shows (py-spy where it can attach)
            stacks = format_stacks(from_replies(self.replies, running))
            self.cluster.last_stall["stacks"] = stacks
            text_out = f"{text}\n{stacks}"
        except Exception:  # the one-line report must not depend on the stacks
            text_out = text
        print(text_out, file=sys.stderr, flush=True)
        return text

    def _paused(self, stopped: list[int], running: list[int]) -> str | None:
        """One line per change: which ranks the debugger holds, and who waits on them."""
        waiting = [
            r for r in running if r not in stopped and (self.replies.get(r) or {}).get("collective")
        ]
        held = f"rank{'s' if len(stopped) > 1 else ''} {format_ranks(stopped)}"
        notice = f"{held} paused in the debugger"
        if waiting:
            notice += f"; rank{'s' if len(waiting) > 1 else ''} {format_ranks(waiting)} wait on it"
        get_store().set_notice(notice)
        key = f"paused {stopped} {waiting}"
        if key in self.reported:
            return None
        self.reported.add(key)
        parts = [f"{held} paused in JupyterLab's debugger"]
        parts += [
            f"rank {r} " + describe(self.replies.get(r)).replace("waits in", "waits on it in", 1)
            for r in waiting
        ]
        text = (
            "hvdnb: " + "; ".join(parts) + " (not a stall: Continue or Terminate in the "
            "debugger lets them go on)"
        )
        print(text, file=sys.stderr, flush=True)
        return text

    def close(self) -> None:
        get_store().set_notice("")
        if self.channel is not None and self.after > 0:
            self.channel.off(kinds.WHERE, self._on_where)
