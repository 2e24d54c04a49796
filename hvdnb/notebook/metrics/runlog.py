"""The metrics store's run log: this session's runs, written to the run store as they happen.

Owns (``RunLog``): this session's id (a run's id in the store is ``<session>-<run>``), the
queue the ingest feeds (``note``: one deque append per message, no lock, no I/O), the
writer thread that turns the queue into one SQLite transaction every ``INTERVAL`` seconds
(points, and the records of the runs they touched: cell, start, end, ranks, backend,
device, knobs and their changes, steps, last loss, outcome), the runs pinned to the runs
chart from the store (``pin``) and their curves. Handed: the point store (its lock, to
copy a run's record, and ``changed`` when pins change), ``Runs`` (the records) and the
``Link`` (the cluster a run ran on).

Never: open or write the file on the ingest's, the panel's or the cell's thread (only the
writer thread and the user's own calls do), lose a batch to a busy file (it is kept and
retried), or stop training on a fault: the log warns once and goes back to memory only.
"""

from __future__ import annotations

import atexit
import math
import os
import sqlite3
import threading
import time
import uuid
import warnings
from collections import deque
from typing import Any

from hvdnb.notebook.metrics.link import Link
from hvdnb.notebook.metrics.points import PointStore, thin_indices
from hvdnb.notebook.metrics.rows import MetricRow
from hvdnb.notebook.metrics.runs import Runs
from hvdnb.notebook.metrics.runstore import Batch, RunStore, StoreUnavailable
from hvdnb.notebook.metrics.tboard import RunRows

__all__ = ["INTERVAL", "RunLog", "outcome_of", "pin_label", "stored_rows"]

#: seconds between two commits of the writer thread: a run still training when the kernel
#: is killed keeps what reached the notebook up to this long before (a cell's end commits at
#: once: ``end``)
INTERVAL = 0.5


def outcome_of(errors: dict[int, dict[str, Any]]) -> str:
    """How a cell's run ended, from its ranks' errors: ``done``, ``interrupted``,
    ``error`` or ``stopped`` (by a watcher: ``hvdnb.TrainingStopped``)."""
    if any(e.get("ename") == "TrainingStopped" for e in errors.values()):
        return "stopped"
    if any(e.get("interrupted") for e in errors.values()):
        return "interrupted"
    return "error" if errors else "done"


def pin_label(r: dict[str, Any]) -> str:
    """``a3f9c1-2 (Nov 26 12:49): batch_size=64 warmup_steps=100``."""
    when = time.strftime("%b %d %H:%M", time.localtime(r["started"] or 0))
    knobs = " ".join(
        f"{k}={v:g}" for k, v in (r["knobs"] or {}).items() if isinstance(v, (int, float))
    )
    return f"{r['id']} ({when})" + (f": {knobs}" if knobs else "")


def stored_rows(
    store: RunStore, rid: str, name: str | None = None, rank: int | None = None
) -> RunRows:
    """A stored run's points as ``hvdnb.metrics()`` rows, with their knob segments (and
    the run's record: ``RunRows.record``)."""
    rec = store.run(rid)
    knobs0, changes = rec["knobs"], rec["changes"]
    out = RunRows(record=rec)
    mine: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for r, n, st, t, v in store.points(rid, name, rank):
        if r not in mine:
            mine[r] = sorted((c[0], c[1]) for c in changes if c[2] == r or c[2] is None)
        seg, kv = 0, knobs0
        for cst, cv in mine[r]:
            if cst > st:
                break
            seg += 1
            kv = {**kv, **cv}
        out.append(MetricRow(r, st, n, v, t, rec["run"] or 0, seg, dict(kv)))
    return out


