"""The notebook's half of the knob protocol: requests out, rank 0's plans forwarded, events.

A change goes: notebook -> rank 0 (``knobs_req``); rank 0 picks the step every rank can
apply it at and answers (``knobs_plan``); the notebook forwards that plan to every rank;
each rank reports when it applied it (``knobs_applied``). ``hvdnb.set_knobs``, ``%dist
knobs`` and the panel's controls all send through ``request_knobs`` here.

Owns: the ONE notebook-side validation of a change (``refusal``, with
``hvdnb.protocol.knobs.validate``; ``change_knobs`` with ``after`` asks it early too), the
spec the ranks announced, the log of requests, plans, applications and refusals
(``knob_events``, ``knob_status``), and each applied change as a segment of the running
run.

Never: apply a change itself or decide its step (rank 0 does), validate with rules of its
own, or block the channel thread.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from hvdnb.notebook.metrics.runs import RunsMixin
from hvdnb.protocol import kinds
from hvdnb.protocol.knobs import validate

__all__ = ["KnobsMixin"]


def _strip(msg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in msg.items() if k != "kind"}


class KnobsMixin(RunsMixin):
    """Knob requests, plans and applications of a ``MetricsStore``."""

    def __init__(self) -> None:
        super().__init__()
        self.knob_events: list[dict[str, Any]] = []  # requests, plans, applications, errors
        self.last_request: str | None = None
        self._ids = itertools.count(1)
        #: what the store is fed from (``MetricsStore.attach``): the side channel requests
        #: go out on, and the cluster whose ranks a plan is forwarded to
        self._cluster: Any = None
        self._channel: Any = None

    # -------------------------------------------------------------- from the ranks
    def on_spec(self, msg: dict[str, Any]) -> None:
        spec = msg.get("spec")
        if isinstance(spec, dict):
            with self._lock:
                self.knob_spec = spec
                run = self._run(self.run_id)
                if self._in_cell and not self._want_run and run is not None and not run["changes"]:
                    # knobs made in the running cell: they are this run's starting values
                    # (before its first point, the run is not started: the last run's stay)
                    run["knobs"] = {k: v.get("value") for k, v in spec.items()}
                self.version += 1

    def on_plan(self, msg: dict[str, Any]) -> None:
        """Rank 0's decision: record it and forward it to every rank."""
        with self._lock:
            self.knob_events.append({"kind": "plan", "time": time.time(), **_strip(msg)})
            self.version += 1
        if msg.get("error"):
            return
        ch = self._channel
        if ch is not None:
            payload = {k: msg[k] for k in ("id", "apply_at", "values") if k in msg}
            for r in self._ranks():
                ch.send(r, kinds.KNOBS_PLAN, **payload)

    def on_applied(self, msg: dict[str, Any]) -> None:
        with self._lock:
            self.knob_events.append({"kind": "applied", "time": time.time(), **_strip(msg)})
            if not msg.get("error"):
                vals = msg.get("values") or {}
                label = ", ".join(f"{k}={v:g}" for k, v in vals.items())
                step = int(msg.get("step", 0))
                run = self._run(self.run_id)
                if self._in_cell and self._want_run:  # applied before the cell's first log
                    self._start_run(time.time())
                    run = self._run(self.run_id)
                if self._in_cell and run is not None:  # a segment of the running run
                    run["changes"].append((step, dict(vals), msg.get("rank")))
                    if (step, label) not in run["marks"]:
                        run["marks"].append((step, label))
                for k, v in vals.items():
                    if k in self.knob_spec:
                        self.knob_spec[k] = {**self.knob_spec[k], "value": v}
            self.version += 1

    def _ranks(self) -> list[int]:
        c = self._cluster
        ids = None
        try:
            ids = list(c.client.ids) if c is not None and c.client is not None else None
        except Exception:
            ids = None
        if ids:
            return sorted(ids)
        ch = self._channel
        return list(ch.ranks) if ch is not None else []

    # -------------------------------------------------------------- to the ranks
    def refusal(self, values: dict[str, Any], at_step: int | None = None) -> str | None:
        """Why the knobs refuse ``values`` (applied at ``at_step``, if given); None when
        they accept them. The one notebook-side check of a change."""
        err = validate(self.knob_spec, values)
        if (
            err is None
            and at_step is not None
            and (isinstance(at_step, bool) or not isinstance(at_step, int) or at_step < 0)
        ):
            err = f"at_step must be a step number >= 0, not {at_step!r}"
        return err

    def _record_refused(self, error: str, values: dict[str, Any]) -> None:
        with self._lock:
            self.knob_events.append(
                {"kind": "refused", "time": time.time(), "error": error, "values": values}
            )
            self.version += 1

    def request_knobs(self, at_step: int | None = None, **values: Any) -> tuple[bool, str]:
        """Ask rank 0 to schedule a change; returns (sent, message). Validated here first.

        ``at_step``: apply at that step of the running loop (or of the next one, when no
        loop runs); default: as soon as every rank can, at one step."""
        if not self.knob_spec:
            return False, "no knobs yet: create them with hvdnb.knobs(...) in a %%distributed cell"
        err = self.refusal(values, at_step)
        if err:
            self._record_refused(err, values)
            return False, f"refused: {err}"
        if self._channel is None:
            return False, "no cluster is running"
        rid = f"k{next(self._ids)}-{int(time.time() * 1000) % 100000}"
        with self._lock:
            self.knob_events.append(
                {"kind": "request", "time": time.time(), "id": rid, "values": values}
            )
            self.version += 1
        self.last_request = rid
        extra = {"at_step": at_step} if at_step is not None else {}
        self._channel.send(0, kinds.KNOBS_REQ, id=rid, values=values, **extra)
        return True, f"sent to rank 0 ({rid})"

    def change_knobs(
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
            if self.knob_spec:  # refuse what is already known to be wrong now, not later
                err = self.refusal(values)
                if err:
                    raise ValueError(f"refused: {err}")
            if self._channel is None:
                raise ValueError("no cluster is running: `%dist start` first")

            def later() -> None:
                ok, msg = self.request_knobs(at_step=at_step, **values)
                if not ok:
                    self._record_refused(msg, values)

            timer = threading.Timer(float(after), later)
            timer.daemon = True
            timer.start()
            return {"scheduled_in": float(after)}
        ok, msg = self.request_knobs(at_step=at_step, **values)
        if not ok:
            raise ValueError(msg)
        rid = self.last_request
        deadline = time.monotonic() + timeout
        status = self.knob_status(rid)
        while time.monotonic() < deadline:
            status = self.knob_status(rid)
            plan = status.get("plan")
            if plan is not None and (plan.get("error") or plan.get("apply_at") is not None):
                break  # refused, or planned for a step: the ranks apply it when they get there
            if plan is not None and len(status.get("applied") or {}) >= len(self._ranks()):
                break
            time.sleep(0.02)
        return status

    def knob_status(self, rid: str | None = None) -> dict[str, Any]:
        """For one request (default: the latest): plan and the ranks that applied it."""
        with self._lock:
            events = list(self.knob_events)
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
