"""The panel belongs to its cluster: a new start's header names the new cluster, never a
step of the old one, and runs of the old cluster stay on the runs chart, marked earlier.

No processes: a store fed by hand, attached to two stand-in clusters in turn (each with
its own channel, as a start or a restart brings one).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from hvdnb.notebook.metrics.store import MetricsStore
from hvdnb.notebook.panel.charts import runs_chart
from hvdnb.notebook.panel.tables import header_html

pytestmark = [pytest.mark.timeout(60)]


class _Channel:
    def __init__(self) -> None:
        self.handlers: dict[str, object] = {}

    def on(self, kind: object, handler: object) -> None:
        self.handlers[str(kind)] = handler


def _cluster(n: int, backend: str | None, device: str) -> SimpleNamespace:
    return SimpleNamespace(
        n=n,
        backend=backend,
        device=device,
        channel=_Channel(),
        hosts_seen={r: "h" for r in range(n)},
    )


def _loss(rank: int, seq: int, steps: range, loss: float) -> dict:
    return {
        "rank": rank,
        "seq": seq,
        "pid": 100 + rank,
        "step": steps[-1],
        "backend": "nccl",
        "idle": True,
        "cols": {"loss": [list(steps), [0.0] * len(steps), [loss] * len(steps)]},
    }


def _text(st: MetricsStore) -> str:
    return re.sub(r"<[^>]+>", "", header_html(st)[0]).replace("&middot;", "|")


def test_a_new_cluster_shows_itself_and_keeps_earlier_runs_marked():
    st = MetricsStore()
    st.attach(_cluster(1, "nccl", "GPU"))
    st.begin_cell(1)
    st.ingest(_loss(0, 1, range(2790, 2798), 0.5))
    st.end_cell()
    assert "1 rank | NCCL | GPU | step 2797" in _text(st)

    st.attach(_cluster(2, None, "CPU"))  # %dist stop, then %dist start -n 2
    head = _text(st)
    assert head.startswith("hvdnb 2 ranks | backend auto | CPU | no steps yet"), head
    assert "2797" not in head and "NCCL" not in head
    assert st.ranks() == [0, 1]
    chart = runs_chart(st)
    assert [label for label, _, _ in chart.lines] == ["run 1 (earlier cluster: 1 rank, NCCL, GPU)"]
    assert chart.earlier == [0]

    st.begin_cell(2)  # the new cluster's first run: its own, not earlier
    for r in (0, 1):
        st.ingest({**_loss(r, 1, range(3), 1.0), "backend": "gloo"})
    st.end_cell()
    assert "2 ranks | Gloo | CPU | step 2" in _text(st)
    chart = runs_chart(st)
    assert [label for label, _, _ in chart.lines] == [
        "run 1 (earlier cluster: 1 rank, NCCL, GPU)",
        "run 2",
    ]
    assert chart.earlier == [0]
    assert len(st.rows("loss", run=1)) == 8  # earlier points are kept


def test_attaching_the_same_channel_again_changes_nothing():
    st = MetricsStore()
    c = _cluster(2, "gloo", "CPU")
    st.attach(c)
    st.begin_cell(1)
    st.ingest(_loss(0, 1, range(5), 1.0))
    st.end_cell()
    st.attach(c)  # %dist panel: the same cluster, the same channel
    assert st.run_id == 1 and "step 4" in _text(st)
    assert runs_chart(st).earlier == []


def test_the_header_says_which_ranks_the_debugger_holds_until_it_is_cleared():
    st = MetricsStore()
    st.attach(_cluster(2, None, "CPU"))
    version = st.version
    st.set_notice("rank 1 paused in the debugger; rank 0 waits on it")
    assert _text(st).endswith("| rank 1 paused in the debugger; rank 0 waits on it"), _text(st)
    assert st.version != version  # the panel draws it
    st.set_notice("")
    assert "paused" not in _text(st)