class RunLog:
    """This session's runs on disk (``enabled=False``: a no-op, as for stores built by
    tests, benches and ``hvdnb.metrics.load``)."""

    def __init__(self, points: PointStore, runs: Runs, link: Link, enabled: bool) -> None:
        self._points = points
        self._runs = runs
        self._link = link
        self.enabled = enabled
        self.session = uuid.uuid4().hex[:6]
        self._q: deque[tuple[Any, ...]] = deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: RunStore | None = None
        self._con: sqlite3.Connection | None = None
        self._meta: dict[int, dict[str, Any]] = {}  # run -> its record as last written
        self._last: dict[int, dict[int, float]] = {}  # run -> rank -> last loss
        self._retry: tuple[Batch, set[int]] | None = None  # a batch a busy file refused
        self._pinned: dict[str, dict[str, Any]] = {}
        self._wlock = threading.Lock()  # one commit at a time (the thread, then atexit)
        self.warned = False

    def key(self, rid: int) -> str:
        """Run ``rid`` of this session's id in the store."""
        return f"{self.session}-{rid}"

    # ------------------------------------------------------------ the ingest's side
    def note(self, msg: dict[str, Any]) -> None:
        """A ``metrics`` message was ingested: queue its columns for the writer."""
        if not self.enabled:
            return
        rid, rank, cols = self._runs.run_id, msg.get("rank"), msg.get("cols")
        if rid and isinstance(rank, int) and isinstance(cols, dict):
            self._q.append(("pts", rid, rank, cols))
            self._start()

    def end(self, outcome: str) -> None:
        """The running cell ended (``outcome_of``): its run's record is final, and the
        writer commits it now rather than at its next tick, so a run whose cell has ended
        is on disk within milliseconds (a kernel SIGKILLed just after lost it, 2 tries in
        5, when the cell was shorter than the writer's interval)."""
        if self.enabled and self._runs.run_id:
            self._q.append(("end", self._runs.run_id, outcome, time.time()))
            self._start()
            self._wake.set()

    def flush(self, timeout: float = 10.0) -> StoreUnavailable | None:
        """Commit what is queued now (the user's reads call it first); returns why there
        is no store (None: there is one)."""
        if not self.enabled:
            return StoreUnavailable("this store keeps no runs on disk")
        done = threading.Event()
        self._q.append(("flush", done))
        self._start()
        self._wake.set()
        done.wait(timeout)
        return None if self._store is not None else StoreUnavailable(self._why)

    _why = "the run store is not open"

    @property
    def writing(self) -> bool:
        """This session has queued something for the store (its writer runs)."""
        return self._thread is not None

    def store(self) -> RunStore:
        """The run store in use; ``StoreUnavailable`` saying why there is none."""
        why = self.flush()
        if why is not None or self._store is None:
            raise why or StoreUnavailable(self._why)
        return self._store

    # ------------------------------------------------------------ the writer thread
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hvdnb-runlog", daemon=True)
            self._thread.start()
            atexit.register(self.write_batch)  # a kernel shut down cleanly loses nothing

    def _open(self) -> bool:
        if self._store is not None:
            return True
        try:
            self._store = RunStore()
            self._con = self._store.connect()
            return True
        except (StoreUnavailable, sqlite3.Error, OSError) as exc:
            self._fail(f"hvdnb: runs are kept in memory only this session: {exc}")
            return False

    def _fail(self, text: str) -> None:
        self._why = text
        self.enabled = False
        self._store = None
        if not self.warned:
            self.warned = True
            warnings.warn(text, stacklevel=2)

    def _loop(self) -> None:
        while True:
            self._wake.wait(INTERVAL)
            self._wake.clear()
            self.write_batch()
            if not self.enabled and self._store is None:
                while self._q:  # memory only: answer the flushes, drop the rest
                    item = self._q.popleft()
                    if item[0] == "flush":
                        item[1].set()
                return

    def write_batch(self) -> None:
        """Take what is queued and commit it (the writer thread; ``atexit`` too)."""
        with self._wlock:
            self._write_batch()

    def _write_batch(self) -> None:
        points, touched = self._retry or (Batch(), set())
        self._retry = None
        flushes: list[threading.Event] = []
        ended: list[tuple[int, str, float]] = []
        while self._q:
            item = self._q.popleft()
            if item[0] == "pts":
                self._take(item[1], item[2], item[3], points)
                touched.add(item[1])
            elif item[0] == "end":
                ended.append(item[1:])
                touched.add(item[1])
            else:
                flushes.append(item[1])
        if self.enabled and self._open() and (points or touched):
            self._commit(points, touched, ended)
        for ev in flushes:
            ev.set()

    def _take(self, rid: int, rank: int, cols: dict[str, Any], out: Batch) -> None:
        key = self.key(rid)
        meta = self._meta.get(rid)
        if meta is None:
            meta = self._meta[rid] = self._new_meta(rid)
        for name, col in cols.items():
            try:
                n = out.add(key, rank, name, *col)
            except (TypeError, ValueError, OverflowError):
                continue  # the ingest dropped it too
            meta["points"] += n
            if name == "loss" and n:  # steps: the last step that logged a loss
                steps, values = col[0], col[2]
                meta["steps"] = max(meta["steps"] or 0, int(max(steps)))
                last = values[-1]
                self._last.setdefault(rid, {})[rank] = math.nan if last is None else last

    def _new_meta(self, rid: int) -> dict[str, Any]:
        info = dict(self._link.info)
        return {
            "id": self.key(rid),
            "session": self.session,
            "run": rid,
            "notebook": _notebook(),
            "ranks": info.get("n"),
            "backend": info.get("backend"),
            "device": info.get("device"),
            "points": 0,
            "steps": None,
            "source": "notebook",
        }

    def _commit(
        self, points: Batch, touched: set[int], ended: list[tuple[int, str, float]]
    ) -> None:
        with self._points.lock:  # a copy of the records, no more
            found = {rid: self._runs.record(rid) for rid in touched}
            recs = {rid: dict(r) for rid, r in found.items() if r is not None}
        for rid, outcome, when in ended:
            self._meta.setdefault(rid, self._new_meta(rid)).update(outcome=outcome, ended=when)
        runs = []
        for rid, rec in recs.items():
            meta = self._meta.setdefault(rid, self._new_meta(rid))
            last = [v for v in self._last.get(rid, {}).values() if v == v]
            meta.update(
                cell=rec["cell"],
                started=rec["started"],
                knobs=rec["knobs"],
                changes=rec["changes"],
                last_loss=sum(last) / len(last) if last else None,
            )
            runs.append(meta)
        assert self._store is not None and self._con is not None
        try:
            self._store.write(self._con, points, runs)
            if ended:
                live = {self.key(r) for r in self._meta if "outcome" not in self._meta[r]}
                self._store.prune(self._con, live)
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                self._retry = (points, touched)  # kept: the next tick tries again
                return
            self._fail(
                f"hvdnb: the run store {self._store.path} failed ({exc}); runs are "
                "kept in memory only from now on (the file is left as it is)"
            )
        except sqlite3.Error as exc:
            self._fail(
                f"hvdnb: the run store {self._store.path} failed ({exc}); runs are "
                "kept in memory only from now on (the file is left as it is)"
            )

    # ------------------------------------------------------------ pinned runs
    def pin(self, ids: list[str]) -> list[str]:
        """Pin stored runs to the runs chart (``KeyError`` for an unknown id); returns the
        ids pinned now."""
        store = self.store()
        for rid in ids:
            rec = store.run(rid)
            acc: dict[int, list[float]] = {}
            samples: dict[int, float] = {}
            for _, n, st, _, v in store.points(rid, "loss") + store.points(rid, "samples"):
                if n == "samples":
                    samples[st] = samples.get(st, 0.0) + v
                elif v == v:
                    a = acc.setdefault(st, [0.0, 0.0])
                    a[0] += v
                    a[1] += 1.0
            self._pinned[rid] = {
                "label": pin_label(rec),
                "sums": acc,
                "samples": samples,
                "steps": sorted(acc),  # once: a stored run does not grow between redraws
            }
        with self._points.lock:
            self._points.changed()
        return list(self._pinned)

    def unpin(self) -> None:
        self._pinned.clear()
        with self._points.lock:
            self._points.changed()

    def pinned_curves(self, x: str = "step", points: int | None = None) -> list[dict[str, Any]]:
        """The pinned runs as ``Runs.curves`` gives the current ones (``earlier``: True)."""
        out = []
        for rid, p in list(self._pinned.items()):
            steps = p["steps"]
            idx = thin_indices(len(steps), points)[0] if points else None
            shown = steps if idx is None else [steps[i] for i in idx]
            ys = [p["sums"][s][0] / p["sums"][s][1] for s in shown]
            xs: list[float] | None = [float(s) for s in shown]
            if x == "samples":
                xs = None
                if p["samples"]:
                    tot, xmap = 0.0, {}
                    for st in sorted(set(p["samples"]) | set(steps)):
                        tot += p["samples"].get(st, 0.0)
                        xmap[st] = tot
                    xs = [xmap[s] for s in shown]
            out.append(
                {"id": rid, "label": p["label"], "xs": xs, "ys": ys, "marks": [], "earlier": True}
            )
        return out


def _notebook() -> str | None:
    """The notebook's path, as Jupyter tells its kernel (None outside Jupyter)."""
    return os.environ.get("JPY_SESSION_NAME") or None
