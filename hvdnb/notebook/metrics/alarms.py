"""The watchers in the store: alarms found as messages are ingested, their one line each,
and the stop a watcher set to ``stop`` asks for.

Path of an alarm: the channel thread ingests a ``metrics`` message (``ingest``) and hands
each new column to ``Alarms.column`` and the fingerprints to ``Alarms.fingerprints``; a
finding becomes an ``Alarm`` that stays *open* while it waits, at most one message
interval, for the other ranks' values at its step (ranks that turn NaN in the same round
join it: one line, not one per rank). The running cell's wait loop (main thread, with the
cell's parent header) takes the lines with ``take_lines`` and prints them; the live line
and the loss chart read ``alarm_marks`` and ``alarm_summary``.

Stop: the first alarm of a run whose watcher is set to ``stop`` sends ``stop_req`` to rank
0 at once (from the channel thread: no wait for the line); rank 0's ``stop_plan`` is
forwarded to every rank (``on_stop_plan``), as a knob plan is; see
``hvdnb.rank.metrics.stop`` for the ranks' half.

Owns (``Alarms``): the watch settings in force, each run's detectors
(``hvdnb.notebook.metrics.watchers``, reset when a run starts), the alarms and their
lines, the stop requests. Handed: the point store (its lock; the other ranks' values at an
alarm's step), the ``Link`` (the ranks, where a stop request and plan go) and ``Runs``
(the current run and cell). Never: print (the cell's wait loop does), block the channel
thread, write points or runs, or stop a loop twice.
"""

from __future__ import annotations

import bisect
import itertools
import time
from typing import Any

from hvdnb.config import get_config
from hvdnb.notebook.metrics.link import Link
from hvdnb.notebook.metrics.points import PointStore, Series
from hvdnb.notebook.metrics.runs import Runs
from hvdnb.notebook.metrics.watchers import (
    Alarm,
    DriftWatch,
    NanWatch,
    SpikeWatch,
    WatchSettings,
    is_user_metric,
    ranks_text,
    value_word,
)
from hvdnb.protocol import kinds

__all__ = ["Alarms"]

#: the other ranks' values a line lists one by one (beyond: their range)
_LIST_OTHERS = 4


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    if v != v or v in (float("inf"), float("-inf")):
        return value_word(v)
    return f"{v:.4g}"


