"""``MetricsStore`` is a facade over parts it owns: its public surface stays whole, it
inherits from no hvdnb class, and its parts share the point store's one lock."""

from __future__ import annotations

import inspect

import pytest

from hvdnb.notebook.metrics.store import MetricsStore

pytestmark = [pytest.mark.timeout(30)]

#: what code outside hvdnb/notebook/metrics/ (panel, magics, cells, cluster, benches,
#: tests, notebooks) calls or reads on the store
METHODS = [
    "alarm_lines",
    "alarm_marks",
    "alarm_summary",
    "at_steps",
    "attach",
    "attach_current",
    "begin_cell",
    "breakdown",
    "change_knobs",
    "clear",
    "collective_times",
    "comm_summary",
    "count",
    "current_run",
    "end_cell",
    "hide_runs",
    "hint",
    "host_summary",
    "hosts",
    "ingest",
    "knob_status",
    "latest",
    "memory",
    "names",
    "on_applied",
    "on_plan",
    "on_rank_info",
    "on_spec",
    "on_stop_plan",
    "per_step",
    "progress",
    "ranks",
    "refusal",
    "request_knobs",
    "rows",
    "run_alarms",
    "run_curves",
    "series",
    "set_watch",
    "take_lines",
    "thinned",
    "throughput",
    "wait_for",
]
FIELDS = [
    "alarms",
    "arrivals",
    "cell_no",
    "cluster_info",
    "cluster_no",
    "drift_checks",
    "keep_arrivals",
    "knob_events",
    "knob_spec",
    "last_request",
    "lost_messages",
    "lost_rows",
    "marks",
    "messages",
    "points",
    "rank_info",
    "run_id",
    "runs",
    "stop_events",
    "version",
    "watch_settings",
]


def test_the_public_surface_is_whole():
    st = MetricsStore()
    missing = [m for m in METHODS if not callable(getattr(st, m, None))]
    missing += [f for f in FIELDS if not hasattr(st, f)]
    assert not missing, f"MetricsStore lost {missing}"
    assert (st.points, st.run_id, st.runs, st.alarms, st.knob_spec) == (0, 0, [], [], {})


def test_the_store_composes_and_inherits_nothing():
    bases = [c for c in inspect.getmro(MetricsStore)[1:] if c.__module__.startswith("hvdnb")]
    assert bases == []


def test_settable_fields_reach_their_owner():
    """``knob_spec``, ``keep_arrivals`` and ``_channel`` (tests' and benches' fake channel)
    are set through the facade on the part that owns them, and the parts see them."""
    st = MetricsStore()
    st.knob_spec = {"lr": {"kind": "float", "min": 0.0, "max": 1.0, "value": 0.1}}
    assert st.refusal({"lr": 2.0}) is not None and st.refusal({"lr": 0.5}) is None

    class Ch:
        ranks = [0, 1]

        def __init__(self) -> None:
            self.sent: list[tuple[int, object]] = []

        def send(self, rank: int, kind: object, **payload: object) -> None:
            self.sent.append((rank, kind))

    st._channel = Ch()
    ok, _ = st.request_knobs(lr=0.5)
    assert ok and len(st._channel.sent) == 1
    st.on_plan({"id": st.last_request, "apply_at": 3, "values": {"lr": 0.5}})
    assert [r for r, _ in st._channel.sent[1:]] == [0, 1]  # forwarded to every rank
    st.keep_arrivals = True
    st.begin_cell(1)
    st.ingest({"rank": 0, "seq": 1, "pid": 1, "cols": {"loss": [[0], [5.0], [1.0]]}})
    assert len(st.arrivals) == 1 and st.run_id == 1 and st.points == 1
