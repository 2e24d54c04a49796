"""The notebook's half of the knob protocol: requests out, rank 0's plans forwarded, events.

A change goes: notebook -> rank 0 (``knobs_req``); rank 0 picks the step every rank can
apply it at and answers (``knobs_plan``); the notebook forwards that plan to every rank;
each rank reports when it applied it (``knobs_applied``). ``hvdnb.set_knobs``, ``%dist
knobs`` and the panel's controls all send through ``request_knobs`` here.

Owns: the spec the ranks announced, with the values in force (``KnobSpec``, read by
``Runs`` for a run's starting knobs); and in ``KnobRequests``: the ONE notebook-side
validation of a change (``refusal``, with ``hvdnb.protocol.knobs.validate``; ``change``
with ``after`` asks it early too), the log of requests, plans, applications and refusals
(``events``, ``status``). Handed: the point store (its lock and ``version``), the ``Link``
(where requests and plans go), ``Runs`` (each applied change is a segment of the running
run: ``Runs.applied`` records it) and the ``KnobSpec``.

Never: apply a change itself or decide its step (rank 0 does), validate with rules of its
own, write a run's record (``Runs`` does), or block the channel thread.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from hvdnb.notebook.metrics.link import Link
from hvdnb.notebook.metrics.points import PointStore
from hvdnb.notebook.metrics.ranklabels import format_ranks
from hvdnb.notebook.metrics.runs import Runs
from hvdnb.protocol import kinds
from hvdnb.protocol.knobs import at_step_error, validate

__all__ = ["KnobRequests", "KnobSpec", "describe_change"]


def _strip(msg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in msg.items() if k != "kind"}


class KnobSpec:
    """The knobs of the running job, as the ranks announced them: name -> spec, with the
    value in force (``{}``: none yet). Written under the point store's lock."""

    def __init__(self) -> None:
        self.spec: dict[str, dict[str, Any]] = {}

    def values(self) -> dict[str, Any]:
        """name -> the value in force."""
        return {k: v.get("value") for k, v in self.spec.items()}

    def reset(self) -> None:
        """A new cluster: no knobs until its ranks announce theirs."""
        self.spec = {}

    def apply(self, values: dict[str, Any]) -> None:
        """A change applied: these values are in force now."""
        for k, v in values.items():
            if k in self.spec:
                self.spec[k] = {**self.spec[k], "value": v}


