"""The watchers' detection rules, on the columns the ranks send: no processes, no store.

Three watchers look at every ``metrics`` message as the notebook ingests it (cheap numpy
checks on the new columns; nothing runs on the ranks but the drift fingerprints):

- **nan**: a NaN or +-inf in a value given to ``hvdnb.log`` (the loss and the loop's own
  keywords; not hvdnb's ``time/``, ``comm/``, ``mem/`` and ``knob/`` rows): the first such
  step, once per metric and rank in a run (``NanWatch``).
- **spike**: a rank's loss above ``spike_factor`` (3) x its running median over the last
  ``spike_window`` (50) logged steps, judged once ``spike_history`` (50) losses are in.
  The median counts as at least ``spike_floor`` (0.3) x the loss's starting level (the
  median of the run's first ``spike_history`` losses): a loss that has fallen near zero
  makes any noisy batch a "spike" by ratio (notebook 03's model: a 2-sample last batch of
  an epoch reads 0.25 against a median of 0.006). One alarm per episode; an episode ends
  after ``spike_end`` (10) steps back under the threshold (``SpikeWatch``).
- **drift**: the ranks' parameter fingerprints (``hvdnb.rank.metrics.fingerprint``) at the
  same optimizer step compared; the first parameter that differs beyond ``drift_rtol`` x its
  scale, the ranks, and the steps between the last check that matched and the first that
  did not, once per model in a run (``DriftWatch``). A cell's last fingerprint (``end``,
  after its last step's update) is compared with the other ranks' last ones only, and
  comes after the sampled fingerprint of the same count.

Owns: ``WatchSettings`` (each watcher's action, ``warn`` / ``stop`` / ``off``, and the
thresholds, with their validation and the text form ``%dist watch`` reads), the three
detectors and ``Alarm``. Never: read the store, send, print, or hold state beyond a run
(the store's ``Alarms`` resets them when a run starts).
"""

from __future__ import annotations

import dataclasses
import math
import re
from array import array
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

__all__ = [
    "ACTIONS",
    "WATCHERS",
    "Alarm",
    "DriftWatch",
    "NanWatch",
    "SpikeWatch",
    "WatchSettings",
    "is_user_metric",
    "parse_settings",
    "ranks_text",
    "value_word",
]

WATCHERS = ("nan", "spike", "drift")
ACTIONS = ("warn", "stop", "off")

#: rows hvdnb records itself: not watched for NaN (an allreduce that could not be timed is
#: NaN by design)
_OWN = ("time/", "comm/", "mem/", "knob/")


def is_user_metric(name: str) -> bool:
    """A value the loop gave ``hvdnb.log`` (loss, ``samples``, its own keywords)."""
    return not name.startswith(_OWN)


@dataclass
class WatchSettings:
    """What each watcher does (``warn``: one line in the running cell, the live line and a
    mark on the loss chart; ``stop``: that, and every rank raises ``TrainingStopped`` at
    one step; ``off``) and their thresholds."""

    nan: str = "warn"
    spike: str = "warn"
    drift: str = "warn"
    #: a loss above this many times its running median is a spike
    spike_factor: float = 3.0
    #: the running median is over this many logged steps
    spike_window: int = 50
    #: losses a rank must have logged in the run before its loss is judged
    spike_history: int = 50
    #: the median counts as at least this share of the run's starting loss level
    spike_floor: float = 0.3
    #: a spike's episode ends after this many steps back under the threshold
    spike_end: int = 10
    #: fingerprints differ when a parameter's sums differ by more than this x its scale
    #: (L2 norm x sqrt(size), a bound on the sum of |values|). Data-parallel replicas are
    #: bit-identical as a rule (every rank applies the same averaged gradient with the same
    #: code), but not always to the last bit: MPI does not promise every rank the same
    #: rounding of an allreduce, and two kinds of GPU (or thread counts) sum a fingerprint
    #: in different orders. Such differences are ~1e-7 of the scale; a rank that skipped a
    #: step, used another learning rate or had a weight changed differs by far more.
    drift_rtol: float = 1e-6

    def update(self, **values: Any) -> WatchSettings:
        """A copy with ``values`` applied; ``ValueError`` naming a bad one (nothing
        changes then)."""
        new = dataclasses.replace(self)
        known = {f.name: f for f in dataclasses.fields(self)}
        for name, v in values.items():
            f = known.get(name)
            if f is None:
                raise ValueError(f"unknown watch setting {name!r} (known: {', '.join(known)})")
            if name in WATCHERS:
                v = str(v).strip().lower()
                if v not in ACTIONS:
                    raise ValueError(f"{name}={v!r}: use one of {', '.join(ACTIONS)}")
            elif f.type == "int":
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 1:
                    raise ValueError(f"{name} must be a whole number >= 1, not {v!r}")
                v = int(v)
            else:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise ValueError(f"{name} must be a finite number, not {v!r}")
                v = float(v)
                if name == "spike_factor" and v <= 1:
                    raise ValueError(f"spike_factor must be > 1, not {v!r}")
                if v < 0:
                    raise ValueError(f"{name} must be >= 0, not {v!r}")
            setattr(new, name, v)
        return new

    def text(self) -> str:
        """``nan=warn spike=warn drift=warn (spike: 3x the median of 50 steps, ...)``."""
        acts = " ".join(f"{w}={getattr(self, w)}" for w in WATCHERS)
        return (
            f"{acts} (spike: > {self.spike_factor:g}x the median of the last "
            f"{self.spike_window} steps, after {self.spike_history}, median >= "
            f"{self.spike_floor:g}x the starting level, episode ends after {self.spike_end} "
            f"steps under; drift: rtol {self.drift_rtol:g})"
        )


