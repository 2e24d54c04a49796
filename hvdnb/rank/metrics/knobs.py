"""Live knobs: values a training loop reads each step and the panel changes while it runs.

Protocol (all messages over the side channel, ``hvdnb.protocol.wire``):

1. ``hvdnb.knobs(batch_size=64, ...)`` on every rank announces its spec to the notebook
   (``knobs_spec``: names, current values, kinds, ranges).
2. The panel (or ``%dist knobs`` / ``hvdnb.set_knobs``) validates a change and sends
   ``knobs_req {id, values[, at_step]}`` to rank 0 only.
3. Rank 0 validates again, picks ``apply_at`` = its step in progress + a lead that covers
   the round trip (``ceil(LEAD_SECONDS / step time)``, at least ``MIN_LEAD`` steps; the
   loop is idle: ``apply_at`` is None, "now"; the request named a step: that step) and
   sends ``knobs_plan`` to the notebook, which forwards it to every rank (rank 0
   included: one code path). A plan still waiting for its step when a cell makes a new
   knob set with the same names (``hvdnb.knobs(...)`` at the top of the next training
   cell) is carried over to it.
4. Each rank applies the plan at the start of step ``apply_at`` (``knobs.step(s)`` or,
   without it, at ``hvdnb.log(step=apply_at - 1)``), and reports ``knobs_applied {id,
   step, late}``. A rank that hears of the plan after passing ``apply_at`` applies at once
   and reports ``late``; the panel marks the step(s) on the loss plot.

Owns: the engine-side ``Knobs`` object, its channel handlers and the step hook through
which ``hvdnb.log`` applies planned changes (``recorder.on_step_start``: this module uses
the recorder, the recorder never imports it); validation is ``hvdnb.protocol.knobs``
(shared by the panel and the ranks: the same function refuses a bad value in both
places). Never: raise into the training loop because of a message, apply a change in the
middle of a step, or issue a collective (the step agreement comes from rank 0's plan, not
from a broadcast).
"""

from __future__ import annotations

import threading
from typing import Any

from hvdnb.protocol import kinds
from hvdnb.protocol.errors import InputError, InputValueError, refusal
from hvdnb.protocol.kinds import Kind
from hvdnb.protocol.knobs import at_step_error, coerce, make_spec, validate
from hvdnb.rank.metrics import stop
from hvdnb.rank.metrics.recorder import (
    LEAD_SECONDS,
    MAX_LEAD,
    MIN_LEAD,
    TrainingStopped,
    get_recorder,
    on_step_start,
)
from hvdnb.rank.metrics.values import step_of

__all__ = [
    "CURRENT",
    "LEAD_SECONDS",
    "MAX_LEAD",
    "MIN_LEAD",
    "Knobs",
    "coerce",
    "knobs",
    "make_spec",
    "validate",
]


CURRENT: Knobs | None = None

#: starting values that override a cell's own (an exported script starts from the values in
#: force when the notebook exported it: ``hvdnb.rank.script.init(knobs=...)``)
DEFAULTS: dict[str, Any] = {}


