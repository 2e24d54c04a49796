"""Stopping a training loop at one step on every rank, when a watcher asks.

Protocol (over the side channel; the notebook's half is ``hvdnb.notebook.metrics.alarms``):

1. A watcher set to ``"stop"`` (``hvdnb.watch(nan="stop")``) sends ``stop_req {id, reason,
   cell}`` to rank 0.
2. Rank 0 picks ``stop_at`` as it picks a knob change's step (``Recorder.step_ahead``: its
   step in progress plus a lead covering the round trip) and answers ``stop_plan {id,
   stop_at, reason, cell}``; when its loop is idle or runs another cell, ``stop_plan {id,
   error}``.
3. The notebook forwards the plan to every rank (rank 0 included: one code path). Each rank
   raises ``TrainingStopped(reason)`` at the start of step ``stop_at``: from
   ``hvdnb.log(stop_at - 1)`` (the recorder's ``on_step_start``) or ``knobs.step(stop_at)``,
   whichever comes first. Every rank leaves at the same step, before that step's
   collectives, so no rank waits in a collective for a peer that has stopped; the error is
   the same on every rank, and the notebook shows it once.

Why kinds of their own and not a reserved knob: knobs exist only where a loop made
``hvdnb.knobs(...)``, every value is checked against their spec, and applying one changes a
value the loop reads; a stop needs none of that, must work in any loop that calls
``hvdnb.log``, and carries its reason. The agreement is the knobs' (rank 0 plans, the
notebook forwards, each rank acts at the step), through the same recorder functions.

Owns: the plan this rank waits for, the channel handlers and the step
hook. Never: stop a loop of another cell than the one the plan names, raise outside a
step boundary, or issue a collective.
"""

from __future__ import annotations

import threading
from typing import Any

from hvdnb.protocol import kinds
from hvdnb.rank.metrics.recorder import TrainingStopped, cell_no, get_recorder, on_step_start

__all__ = ["TrainingStopped", "check", "listen", "pending"]


_LOCK = threading.Lock()
#: the stop this rank waits for: {"id", "stop_at", "reason", "cell"} (None: none)
_PLAN: dict[str, Any] | None = None
_SEEN: set[Any] = set()  # request ids rank 0 has planned (a request is planned once)
_DONE: set[Any] = set()  # plan ids this rank has acted on
_LISTENING: set[int] = set()  # id() of the channels the handlers are registered on


def pending() -> dict[str, Any] | None:
    """The stop this rank waits for (a copy), or None."""
    p = _PLAN
    return dict(p) if p is not None else None


def check(step: int) -> bool:
    """Step ``step`` starts: raise ``TrainingStopped`` when a stop is planned for it (or a
    passed step: this rank heard late). True while a stop waits for a later step (the
    recorder then looks at every step)."""
    global _PLAN
    plan = _PLAN
    if plan is None:
        return False
    if plan["cell"] != cell_no():  # the loop it was planned for has ended
        with _LOCK:
            if _PLAN is plan:
                _PLAN = None
        return False
    at = plan["stop_at"]
    if step < at:
        return True
    with _LOCK:
        if _PLAN is not plan:  # taken by another thread logging at the same time
            return False
        _PLAN = None
        _DONE.add(plan["id"])
    if step == at:
        where = f"hvdnb stopped the loop at step {at} on every rank"
    else:
        where = (
            f"hvdnb stopped the loop at step {step} on this rank: the plan for step {at} "
            "reached it late"
        )
    raise TrainingStopped(f"{plan['reason']} ({where})")


def _send(kind: kinds.Kind, **payload: Any) -> None:
    ch = get_recorder().channel
    if ch is not None:
        try:
            ch.send(kind, **payload)
        except Exception:
            pass


def on_request(msg: dict[str, Any]) -> None:
    """Rank 0: a watcher asks to stop; pick the step every rank stops at."""
    rec = get_recorder()
    rid = msg.get("id")
    if rec.rank != 0 or rid in _SEEN:
        return
    _SEEN.add(rid)
    cell = msg.get("cell")
    if cell != cell_no() or rec.cell_running is False or rec.idle():
        _send(kinds.STOP_PLAN, id=rid, error=f"no loop of cell {cell} is running on rank 0")
        return
    _send(
        kinds.STOP_PLAN,
        id=rid,
        stop_at=rec.step_ahead(),
        reason=str(msg.get("reason", "stopped by a watcher")),
        cell=cell,
    )


def on_plan(msg: dict[str, Any]) -> None:
    """Every rank: rank 0's plan, forwarded by the notebook; acted on at the step."""
    global _PLAN
    at = msg.get("stop_at")
    if msg.get("error") or not isinstance(at, int) or isinstance(at, bool):
        return
    if msg.get("cell") != cell_no():  # a plan for a loop that has ended here
        return
    plan = {"id": msg.get("id"), "stop_at": at, "reason": str(msg.get("reason")), "cell": cell_no()}
    with _LOCK:
        if plan["id"] in _DONE:
            return
        _PLAN = plan
    get_recorder().events_at_next_log()  # the next log() looks at the step hooks


def listen(channel: Any) -> None:
    """Handle ``stop_req`` (rank 0) and ``stop_plan`` on ``channel`` (the engine calls it
    when it connects its side channel; once per channel)."""
    if channel is None or id(channel) in _LISTENING:
        return
    _LISTENING.add(id(channel))
    channel.on(kinds.STOP_REQ, on_request)
    channel.on(kinds.STOP_PLAN, on_plan)


on_step_start(check, "stop")