_NUM = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def parse_settings(items: list[str] | str) -> dict[str, Any]:
    """``["nan=stop", "spike_factor=5"]`` (or the same as one string) as ``{"nan": "stop",
    "spike_factor": 5}``; ``ValueError`` saying what could not be read."""
    if isinstance(items, str):
        items = re.split(r"[,\s]+", re.sub(r"\s*=\s*", "=", items))
    out: dict[str, Any] = {}
    for item in (i.strip() for i in items):
        if not item:
            continue
        name, eq, raw = (p.strip() for p in item.partition("="))
        if not eq or not name.isidentifier() or not raw:
            raise ValueError(f"cannot read {item!r}: write watcher=action, e.g. nan=stop")
        if _NUM.fullmatch(raw):
            out[name] = int(raw) if re.fullmatch(r"[-+]?\d+", raw) else float(raw)
        else:
            out[name] = raw
    return out


@dataclass
class Alarm:
    """One watcher's finding. ``ranks``: each rank's first step (nan, spike) or the ranks
    that differ (drift); ``detail``: per watcher (value, median, parameter, ...)."""

    watcher: str
    metric: str
    step: int
    ranks: dict[int, int]
    detail: dict[Any, Any] = field(default_factory=dict)
    run: int = 0
    #: monotonic time it was found, and until when it waits for the other ranks' values
    found: float = 0.0
    ready_by: float = 0.0
    #: the line shown in the cell (set once it is shown)
    text: str = ""

    @property
    def label(self) -> str:
        """The loss chart's mark: ``nan r1``, ``spike r0,2``, ``drift``."""
        if self.watcher == "drift":
            return "drift"
        return f"{self.watcher} r{ranks_text(sorted(self.ranks))}"


def ranks_text(ranks: list[int]) -> str:
    """``0-3,5`` (runs of consecutive ranks shortened)."""
    out: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(f"{ranks[i]}-{ranks[j]}" if j > i + 1 else ",".join(map(str, ranks[i : j + 1])))
        i = j + 1
    return ",".join(out)


def _np(values: Any, dtype: Any) -> Any:
    """``values`` as a numpy array, without a copy for the store's typed columns."""
    if type(values) is array and len(values):
        return np.frombuffer(values, dtype)
    return np.asarray(values, dtype=dtype)


def value_word(v: float) -> str:
    """``nan``, ``inf`` or ``-inf``."""
    return "nan" if v != v else ("inf" if v > 0 else "-inf")