class Knobs:
    """Knob values a loop reads each step; changed from the panel at an agreed step.

    Create it with ``hvdnb.knobs(...)`` inside a ``%%distributed`` cell, on every rank.

    Attributes
    ----------
    values : the current values (also readable as attributes: ``knobs.lr``)
    history : ``(step, {name: value}, late)`` for every change applied on this rank
    """

    def __init__(
        self,
        values: dict[str, Any],
        ranges: dict[str, tuple[float, float]] | None,
        rank: int,
        channel: Any,
    ) -> None:
        object.__setattr__(self, "spec", make_spec(values, ranges))
        object.__setattr__(self, "values", coerce(self.spec, values))
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "channel", channel)
        object.__setattr__(self, "pending", {})  # plan id -> plan
        object.__setattr__(self, "history", [])
        object.__setattr__(self, "_lock", threading.Lock())
        object.__setattr__(self, "_seen", set())
        object.__setattr__(self, "_done", set())
        object.__setattr__(self, "_cur", 0)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(f"no knob named {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("knobs are changed from the panel (or knobs.set(...)), not assigned")

    def __repr__(self) -> str:
        vals = ", ".join(f"{k}={v!r}" for k, v in self.values.items())
        return f"Knobs({vals})"

    # -------------------------------------------------------------- training thread
    def step(self, step: int) -> Knobs:
        """Say that ``step`` starts now: apply the changes planned for it (or missed), and
        raise ``hvdnb.TrainingStopped`` when a watcher's stop is planned for it.

        Call it at the top of each step; returns ``self`` so ``k = knobs.step(s)`` reads well.
        """
        __tracebackhide__ = True
        if type(step) is not int:
            try:
                step = step_of(step)
            except InputError as exc:
                raise type(exc)(str(exc).replace("hvdnb.log", "knobs.step")) from None
        object.__setattr__(self, "_cur", step)
        get_recorder().mark(step)
        self._advance(step)
        try:
            stop.check(step)
        except TrainingStopped as exc:  # the user's frame, not hvdnb's inner ones
            raise exc.with_traceback(None) from None
        return self

    def _advance(self, step: int) -> None:
        object.__setattr__(self, "_cur", step)
        if not self.pending:
            return
        with self._lock:
            due = [
                p for p in self.pending.values() if p["apply_at"] is None or p["apply_at"] <= step
            ]
            for p in due:
                del self.pending[p["id"]]
        for p in sorted(due, key=lambda p: (p["apply_at"] or 0, p["id"])):
            late = p["apply_at"] is not None and step > p["apply_at"]
            self._apply(p, step, late)

    def _apply(self, plan: dict[str, Any], step: int, late: bool) -> None:
        self._done.add(plan["id"])
        err = validate(self.spec, plan["values"])
        if err:
            self._send(kinds.KNOBS_APPLIED, id=plan["id"], step=step, late=late, error=err)
            return
        self.values.update(coerce(self.spec, plan["values"]))
        self.history.append((step, dict(plan["values"]), late))
        rec = get_recorder()
        for k, v in plan["values"].items():
            rec.record(step, f"knob/{k}", float(v))
        self._send(
            kinds.KNOBS_APPLIED,
            id=plan["id"],
            step=step,
            late=late,
            apply_at=plan["apply_at"],
            values=plan["values"],
        )

    def set(self, **values: Any) -> None:
        """Change values locally now (this rank only; for scripts and tests)."""
        __tracebackhide__ = True
        err = validate(self.spec, values)
        if err:
            raise InputValueError(f"knobs.set: {err}")
        self.values.update(coerce(self.spec, values))

    # -------------------------------------------------------------- channel thread
    def _send(self, kind: Kind, **payload: Any) -> None:
        if self.channel is not None:
            try:
                self.channel.send(kind, **payload)
            except Exception:
                pass

    def announce(self) -> None:
        self._send(
            kinds.KNOBS_SPEC, spec={k: {**s, "value": self.values[k]} for k, s in self.spec.items()}
        )

    def on_request(self, msg: dict[str, Any]) -> None:
        """Rank 0: a change from the panel; choose the step and publish the plan."""
        if self.rank != 0 or msg.get("id") in self._seen:
            return
        self._seen.add(msg.get("id"))
        values = msg.get("values")
        err = validate(self.spec, values) if isinstance(values, dict) else "values must be a dict"
        at = msg.get("at_step")
        err = err or at_step_error(at)  # the notebook's rule, in its words
        if err:
            self._send(kinds.KNOBS_PLAN, id=msg.get("id"), error=err)
            return
        rec = get_recorder()
        if at is not None:
            apply_at: int | None = at
        elif rec.idle():
            apply_at = None
        else:
            apply_at = rec.step_ahead(self._cur)
        self._send(
            kinds.KNOBS_PLAN,
            id=msg["id"],
            apply_at=apply_at,
            values=values,
            planned_at=max(rec.cur_step, self._cur),
        )

    def on_plan(self, msg: dict[str, Any]) -> None:
        """Every rank: the plan forwarded by the notebook; applied at the step boundary."""
        if msg.get("error") or not isinstance(msg.get("values"), dict):
            return
        plan = {"id": msg["id"], "apply_at": msg.get("apply_at"), "values": msg["values"]}
        with self._lock:
            if plan["id"] in self.pending or plan["id"] in self._done:
                return
            self.pending[plan["id"]] = plan
        rec = get_recorder()
        # after the plan is pending: the loop's next log() looks at the knobs (log() sets
        # its next event step before it reads ``pending``, so neither order misses it)
        rec.events_at_next_log()
        # rank 0 decides: None means its loop was idle, so apply now (the next loop starts
        # with the new values); a step means wait for it, even if this rank looks idle
        if plan["apply_at"] is None:
            with self._lock:
                self.pending.pop(plan["id"], None)
            self._apply(plan, max(self._cur, rec.cur_step), late=False)


def knobs(ranges: dict[str, tuple[float, float]] | None = None, **values: Any) -> Knobs:
    """Knobs the panel can change while the loop runs, applied on every rank at one step.

    Call it in a ``%%distributed`` cell (same values on every rank); read the values in
    the loop, and call ``knobs.step(step)`` at the top of each step (or rely on
    ``hvdnb.log(step, ...)`` at its end).

    Parameters
    ----------
    ranges : ``{name: (min, max)}`` accepted per knob; defaults: batch_size 1..65536,
        warmup_steps 0..1e6, lr 1e-8..10, other ints/floats >= 0
    **values : knob names and initial values (ints or floats)

    Returns
    -------
    Knobs

    Examples
    --------
    >>> knobs = hvdnb.knobs(batch_size=64, warmup_steps=100, lr=0.1)   # doctest: +SKIP
    >>> for step in range(1000):
    ...     knobs.step(step)
    ...     lr = knobs.lr * min(1.0, (step + 1) / max(1, knobs.warmup_steps))
    """
    global CURRENT
    __tracebackhide__ = True  # a refused value's traceback ends at the user's line
    rec = get_recorder()
    rank = rec.rank
    if DEFAULTS:
        values = {k: DEFAULTS.get(k, v) for k, v in values.items()}
    try:
        k = Knobs(values, ranges, rank, rec.channel)
    except (TypeError, ValueError) as exc:  # the spec's refusal (``protocol.knobs``)
        raise refusal("hvdnb.knobs", exc) from None
    old = CURRENT
    if old is not None and old.pending:
        with old._lock:  # plans for a step not reached yet belong to the new loop
            carried = {pid: p for pid, p in old.pending.items() if set(p["values"]) <= set(k.spec)}
        k.pending.update(carried)
    CURRENT = k
    ch = rec.channel
    if ch is not None:
        if old is None or not getattr(ch, "_hvdnb_knob_handlers", False):
            ch.on(kinds.KNOBS_REQ, _route("on_request"))
            ch.on(kinds.KNOBS_PLAN, _route("on_plan"))
            try:
                ch._hvdnb_knob_handlers = True
            except Exception:
                pass
        k.announce()
    return k


def _route(method: str) -> Any:
    def handler(msg: dict[str, Any]) -> None:
        k = CURRENT
        if k is not None:
            getattr(k, method)(msg)

    handler.__name__ = f"knobs_{method}"
    return handler


def _step_started(step: int) -> bool:
    """``hvdnb.log``'s step hook: step ``step`` starts; apply the current knob set's
    changes planned for it (or missed). True while a change waits for a later step (the
    recorder then calls this at every step)."""
    k = CURRENT
    if k is None:
        return False
    k._advance(step)
    return bool(k.pending)


on_step_start(_step_started, "knobs")
