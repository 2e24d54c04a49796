"""The panel's table of a ParameterServerStrategy cluster (``%dist start --tf-ps K``).

One row per rank that said its TensorFlow role (``tf_role`` in its messages' meta): its
role and index, the steps it ran (workers: as ``hvdnb.ClusterCoordinator`` counted them
when it collected their results), the last loss one of its steps returned in the current
run (as the coordinator fetched it), and its process RSS (a parameter server sends its own from the
moment the coordinator is made; a worker sends none, so n/a; a reading from before the rank
took its role, an earlier cluster's same rank number, is not shown).

Owns: that table's HTML. Never: write to the store, print a missing reading as 0, or grow
with the number of ranks (first ``MAX_LINES`` rows).
"""

from __future__ import annotations

import math

from hvdnb.notebook.metrics.store import MetricsStore
from hvdnb.notebook.panel.charts import MAX_LINES

__all__ = ["ps_table"]


def _num(v: float | None, fmt: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _rss(store: MetricsStore, rank: int, since: float | None) -> float | None:
    """The rank's last RSS if it was read since it took its role (``tf_since``, sent by the
    rank itself): the memory table's latest reading may be an earlier cluster's same rank."""
    if since is None:
        return None
    _, values, times = store.series("mem/rss", rank, last=1, run=-1)
    return values[-1] if values and times[-1] >= since else None


def _last_loss(store: MetricsStore, rank: int) -> float | None:
    """The rank's last loss in the current run (the coordinator's, once it collected)."""
    values = store.series("loss", rank, last=1)[1]
    return values[-1] if values else None


def ps_table(store: MetricsStore) -> str:
    """The roles table, or "" when no rank said a TensorFlow role."""
    info = {r: dict(i) for r, i in list(store.rank_info.items()) if i.get("tf_role")}
    if not info:
        return ""
    out = [
        "<b>parameter-server cluster</b> (<i>steps</i>: scheduled steps the worker ran, "
        "counted by the coordinator; <i>loss</i>: the last one its steps returned)"
        "<table class='hvdnb-ps'><tr><th>rank</th><th>role</th><th>steps</th>"
        "<th>loss</th><th>RSS</th></tr>"
    ]
    for r in sorted(info)[:MAX_LINES]:
        i = info[r]
        worker = i["tf_role"] == "worker"
        rss = _rss(store, r, i.get("tf_since"))
        out.append(
            f"<tr><td>{r}</td><td>{i['tf_role']} {i.get('tf_index', '')}</td>"
            f"<td>{_num(i.get('ps_steps'), 'd') if worker else ''}</td>"
            f"<td>{_num(_last_loss(store, r), '.4g') if worker else ''}</td>"
            f"<td>{_num(None if rss is None else rss / 1e6, '.0f')}"
            f"{' MB' if rss is not None else ''}</td></tr>"
        )
    out.append("</table>")
    if len(info) > MAX_LINES:
        out.append(f"(first {MAX_LINES} of {len(info)} ranks)")
    return "".join(out)