class NanWatch:
    """The first non-finite value of each (rank, metric), once per run."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, str]] = set()

    def check(self, rank: int, name: str, steps: Any, values: Any) -> tuple[int, float] | None:
        """(step, value) of the first NaN or +-inf in a message's column, the first time
        this rank's ``name`` has one; else None. ``steps``/``values``: int64/float64
        buffers (``array.array``) or sequences."""
        v = _np(values, np.float64)
        fin = np.isfinite(v)
        if fin.all() or (rank, name) in self.seen:
            return None
        self.seen.add((rank, name))
        i = int(np.argmin(fin))
        return int(steps[i]), float(v[i])


class _LossTrack:
    __slots__ = ("episode", "first", "last", "ref", "seen", "tail", "under")

    def __init__(self) -> None:
        self.last = -(1 << 62)  # the last step seen: a loop that starts over goes below it
        self.tail = np.empty(0)  # the last ``window`` finite losses
        self.seen = 0  # finite losses in the run so far
        self.first: list[float] = []  # the run's first ``history`` losses (for ``ref``)
        self.ref: float | None = None  # the starting level: their median
        self.episode = False
        self.under = 0  # steps under the threshold since the episode's last spike


class SpikeWatch:
    """Loss spikes per rank: see the module's docstring."""

    def __init__(self, settings: WatchSettings) -> None:
        self.s = settings
        self.tracks: dict[int, _LossTrack] = {}

    def check(self, rank: int, steps: Any, values: Any) -> list[tuple[int, float, float]]:
        """The episodes that start in this message's losses of ``rank``: (step, loss,
        the running median it was judged against)."""
        s = self.s
        v = _np(values, np.float64)
        st = _np(steps, np.int64)
        ok = np.isfinite(v)
        if not ok.all():
            v, st = v[ok], st[ok]
        m = len(v)
        if not m:
            return []
        t = self.tracks.get(rank)
        if t is None or int(st[0]) < t.last:  # new, or a new loop (steps start over)
            t = self.tracks[rank] = _LossTrack()
        t.last = int(st[-1])
        n_win, hist = s.spike_window, s.spike_history
        if t.ref is None:
            t.first.extend(v[: max(0, hist - len(t.first))].tolist())
            if len(t.first) >= hist:
                t.ref = float(np.median(t.first))
        allv = np.concatenate((t.tail, v))
        h = len(t.tail)
        first = max(0, hist - t.seen)  # the first new loss that is judged
        t.seen += m
        t.tail = allv[-n_win:]
        if first >= m or t.ref is None:
            return []
        floor = s.spike_floor * max(0.0, t.ref)
        k = s.spike_factor
        judged = v[first:]
        # cheap bound: a window's median is at least its minimum
        if not t.episode and judged.max() <= k * max(floor, float(allv.min())):
            return []
        med = np.empty(m - first)
        for i in range(first, m):  # windows shorter than n_win: the run's first losses
            j = h + i
            if j >= n_win:
                break
            med[i - first] = np.median(allv[:j]) if j else np.nan
        else:
            i = m
        if i < m:  # full windows: all at once
            j0 = h + i
            med[i - first :] = np.median(
                sliding_window_view(allv[j0 - n_win : h + m - 1], n_win), 1
            )
        thr = k * np.maximum(med, floor)
        above = judged > thr
        if not t.episode and not above.any():
            return []
        found = []
        for i, up in enumerate(above.tolist()):
            if up:
                if not t.episode:
                    t.episode = True
                    found.append((int(st[first + i]), float(judged[i]), float(med[i])))
                t.under = 0
            elif t.episode:
                t.under += 1
                if t.under >= s.spike_end:
                    t.episode = False
        return found