def _plural(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {ranks_text(ranks)}"


class Alarms:
    """The watchers of a ``MetricsStore``: alarms in, lines and stop requests out."""

    def __init__(self, points: PointStore, link: Link, runs: Runs) -> None:
        self._points = points
        self._link = link
        self._runs = runs
        self.settings = WatchSettings()
        #: every alarm, in the order found (``Alarm.run`` says whose run)
        self.alarms: list[Alarm] = []
        #: stop requests and rank 0's answers
        self.stop_events: list[dict[str, Any]] = []
        self._stop_ids = itertools.count(1)
        self._reset_watchers(0)

    def _reset_watchers(self, run: int) -> None:  # lock held (or __init__)
        s = self.settings
        self._watch_run = run
        self._nan = NanWatch()
        self._spike = SpikeWatch(s)
        self._drift = DriftWatch(s)
        self._open: dict[tuple[str, str], Alarm] = {}
        self._notes: list[str] = []
        self._stop_asked: str | None = None

    def set(self, **values: Any) -> WatchSettings:
        """Change the watch settings (``hvdnb.watch``); ``ValueError`` for a bad value."""
        with self._points.lock:
            new = self.settings.update(**values)
            self.settings = self._spike.s = self._drift.s = new
            self._points.changed()
            return new

    # ------------------------------------------------------------------ channel thread
    def column(self, run: int, rank: int, name: str, steps: Any, values: Any) -> None:
        """One column of a rank's message, just stored in ``run`` (lock held)."""
        if self._watch_run != run:
            self._reset_watchers(run)
        ws = self.settings
        if ws.nan != "off" and is_user_metric(name):
            hit = self._nan.check(rank, name, steps, values)
            if hit is not None:
                self._alarm("nan", name, rank, hit[0], {"value": hit[1]})
        if name == "loss" and ws.spike != "off":
            for step, v, med in self._spike.check(rank, steps, values):
                self._alarm("spike", name, rank, step, {"value": v, "median": med})

    def fingerprints(self, run: int, rank: int, fps: Any) -> None:
        """A message's parameter fingerprints, in ``run`` (lock held)."""
        if not isinstance(fps, list) or self.settings.drift == "off":
            return
        rid = run
        if self._watch_run != rid:
            self._reset_watchers(rid)
        ranks = self._link.heard()
        for e in fps:
            if isinstance(e, dict):
                found = self._drift.add(rank, e, ranks)
                if found is not None:
                    a = Alarm(
                        "drift",
                        found["key"],
                        found["step"],
                        dict.fromkeys(found["ranks"], found["step"]),
                        found,
                        rid,
                        time.monotonic(),
                        time.monotonic(),
                    )
                    self._open[("drift", found["key"])] = a
                    self.alarms.append(a)
                    self._points.changed()
                    self._maybe_stop(a)

    def _alarm(
        self, watcher: str, metric: str, rank: int, step: int, detail: dict[str, Any]
    ) -> None:
        key = (watcher, metric)
        a = self._open.get(key)
        if a is not None:  # not shown yet: this rank joins its line
            a.ranks.setdefault(rank, step)
            a.step = min(a.step, step)
            a.detail.setdefault(rank, detail)
        else:
            now = time.monotonic()
            settle = get_config().flush_interval_steady + 0.25  # one message interval
            a = Alarm(
                watcher,
                metric,
                step,
                {rank: step},
                {rank: detail},
                self._watch_run,
                now,
                now + settle,
            )
            self._open[key] = a
            self.alarms.append(a)
        self._points.changed()
        self._maybe_stop(a)

    def _maybe_stop(self, a: Alarm) -> None:
        """The first alarm of a run whose watcher is set to ``stop``: ask rank 0 now."""
        if getattr(self.settings, a.watcher) != "stop" or self._stop_asked is not None:
            return
        ch = self._link.channel
        if ch is None or not self._runs.in_cell:
            return
        rid = f"s{next(self._stop_ids)}-{int(time.time() * 1000) % 100000}"
        self._stop_asked = rid
        reason = self._reason(a)
        self.stop_events.append(
            {"kind": "request", "time": time.time(), "id": rid, "reason": reason}
        )
        try:
            ch.send(0, kinds.STOP_REQ, id=rid, reason=reason, cell=self._runs.cell_no)
        except Exception as exc:  # the notebook must not break on a closed channel
            self._notes.append(f"hvdnb: could not ask rank 0 to stop: {exc}")

    def on_stop_plan(self, msg: dict[str, Any]) -> None:
        """Rank 0's answer to a stop request: forward it to every rank."""
        with self._points.lock:
            self.stop_events.append(
                {
                    "kind": "plan",
                    "time": time.time(),
                    **{k: v for k, v in msg.items() if k != "kind"},
                }
            )
            if msg.get("id") != self._stop_asked:
                return
            if msg.get("error"):
                self._notes.append(f"hvdnb: the loop was not stopped: {msg['error']}")
            else:
                self._notes.append(
                    f"hvdnb: every rank stops at step {msg.get('stop_at')} "
                    "(a watcher is set to stop: hvdnb.watch)"
                )
            self._points.changed()
        if not msg.get("error"):
            payload: dict[str, Any] = {
                k: msg[k] for k in ("id", "stop_at", "reason", "cell") if k in msg
            }
            self._link.forward(kinds.STOP_PLAN, payload)

    # ------------------------------------------------------------------ main thread
    def take_lines(self, final: bool = False) -> list[str]:
        """The lines to show now in the running cell: alarms whose other ranks' values
        have arrived (or waited one message interval; every one when ``final``), then
        notes about a stop."""
        if not self._open and not self._notes:
            return []
        with self._points.lock:
            now = time.monotonic()
            out: list[str] = []
            for key, a in list(self._open.items()):
                if final or now >= a.ready_by or self._peers_reached(a):
                    a.text = self._line(a)
                    out.append(a.text)
                    del self._open[key]
            if self._notes and (final or not self._open):
                out += self._notes
                self._notes.clear()
            return out

    def _others(self, a: Alarm) -> list[int]:  # lock held
        """The ranks not in the alarm: the cluster's, and any that sent points."""
        return sorted((set(self._link.targets()) | set(self._points.rank_ids())) - set(a.ranks))

    def _run_steps(self, rank: int, metric: str) -> tuple[Series, slice] | None:
        s = self._points.get(rank, metric)
        if s is None:
            return None
        rid = self._runs.run_id
        rs = s.run_slice(rid) if rid else slice(0, len(s.steps))
        return s, rs

    def _peers_reached(self, a: Alarm) -> bool:  # lock held
        if a.watcher == "drift":
            return True
        for r in self._others(a):
            got = self._run_steps(r, a.metric)
            if got is None:  # nothing of this metric from it yet: wait (up to ready_by)
                return False
            s, rs = got
            if rs.stop <= rs.start or s.steps[rs.stop - 1] < a.step:
                return False
        return True

    def _value_at(self, rank: int, metric: str, step: int) -> float | None:  # lock held
        got = self._run_steps(rank, metric)
        if got is None:
            return None
        s, rs = got
        i = bisect.bisect_left(s.steps, step, rs.start, rs.stop)
        if i < rs.stop and s.steps[i] == step:
            return float(s.values[i])
        return None

    def _others_text(self, a: Alarm) -> str:
        others = sorted(self._others(a))
        if not others:
            return ""
        vals = {r: self._value_at(r, a.metric, a.step) for r in others}
        if len(others) <= _LIST_OTHERS:
            return f"; {_plural(others)} at step {a.step}: " + ", ".join(
                _fmt(vals[r]) for r in others
            )
        got = sorted(v for v in vals.values() if v is not None)
        if not got:
            return f"; {_plural(others)} at step {a.step}: n/a"
        na = len(others) - len(got)
        return (
            f"; {_plural(others)} at step {a.step}: {_fmt(got[0])} to {_fmt(got[-1])} "
            f"(median {_fmt(got[len(got) // 2])}{f', {na} n/a' if na else ''})"
        )

    def _reason(self, a: Alarm) -> str:
        """The alarm in a few words: the stop's error text, the line's first part."""
        ranks = sorted(a.ranks)
        first = min(ranks, key=lambda r: (a.ranks[r], r))
        if a.watcher == "nan":
            v = a.detail[first]["value"]
            return (
                f"nan watcher: {a.metric} is {value_word(v)} on {_plural(ranks)} from step {a.step}"
            )
        if a.watcher == "spike":
            d = a.detail[first]
            ratio = d["value"] / d["median"] if d["median"] > 0 else float("inf")
            return (
                f"spike watcher: {a.metric} spiked on {_plural(ranks)} at step {a.step} "
                f"(rank {first}: {_fmt(d['value'])}, {ratio:.1f}x its median "
                f"{_fmt(d['median'])} over the last {self.settings.spike_window} steps)"
            )
        d = a.detail
        since = d.get("since")
        began = (
            f"it began between step {since[1]} (last matching check) and step {d['step']}"
            if since is not None
            else f"they differed already at step {d['step']}, the first check"
        )
        more = f" (the first of {d['params']} that differ)" if d["params"] > 1 else ""
        if d.get("tie"):  # no majority: neither side is named as the one that drifted
            where = f"between {_plural(d['ref_ranks'])} and {_plural(d['ranks'])}"
        else:
            where = f"on {_plural(d['ranks'])} from {_plural(d['ref_ranks'])}"
        return f"drift watcher: parameter {d['param']} differs {where}{more}; {began}"

    def _line(self, a: Alarm) -> str:  # lock held
        text = f"hvdnb {self._reason(a)}"
        if a.watcher in ("nan", "spike"):
            late = {r: s for r, s in a.ranks.items() if s != a.step}
            if late and a.watcher == "nan":
                text += (
                    " ("
                    + ", ".join(f"rank {r} from step {s}" for r, s in sorted(late.items()))
                    + ")"
                )
            text += self._others_text(a)
        else:
            vals = a.detail["values"]
            text += "; sums " + ", ".join(f"r{r} {v:.10g}" for r, v in list(vals.items())[:8])
        if getattr(self.settings, a.watcher) == "stop":
            text += f" [hvdnb.watch({a.watcher}='stop'): stopping every rank]"
        return text

    # ------------------------------------------------------------------ views
    @property
    def drift_checks(self) -> int:
        """Comparisons of the ranks' fingerprints made in the current run."""
        return self._drift.compared

    def of_run(self, run: int | None = None) -> list[Alarm]:
        """The alarms of ``run`` (default: the current one)."""
        rid = self._runs.run_id if run is None else run
        with self._points.lock:
            return [a for a in self.alarms if a.run == rid]

    def lines(self, run: int | None = None) -> list[str]:
        """Each alarm of ``run`` (default: the current one) in words: its line as shown,
        or, not shown yet, what it found."""
        alarms = self.of_run(run)
        with self._points.lock:
            return [a.text or f"hvdnb {self._reason(a)}" for a in alarms]

    def marks(self) -> list[tuple[int, str]]:
        """(step, label) of the current run's alarms, for the loss chart."""
        return [(a.step, a.label) for a in self.of_run()]

    def summary(self) -> str:
        """The live line's part: ``nan loss r1@57, spike r0@300`` ("" when none)."""
        parts = []
        for a in self.of_run()[-3:]:
            what = a.metric if a.watcher != "drift" else a.detail.get("param", "")
            parts.append(f"{a.watcher} {what} r{ranks_text(sorted(a.ranks))}@{a.step}")
        return ", ".join(parts)

    def clear(self) -> None:  # lock held
        self.alarms.clear()
        self.stop_events.clear()
        self._reset_watchers(self._runs.run_id)
