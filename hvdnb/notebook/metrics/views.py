"""What the panel and ``%dist`` read of the points: step-time breakdown, hints, comm, hosts.

Owns (``Views``, handed the point store, ``Runs`` for the current run and the ``Link`` for
what the ranks said of themselves; its one field is the breakdown's cache): the ranks the
views cover (``ranks``) and the derived views of the current run: per-step sums
(``per_step``, ``at_steps``), the step-time breakdown into data / compute / comm with its
one-line hint, the collectives (``collective_times``, ``comm_summary``), memory,
throughput, progress, and the ranks grouped by host (``hosts``, ``host_summary``: each
rank says its host once, in ``rank_info``).

Communication, per collective or fused bucket and step, as ``hvdnb.torch`` and
``ddp_comm_hook`` report it: ``comm/<bucket>/time`` is the collective's own duration,
``comm/<bucket>/exposed`` what the training thread waited for it (the step breakdown's
"comm" when the loop marks no ``phase("comm")``), ``comm/<bucket>/bytes`` this rank's
payload. While a loop logs, ranks time the collectives of one step in k (see
``Config.comm_sample_interval``): these rows exist on those steps only. A collective is
one operation: it runs from the moment the last rank joins it to its completion, and a
rank that started it earlier also waited for the others. So the panel's *collective
time* of a bucket at a step is the smallest of the ranks' own readings (the last rank to
arrive waited least); a rank's excess over it is waiting for peers, which shows as
exposed time and in the straggler hint. Bus bandwidth follows nccl-tests:
``bytes * 2 (n - 1) / n / collective time`` for n ranks.

Never: change the points, hold the lock while computing medians, or invent a value: a
figure that was not measured is None ("n/a"), not 0.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from typing import Any

from hvdnb.notebook.metrics.link import Link
from hvdnb.notebook.metrics.points import MANY_RANKS, PointStore
from hvdnb.notebook.metrics.runs import Runs

__all__ = ["Views"]


class Views:
    """The derived views of a ``MetricsStore``; they read, never write, the points."""

    def __init__(self, points: PointStore, runs: Runs, link: Link) -> None:
        self._points = points
        self._runs = runs
        self._link = link
        self._breakdown_cache: tuple[tuple[int, int], dict[int, dict[str, float]]] | None = None

    def ranks(self) -> list[int]:
        """The ranks of the attached cluster (every rank heard from, before any)."""
        with self._points.lock:
            if self._link.number:
                return sorted(self._link.rank_info)
            return sorted(set(self._points.rank_ids()) | set(self._link.rank_info))

    def live_ranks(self) -> list[int]:
        """``ranks()`` less those an elastic cluster went on without (dead, stopped, taken
        out by a scale: no longer in its membership). What the panel shows as now (its
        header, step-time bars, memory, allreduce lines, the cell's line) is theirs only;
        the points of the others stay, in the loss chart and ``hvdnb.metrics()``."""
        ranks = self.ranks()
        members = getattr(getattr(self._link.cluster, "membership", None), "members", None)
        if members is None:  # a fixed-size cluster: a dead rank fails the cell, then restart
            return ranks
        keep = set(members)
        return [r for r in ranks if r in keep]

    def per_step(
        self, prefix: str, rank: int, last_steps: int = 50, suffix: str = "/time"
    ) -> dict[int, float]:
        """Sum of every metric whose name starts with ``prefix`` and ends with ``suffix``
        (or equals ``prefix``), per step of the current run, over its last ``last_steps``
        steps."""
        with self._points.lock:
            keys = self._summed_keys(prefix, rank, suffix)
            rid = self._runs.run_id
            parts = []
            for k in keys:
                s = self._points.get(*k)
                if s is None:
                    continue
                rs = s.run_slice(rid)
                lo = max(rs.start, rs.stop - 4 * last_steps)
                parts.append((s.steps[lo : rs.stop], s.values[lo : rs.stop]))
        out: dict[int, float] = {}
        for steps, values in parts:
            for st, v in zip(steps, values):
                if v == v:
                    out[st] = out.get(st, 0.0) + v
        if len(out) > last_steps:
            keep = sorted(out)[-last_steps:]
            out = {k: out[k] for k in keep}
        return out

    def _summed_keys(self, prefix: str, rank: int, suffix: str) -> list[tuple[int, str]]:
        """The series ``per_step`` / ``at_steps`` sum: ``prefix`` itself, or names starting
        with ``prefix`` and ending with ``suffix`` (caller holds the lock)."""
        return [
            (rank, n)
            for n in self._points.names_of(rank)
            if n == prefix or (n.startswith(prefix) and n.endswith(suffix))
        ]

    def at_steps(
        self, prefix: str, rank: int, steps: Any, suffix: str = "/time"
    ) -> dict[int, float]:
        """``per_step``'s sums at the given steps of the current run (steps missing from a
        series contribute nothing). Found by bisection: step numbers increase within a
        loop; a cell that runs two loops (steps start over) may find fewer of them."""
        with self._points.lock:
            keys = self._summed_keys(prefix, rank, suffix)
            rid = self._runs.run_id
            out: dict[int, float] = {}
            for k in keys:
                s = self._points.get(*k)
                if s is None:
                    continue
                rs = s.run_slice(rid)
                arr, values = s.steps, s.values
                lo_, hi_ = rs.start, rs.stop
                for st in steps:
                    i = bisect.bisect_left(arr, st, lo_, hi_)
                    while i < hi_ and arr[i] == st:
                        v = values[i]
                        if v == v:
                            out[st] = out.get(st, 0.0) + v
                        i += 1
        return out

    def breakdown(self, last_steps: int = 50) -> dict[int, dict[str, float]]:
        """Median seconds per step on each rank, split into data / compute / comm.

        ``step`` comes from the time between two ``hvdnb.log`` calls, ``data`` from
        ``phase("data")`` (or ``data_time=``), ``comm`` from ``phase("comm")`` when marked,
        else the *exposed* communication ``hvdnb.torch`` / ``ddp_comm_hook`` reported (time
        the training thread waited for collectives; communication hidden behind backward
        is compute time, not comm), and ``compute`` is the rest (or ``phase("compute")``
        when marked). With exposed communication, the medians are over the last
        ``last_steps`` steps whose collectives were timed (one step in k while a loop logs,
        see ``Config.comm_sample_interval``): each row pairs a step's own total, data and
        comm.

        Computed once per store version (the panel's chart and hint share it); beyond
        ``MANY_RANKS`` ranks the medians cover the last ``last_steps // 5`` steps, which
        keeps a redraw at 1,024 ranks within ~0.1 s.
        """
        cached = self._breakdown_cache
        version = self._points.version
        if cached is not None and cached[0] == (version, last_steps):
            return cached[1]
        ranks = self.live_ranks()
        if len(ranks) > MANY_RANKS:
            last_steps = max(5, last_steps // 5)
        out: dict[int, dict[str, float]] = {}
        for r in ranks:
            step = self.per_step("time/step", r, last_steps)
            if not step:
                continue
            comm = self.per_step("time/comm", r, last_steps)
            if comm:
                data = self.per_step("time/data", r, last_steps)
                marked_compute = self.per_step("time/compute", r, last_steps)
            else:
                comm = self.per_step("comm/", r, last_steps, suffix="/exposed")
                if comm:  # the timed steps (one in k): every part read at those steps
                    step = self.at_steps("time/step", r, comm) or step
                data = self.at_steps("time/data", r, step)
                marked_compute = self.at_steps("time/compute", r, step)
            rows = []
            for st, total in step.items():
                d = min(data.get(st, 0.0), total)
                c = min(comm.get(st, 0.0), total - d)
                comp = marked_compute.get(st, total - d - c)
                rows.append((total, d, c, comp))
            med = [statistics.median(col) for col in zip(*rows)]
            out[r] = {"step": med[0], "data": med[1], "comm": med[2], "compute": med[3]}
        self._breakdown_cache = (
            (version, last_steps if len(ranks) <= MANY_RANKS else last_steps * 5),
            out,
        )
        return out

    def hint(self, last_steps: int = 50) -> str:
        """One line naming the bottleneck (data, communication or compute) and stragglers."""
        b = self.breakdown(last_steps)
        if not b:
            if any(i.get("tf_role") for i in list(self._link.rank_info.values())):
                # a ParameterServerStrategy cluster: the coordinator (this kernel) counts the
                # steps; the workers time none (TensorFlow runs them, not a cell's loop)
                return (
                    "parameter-server cluster: hvdnb.ClusterCoordinator counts each worker's "
                    "steps and loss (table below); no step-time breakdown"
                )
            return "no step times yet: call hvdnb.log(step, loss) once per step"
        tot = {k: statistics.median(v[k] for v in b.values()) for k in ("data", "comm", "compute")}
        step = statistics.median(v["step"] for v in b.values()) or 1e-12
        worst = max(tot, key=lambda k: tot[k])
        words = {"data": "data loading", "comm": "communication", "compute": "compute"}
        share = f"{100 * tot[worst] / step:.0f}% of a {1e3 * step:.1f} ms step"
        line = f"bottleneck: {words[worst]} ({share})"
        busy = {r: v["data"] + v["compute"] for r, v in b.items()}
        if len(busy) > 1:
            med = statistics.median(busy.values())
            slow = max(busy, key=lambda r: busy[r])
            if med > 0 and busy[slow] > 1.2 * med and busy[slow] - med > 1e-4:
                line += (
                    f"; straggler: rank {slow} ({busy[slow] / med:.2f}x the median "
                    "data+compute time; the others wait for it in allreduce)"
                )
        return line

    def hosts(self) -> dict[str, list[int]]:
        """Ranks grouped by the host they said they run on (``"?"`` until they say)."""
        out: dict[str, list[int]] = {}
        for r in self.ranks():
            out.setdefault(str(self._link.rank_info.get(r, {}).get("host") or "?"), []).append(r)
        return dict(sorted(out.items(), key=lambda kv: kv[1][0]))

    def host_summary(self, name: str = "loss") -> list[dict[str, Any]]:
        """Per host: its ranks, the step range, and the min / median / max over its ranks
        of the latest ``name`` and of the step time (None where no rank sent them)."""
        out = []
        for host, ranks in self.hosts().items():
            vals, steps, times = [], [], []
            for r in ranks:
                v = self._points.latest(name, r)
                if v is not None and v == v:
                    vals.append(v)
                info = self._link.rank_info.get(r, {})
                if info.get("step") is not None:
                    steps.append(int(info["step"]))
                if info.get("step_time") is not None:
                    times.append(float(info["step_time"]))
            out.append(
                {
                    "host": host,
                    "ranks": ranks,
                    "step_min": min(steps) if steps else None,
                    "step_max": max(steps) if steps else None,
                    f"{name}_min": min(vals) if vals else None,
                    f"{name}_median": statistics.median(vals) if vals else None,
                    f"{name}_max": max(vals) if vals else None,
                    "step_time_min": min(times) if times else None,
                    "step_time_max": max(times) if times else None,
                }
            )
        return out

    def collective_times(self, last_steps: int = 50) -> dict[str, dict[int, float]]:
        """Per bucket, per step of the current run: the collective's time, i.e. the
        smallest of the ranks' readings at that step (see the module docstring); NaN
        readings (not measurable) are left out."""
        with self._points.lock:
            out: dict[str, dict[int, float]] = {}
            rid = self._runs.run_id
            for (_, n), s in self._points.items():
                if not (n.startswith("comm/") and n.endswith("/time")):
                    continue
                rs = s.run_slice(rid)
                lo = max(rs.start, rs.stop - 4 * last_steps)
                per = out.setdefault(n[5:-5], {})
                for st, v in zip(s.steps[lo : rs.stop], s.values[lo : rs.stop]):
                    if v == v and (st not in per or v < per[st]):
                        per[st] = v
        for bucket, per in out.items():
            if len(per) > last_steps:
                keep = sorted(per)[-last_steps:]
                out[bucket] = {k: per[k] for k in keep}
        return out

    def comm_summary(self, last: int = 20) -> list[dict[str, Any]]:
        """Per rank and bucket, over its last ``last`` completions in the current run:
        median collective time (``time``: the bucket's time at each step is the smallest
        of the ranks' readings, see the module docstring; ``own_time``: this rank's own
        readings, waiting for peers included), median exposed time (``exposed``), median
        bytes, bus bandwidth (``bytes * 2 (n - 1) / n / time``, nccl-tests' definition,
        n = ranks reporting) and backend. A figure that was not measured is None
        ("n/a")."""
        n_ranks = max(1, len(self.ranks()))
        coll = self.collective_times(last_steps=last)
        with self._points.lock:
            keys = [
                k
                for k, _ in self._points.items()
                if k[1].startswith("comm/") and k[1].endswith("/time")
            ]
            data = []
            rid = self._runs.run_id

            def tail(key: tuple[int, str]) -> tuple[Sequence[int], Sequence[float]]:
                s = self._points.get(*key)
                if s is None:
                    return [], []
                rs = s.run_slice(rid)
                lo = max(rs.start, rs.stop - last)
                return s.steps[lo : rs.stop], s.values[lo : rs.stop]

            for r, n in keys:
                steps, t = tail((r, n))
                if t:
                    data.append(
                        (
                            r,
                            n[5:-5],
                            steps,
                            t,
                            tail((r, n[:-5] + "/bytes"))[1],
                            tail((r, n[:-5] + "/exposed"))[1],
                        )
                    )
        out = []
        factor = 2 * (n_ranks - 1) / n_ranks
        for r, bucket, steps, t, nb, ex in sorted(data):
            own = [x for x in t if x == x]
            per = coll.get(bucket, {})
            tt = [per[st] for st in steps if st in per]
            ee = [x for x in ex if x == x]
            med_t = statistics.median(tt) if tt else None
            med_b = statistics.median(nb) if nb else None
            bw = med_b * factor / med_t if med_t and med_b is not None and factor else None
            out.append(
                {
                    "rank": r,
                    "bucket": bucket,
                    "time": med_t,
                    "bytes": med_b,
                    "own_time": statistics.median(own) if own else None,
                    "exposed": statistics.median(ee) if ee else None,
                    "bus_bandwidth": bw,
                    "bandwidth": bw,
                    "backend": self._link.rank_info.get(r, {}).get("backend"),
                }
            )
        return out

    def memory(self) -> dict[int, dict[str, float | None]]:
        """Latest memory and GPU-utilisation readings per rank of the attached cluster
        (None: not reported by it: after a restart, a rank that has not reported yet reads
        n/a, never the previous cluster's figure for the same rank number)."""
        names = (
            "mem/rss",
            "mem/gpu_allocated",
            "mem/gpu_reserved",
            "mem/gpu_nvml_used",
            "mem/gpu_util_pct",
            "mem/gpu_membw_util_pct",
        )
        since = self._link.began
        return {
            r: {n[4:]: self._points.latest(n, r, since) for n in names} for r in self.live_ranks()
        }

    def throughput(self, window: float = 3.0) -> float | None:
        """Samples per second over every rank in the last ``window`` seconds of logs."""
        total, t_lo, t_hi = 0.0, math.inf, -math.inf
        found = False
        ranks = self.ranks()
        rid = self._runs.run_id
        last = 2000 if len(ranks) <= MANY_RANKS else 200
        for r in ranks:
            _, vals, times = self._points.series("samples", r, rid, last=last)
            if not times:
                continue
            found = True
            # a rank's samples come from its log() calls, in time order
            i = bisect.bisect_right(times, times[-1] - window)
            if len(times) - i < 2:
                continue
            total += sum(vals[i + 1 :])
            t_lo, t_hi = min(t_lo, times[i]), max(t_hi, times[-1])
        if not found or t_hi <= t_lo:
            return None
        return total / (t_hi - t_lo)

    def progress(self) -> tuple[int, int | None]:
        """(latest step seen on any rank, total_steps if the loop said so)."""
        infos = list(self._link.rank_info.values())
        steps: list[int] = [i.get("step") or 0 for i in infos]
        totals: list[int] = [i["total_steps"] for i in infos if i.get("total_steps")]
        return (max(steps) if steps else 0), (max(totals) if totals else None)