class DriftWatch:
    """Replica drift: each model's fingerprints compared across ranks at the same optimizer
    step (``n``); see the module's docstring."""

    #: counts kept per model while waiting for the other ranks
    KEEP = 64

    def __init__(self, settings: WatchSettings) -> None:
        self.s = settings
        self.names: dict[str, list[str]] = {}
        self.pending: dict[str, dict[int, dict[int, tuple[int, Any, Any]]]] = {}
        self.last_n: dict[str, dict[int, int]] = {}  # key -> rank -> its newest slot (add)
        self.last_match: dict[str, tuple[int, int]] = {}  # key -> (count, step)
        self.done: set[str] = set()  # models reported (once per run)
        self.compared = 0

    def add(
        self, rank: int, entry: dict[str, Any], ranks: Collection[int] = ()
    ) -> dict[str, Any] | None:
        """One fingerprint from ``rank``; the finding when it completes a comparison that
        shows drift (``{"key", "param", "index", "count", "params", "step", "ranks",
        "ref_ranks", "tie", "since", "values"}``: ``ranks`` differ from the most ranks that
        agree, ``ref_ranks``; ``tie``: as many ranks agree with them, so which side drifted
        is unknown), else None. ``ranks``: the ranks expected to
        send fingerprints too (the job's); a step is compared once each of them has sent
        it or a later one (a rank on a coarser grid skips some), or when it is among the
        oldest ``KEEP`` still waiting (a rank that never sends)."""
        try:
            key, n, step = str(entry["key"]), int(entry["n"]), int(entry["step"])
            # the slot: a cell's last fingerprint (taken after the step's update, where a
            # DDP model's sampled one is taken before it) after count n's own, before n + 1
            n = 2 * n + (1 if entry.get("end") else 0)
            sums = np.asarray(entry["sums"], dtype=np.float64)
            scale = np.asarray(entry["scale"], dtype=np.float64)
        except (KeyError, TypeError, ValueError):
            return None
        if sums.shape != scale.shape or sums.ndim != 1:
            return None
        if isinstance(entry.get("names"), list):
            self.names[key] = [str(x) for x in entry["names"]]
        if key in self.done:
            return None
        pend = self.pending.setdefault(key, {})
        pend.setdefault(n, {})[rank] = (step, sums, scale)
        last = self.last_n.setdefault(key, {})
        last[rank] = max(n, last.get(rank, n))
        # every rank expected is past these counts
        upto = min(last.get(r, -1) for r in {*ranks, *last})
        ready = sorted(x for x in pend if x <= upto)
        if len(pend) - len(ready) > self.KEEP:  # a rank that never sends: go on without it
            ready = sorted(pend)[: len(pend) - self.KEEP]
        found = None
        for c in ready:
            group = pend.pop(c)
            if found is None and len(group) >= 2:
                found = self._compare(key, c, group)
        if found is not None:
            self.done.add(key)
            self.pending.pop(key, None)
        return found

    def _compare(
        self, key: str, slot: int, group: dict[int, tuple[int, Any, Any]]
    ) -> dict[str, Any] | None:
        self.compared += 1
        n = slot >> 1  # the optimizer's step count (see ``add``)
        rtol = self.s.drift_rtol
        classes: list[list[int]] = []
        for r in sorted(group):
            for c in classes:
                if _close(group[r], group[c[0]], rtol):
                    c.append(r)
                    break
            else:
                classes.append([r])
        step = min(g[0] for g in group.values())
        if len(classes) == 1:
            self.last_match[key] = (n, step)
            return None
        ref = max(classes, key=lambda c: (len(c), -c[0]))  # the most ranks; ties: lowest rank
        odd = sorted(r for c in classes if c is not ref for r in c)
        # no majority (two ranks, or classes of one size): which side drifted is unknown
        tie = sum(len(c) == len(ref) for c in classes) > 1
        _, s0, sc0 = group[ref[0]]
        bad = np.zeros(len(s0), dtype=bool)
        for r in odd:
            _, s1, sc1 = group[r]
            bad |= ~_param_close(s0, sc0, s1, sc1, rtol)
        idx = int(np.argmax(bad))
        names = self.names.get(key)
        param = names[idx] if names is not None and idx < len(names) else f"parameter {idx}"
        return {
            "key": key,
            "param": param,
            "index": idx,
            "params": int(bad.sum()),
            "count": n,
            "step": step,
            "ranks": odd,
            "ref_ranks": sorted(ref),
            "tie": tie,
            "since": self.last_match.get(key),
            "values": {r: float(group[r][1][idx]) for r in sorted(group)},
        }


def _param_close(s0: Any, sc0: Any, s1: Any, sc1: Any, rtol: float) -> Any:
    """Per parameter: do two fingerprints agree (NaN equals NaN: the nan watcher tells)."""
    tol = rtol * np.maximum(sc0, sc1)
    with np.errstate(invalid="ignore"):
        return (np.abs(s0 - s1) <= tol) | (np.isnan(s0) & np.isnan(s1)) | (s0 == s1)


def _close(a: tuple[int, Any, Any], b: tuple[int, Any, Any], rtol: float) -> bool:
    return len(a[1]) == len(b[1]) and bool(_param_close(a[1], a[2], b[1], b[2], rtol).all())