class KnobRequests:
    """Knob requests, plans and applications of a ``MetricsStore``."""

    def __init__(self, points: PointStore, link: Link, runs: Runs, spec: KnobSpec) -> None:
        self._points = points
        self._link = link
        self._runs = runs
        self._spec = spec
        self.events: list[dict[str, Any]] = []  # requests, plans, applications, errors
        self.last_request: str | None = None
        self._ids = itertools.count(1)

    # -------------------------------------------------------------- from the ranks
    def on_spec(self, msg: dict[str, Any]) -> None:
        spec = msg.get("spec")
        if isinstance(spec, dict):
            with self._points.lock:
                self._spec.spec = spec
                self._runs.knobs_made(self._spec.values())
                self._points.changed()

    def on_plan(self, msg: dict[str, Any]) -> None:
        """Rank 0's decision: record it and forward it to every rank."""
        with self._points.lock:
            self.events.append({"kind": "plan", "time": time.time(), **_strip(msg)})
            self._points.changed()
        if msg.get("error"):
            return
        payload: dict[str, Any] = {k: msg[k] for k in ("id", "apply_at", "values") if k in msg}
        self._link.forward(kinds.KNOBS_PLAN, payload)

    def on_applied(self, msg: dict[str, Any]) -> None:
        with self._points.lock:
            now = time.time()
            self.events.append({"kind": "applied", "time": now, **_strip(msg)})
            if not msg.get("error"):
                vals = msg.get("values") or {}
                self._runs.applied(int(msg.get("step", 0)), vals, msg.get("rank"), now)
                self._spec.apply(vals)
            self._points.changed()

    # -------------------------------------------------------------- to the ranks
    def refusal(self, values: dict[str, Any], at_step: int | None = None) -> str | None:
        """Why the knobs refuse ``values`` (applied at ``at_step``, if given); None when
        they accept them. The one notebook-side check of a change."""
        return validate(self._spec.spec, values) or at_step_error(at_step)

    def _record_refused(self, error: str, values: dict[str, Any]) -> None:
        with self._points.lock:
            self.events.append(
                {"kind": "refused", "time": time.time(), "error": error, "values": values}
            )
            self._points.changed()

    def request(self, at_step: int | None = None, **values: Any) -> tuple[bool, str]:
        """Ask rank 0 to schedule a change; returns (sent, message). Validated here first.

        ``at_step``: apply at that step of the running loop (or of the next one, when no
        loop runs); default: as soon as every rank can, at one step."""
        if not self._spec.spec:
            return False, "no knobs yet: create them with hvdnb.knobs(...) in a %%distributed cell"
        err = self.refusal(values, at_step)
        if err:
            self._record_refused(err, values)
            return False, f"refused: {err}"
        if self._link.channel is None:
            return False, "no cluster is running"
        rid = f"k{next(self._ids)}-{int(time.time() * 1000) % 100000}"
        with self._points.lock:
            self.events.append(
                {"kind": "request", "time": time.time(), "id": rid, "values": values}
            )
            self._points.changed()
        self.last_request = rid
        extra = {"at_step": at_step} if at_step is not None else {}
        self._link.channel.send(0, kinds.KNOBS_REQ, id=rid, values=values, **extra)
        return True, f"sent to rank 0 ({rid})"

    def change(
        self,
        /,
        *,
        at_step: int | None = None,
        after: float | None = None,
        timeout: float = 3.0,
        **values: Any,
    ) -> dict[str, Any]:
        """``hvdnb.set_knobs`` on this store (see its docstring): request the change and
        wait (up to ``timeout``) for rank 0's plan and, when it applies at once, for every
        rank's report; with ``after``, send it from a timer thread and return at once."""
        if not values:
            raise ValueError("no knob values given: e.g. set_knobs(batch_size=64)")
        if after is not None:
            if not isinstance(after, (int, float)) or isinstance(after, bool) or not after >= 0:
                raise ValueError(f"after must be a number of seconds >= 0, not {after!r}")
            if self._spec.spec:  # refuse what is already known to be wrong now, not later
                err = self.refusal(values)
                if err:
                    raise ValueError(f"refused: {err}")
            if self._link.channel is None:
                raise ValueError("no cluster is running: `%dist start` first")

            def later() -> None:
                ok, msg = self.request(at_step=at_step, **values)
                if not ok:
                    self._record_refused(msg, values)

            timer = threading.Timer(float(after), later)
            timer.daemon = True
            timer.start()
            return {"scheduled_in": float(after)}
        ok, msg = self.request(at_step=at_step, **values)
        if not ok:
            raise ValueError(msg)
        rid = self.last_request
        deadline = time.monotonic() + timeout
        status = self.status(rid)
        while time.monotonic() < deadline:
            status = self.status(rid)
            plan = status.get("plan")
            if plan is not None and (plan.get("error") or plan.get("apply_at") is not None):
                break  # refused, or planned for a step: the ranks apply it when they get there
            if plan is not None and len(status.get("applied") or {}) >= len(self._link.targets()):
                break
            time.sleep(0.02)
        return status

    def status(self, rid: str | None = None) -> dict[str, Any]:
        """For one request (default: the latest): plan and the ranks that applied it."""
        with self._points.lock:
            events = list(self.events)
        if rid is None:
            reqs = [e for e in events if e["kind"] in ("request", "refused")]
            if not reqs:
                return {}
            if reqs[-1]["kind"] == "refused":
                return {"error": reqs[-1]["error"]}
            rid = reqs[-1]["id"]
        plan = next((e for e in events if e["kind"] == "plan" and e.get("id") == rid), None)
        applied = {
            e["rank"]: e
            for e in events
            if e["kind"] == "applied" and e.get("id") == rid and "rank" in e
        }
        return {"id": rid, "plan": plan, "applied": applied}

    def clear(self) -> None:  # lock held
        self.events.clear()


def describe_change(status: dict[str, Any]) -> tuple[str, bool]:
    """A knob change's fate in words, and whether it was refused: the one wording, printed
    by ``%dist knobs`` and shown in the panel's knob status line. ``status`` is
    ``knob_status()``'s (empty: no request yet, "")."""
    if status.get("error"):
        return f"refused: {status['error']}", True
    if not status:
        return "", False
    plan = status.get("plan")
    if plan is None:
        return "sent; rank 0 has not answered yet", False
    if plan.get("error"):
        return f"rank 0 refused it: {plan['error']}", True
    applied = status.get("applied") or {}
    if applied:
        steps = ", ".join(map(str, sorted({a.get("step") for a in applied.values()})))
        late = [r for r, a in applied.items() if a.get("late")]
        text = f"applied on ranks {format_ranks(applied)} at step {steps}"
        return text + (f" (late on ranks {format_ranks(late)})" if late else ""), False
    at = plan.get("apply_at")
    if at is None:
        return "applied now (no loop was running)", False
    return f"every rank applies it at step {at}", False
