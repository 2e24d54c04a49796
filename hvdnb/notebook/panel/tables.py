"""The panel's numbers: the header line and the HTML tables under the charts.

Header: ranks, backends, step (of total), samples/s, training or idle, age of the last
message, lost messages. Tables: allreduce per rank and bucket (first 8 ranks), memory per
rank (first ``MAX_LINES``; the columns are the memory model's), one row per host when
the ranks span hosts (first 64), and a ``--tf-ps`` cluster's roles (``pstable``).

Owns: the text and HTML of those numbers. Never: touch widgets, write to the store, print
a missing reading as 0 (it says "n/a"), or grow with the number of ranks (tables are cut).
"""

from __future__ import annotations

import html
import math
import time
from typing import Any

from hvdnb.notebook.cellout.output import format_ranks
from hvdnb.notebook.metrics.store import MetricsStore
from hvdnb.notebook.panel.charts import MAX_LINES, backend_name, backends_text, memory_chart
from hvdnb.notebook.panel.pstable import ps_table

__all__ = ["fmt_bytes", "header_html", "tables_html"]

#: the header before any rank logged
WAITING = "<b>hvdnb</b>: waiting for data from the ranks (hvdnb.log(step, loss) in the loop)"


def fmt_bytes(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.2f} {unit}"
    return f"{v:.0f} B"


def header_html(store: MetricsStore) -> tuple[str, tuple[int, int] | None]:
    """The header line, and (step, total) when the loop said its total.

    It describes the attached cluster only (``store.cluster_info``): after a new start
    its size, backend and device and "no steps yet", never a step of an earlier one."""
    s = store
    ranks = s.ranks()
    cluster = s.cluster_info
    if not ranks and not cluster:
        return WAITING, None
    step, total = s.progress()
    stepped = any(i.get("step") is not None for i in s.rank_info.values())
    rate = s.throughput()
    seen = max((i.get("seen") or 0) for i in s.rank_info.values()) if s.rank_info else 0
    age = time.time() - seen if seen else None
    live = s.live_ranks()  # a rank lost while it trained never says it is idle
    running = any(not s.rank_info.get(r, {}).get("idle", True) for r in live)
    n = cluster.get("n") or len(ranks)
    reported = any(i.get("backend") for i in s.rank_info.values())
    parts = [
        f"<b>hvdnb</b> {n} rank{'s' if n != 1 else ''}",
        backends_text(s)
        if reported or not cluster
        else (backend_name(cluster["backend"]) if cluster.get("backend") else "backend auto"),
    ]
    if cluster.get("device"):
        parts.append(str(cluster["device"]))
    parts += [
        (f"step {step}" + (f" of {total}" if total else "")) if stepped else "no steps yet",
        f"{rate:,.0f} samples/s" if rate is not None else "samples/s n/a",
        "training" if running else "idle",
    ]
    if age is not None:
        parts.append(f"updated {age:.1f} s ago")
    if s.notice:
        parts.append(f"<span style='color:#b35900'>{html.escape(s.notice)}</span>")
    if s.lost_messages or s.lost_rows:
        parts.append(
            f"<span style='color:#c00'>lost: {s.lost_messages} messages, "
            f"{s.lost_rows} points</span>"
        )
    return " &middot; ".join(parts), ((step, total) if total else None)


def tables_html(store: MetricsStore) -> str:
    """The hosts, parameter-server, allreduce and memory tables."""
    return host_table(store) + ps_table(store) + comm_table(store) + memory_table(store)


def comm_table(store: MetricsStore) -> str:
    rows = store.comm_summary()
    if not rows:
        return ""
    by_rank = sorted({r["rank"] for r in rows})
    shown = [r for r in rows if r["rank"] in by_rank[:8]]
    out = [
        "<b>allreduce</b> (median of the last 20; <i>collective</i>: the "
        "operation's own time, from the last rank's arrival, <i>exposed</i>: what the step "
        "waited for it, <i>bus bw</i>: size x 2(n-1)/n / collective)"
        "<table class='hvdnb-comm'><tr><th>rank</th><th>bucket</th><th>size</th>"
        "<th>collective</th><th>exposed</th><th>bus bw</th>"
        "<th>backend</th></tr>"
    ]
    for r in shown[:48]:
        t = f"{1e3 * r['time']:.3f} ms" if r["time"] is not None else "n/a"
        ex = f"{1e3 * r['exposed']:.3f} ms" if r.get("exposed") is not None else "n/a"
        bw = f"{r['bus_bandwidth'] / 1e9:.2f} GB/s" if r["bus_bandwidth"] else "n/a"
        out.append(
            f"<tr><td>{r['rank']}</td><td>{html.escape(r['bucket'])}</td>"
            f"<td>{fmt_bytes(r['bytes'])}</td><td>{t}</td><td>{ex}</td>"
            f"<td>{bw}</td><td>{backend_name(r['backend'])}</td></tr>"
        )
    out.append("</table>")
    if len(by_rank) > 8:
        out.append(f"(first 8 of {len(by_rank)} ranks)")
    return "".join(out)


#: the memory table's column titles
_HEADS = {
    "gpu_allocated": "allocated",
    "gpu_reserved": "reserved",
    "gpu_nvml_used": "used (NVML)",
    "gpu_util_pct": "GPU util",
    "gpu_membw_util_pct": "mem bw util",
    "rss": "RSS",
}


def _fmt_reading(column: str, v: float | None) -> str:
    if column.endswith("_pct"):
        return "n/a" if v is None else f"{v:.0f} %"
    return fmt_bytes(v)


def memory_table(store: MetricsStore) -> str:
    m = memory_chart(store)
    if not m.values:
        return ""
    cols = m.columns
    out = [
        "<b>memory</b><table><tr><th>rank</th>"
        + "".join(f"<th>{_HEADS.get(c, c)}</th>" for c in cols)
        + "</tr>"
    ]
    for r in m.ranks[:MAX_LINES]:
        out.append(
            f"<tr><td>{r}</td>"
            + "".join(f"<td>{_fmt_reading(c, m.values[r].get(c))}</td>" for c in cols)
            + "</tr>"
        )
    out.append("</table>")
    return "".join(out)


def host_table(store: MetricsStore) -> str:
    """One row per host (when ranks span hosts): ranks, steps, loss and step-time bands."""
    hs = store.host_summary()
    if len(hs) < 2:
        return ""

    def num(v: Any, fmt: str = ".4g") -> str:
        return "n/a" if v is None else format(v, fmt)

    out = [
        "<b>hosts</b><table class='hvdnb-hosts'><tr><th>host</th><th>ranks</th>"
        "<th>step min..max</th><th>loss min / median / max</th>"
        "<th>step time min..max</th></tr>"
    ]
    for h in hs[:64]:
        st = (
            f"{1e3 * h['step_time_min']:.1f}..{1e3 * h['step_time_max']:.1f} ms"
            if h["step_time_min"] is not None
            else "n/a"
        )
        out.append(
            f"<tr><td>{html.escape(h['host'])}</td><td>{format_ranks(h['ranks'])}</td>"
            f"<td>{num(h['step_min'], 'd')}..{num(h['step_max'], 'd')}</td>"
            f"<td>{num(h['loss_min'])} / {num(h['loss_median'])} / {num(h['loss_max'])}</td>"
            f"<td>{st}</td></tr>"
        )
    out.append("</table>")
    if len(hs) > 64:
        out.append(f"(first 64 of {len(hs)} hosts)")
    return "".join(out)
