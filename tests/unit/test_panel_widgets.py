"""The panel with a recording dummy comm: batched updates, throttling, knob controls."""

from __future__ import annotations

import pytest

from hvdnb.protocol import kinds

pytest.importorskip("ipywidgets")


@pytest.fixture
def sent(monkeypatch):
    import comm

    log: list[tuple[str, str | None]] = []

    class Recording(comm.DummyComm):
        def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
            log.append((msg_type, (data or {}).get("method")))

    monkeypatch.setattr(comm, "create_comm", lambda *a, **k: Recording(*a, **k))
    return log


def _feed(store, seq: int, nranks: int = 2, per: int = 10) -> None:
    for rank in range(nranks):
        steps = list(range((seq - 1) * per, seq * per))
        t = [1000.0 + s for s in steps]
        store.ingest(
            {
                "rank": rank,
                "seq": seq,
                "pid": 1,
                "step": steps[-1] + 1,
                "backend": "gloo",
                "idle": False,
                "cols": {
                    "loss": [steps, t, [1.0 / (s + 1) for s in steps]],
                    "time/step": [steps, t, [0.01] * per],
                    "mem/rss": [[steps[-1]], [t[-1]], [3e8]],
                },
            }
        )


def test_updates_are_batched_and_throttled(sent):
    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel import Panel

    st = MetricsStore()
    p = Panel(st, render_interval=0.2)
    p._idle.stop()
    sent.clear()
    # 100 flushes arrive between two ticks: one redraw, one message for the view
    for seq in range(1, 101):
        _feed(st, seq)
    p._last_render = 0.0
    p.tick()
    updates = [m for m in sent if m == ("comm_msg", "update")]
    assert 1 <= len(updates) <= 3, sent
    # ticks inside the render interval send nothing, even with new data
    sent.clear()
    _feed(st, 101)
    for _ in range(10):
        p.tick()
    assert not sent
    # nothing new: a due tick sends nothing either
    p._last_render = 0.0
    p.tick()
    sent.clear()
    p._last_render = 0.0
    p.tick()
    assert not sent


def test_one_redraw_per_round_of_rank_messages(sent):
    import time

    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel import Panel

    st = MetricsStore()
    p = Panel(st, render_interval=0.0)
    p._idle.stop()

    def tick() -> None:  # past the render interval and the redraw-cost throttle
        p._last_render = 0.0
        p.tick()

    _feed(st, 1)
    tick()
    base = p.renders  # both ranks' first messages drawn

    def one_rank(rank: int, seq: int) -> None:
        steps = list(range(seq * 10, seq * 10 + 10))
        st.ingest(
            {
                "rank": rank,
                "seq": seq,
                "pid": 1,
                "step": steps[-1] + 1,
                "idle": False,
                "cols": {"loss": [steps, [1000.0 + s for s in steps], [0.5] * 10]},
            }
        )

    one_rank(0, 2)
    for _ in range(5):  # rank 1's message of this round is still on its way: wait
        tick()
    assert p.renders == base + 0
    one_rank(1, 2)
    tick()  # the round is complete: one redraw for both messages
    assert p.renders == base + 1
    # a rank that lags holds the redraw back ``settle`` seconds, no longer
    p.settle = 0.05
    one_rank(0, 3)
    tick()
    assert p.renders == base + 1
    time.sleep(0.06)
    tick()
    assert p.renders == base + 2
    # a rank not heard from for 5 s is not waited for
    st.rank_info[1]["seen"] = time.time() - 6
    p.settle = 60
    one_rank(0, 4)
    tick()
    assert p.renders == base + 3


def test_many_ranks_draw_a_band_not_64_lines(sent):
    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel.svg import charts_html

    st = MetricsStore()
    _feed(st, 1, nranks=64)
    html = charts_html(st)
    loss_svg = html.split("</svg>")[0]
    assert "min-max band" in loss_svg and loss_svg.count("<polyline") == 1


def test_knob_controls_send_to_rank0_and_refuse_bad_values(sent):
    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel import Panel
    from hvdnb.rank.metrics import knobs as kn

    class Ch:
        ranks = [0, 1]

        def __init__(self) -> None:
            self.sent: list[tuple] = []

        def send(self, rank, kind, **p) -> None:
            self.sent.append((rank, kind, p))

    st = MetricsStore()
    st._channel = Ch()
    st.on_spec({"spec": kn.make_spec({"batch_size": 64, "warmup_steps": 100, "lr": 0.1})})
    p = Panel(st)
    p._idle.stop()
    p.render(force=True)
    assert set(p.controls.knob_widgets) == {"batch_size", "warmup_steps", "lr"}
    p.controls.knob_widgets["warmup_steps"].value = 150  # what a slider drag does
    assert st._channel.sent[-1][:2] == (0, kinds.KNOBS_REQ)
    assert st._channel.sent[-1][2]["values"] == {"warmup_steps": 150}
    p.knob_text.value = "lr=-1"
    p.render(force=True)
    assert "out of range" in p.knob_status.value and len(st._channel.sent) == 1
    p.knob_text.value = "lr=oops"
    assert "refused" in p.controls.note


def test_missing_memory_is_na_never_zero(sent):
    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel import Panel

    st = MetricsStore()
    st.ingest({"rank": 0, "seq": 1, "pid": 1, "cols": {"loss": [[0], [1.0], [0.5]]}})
    p = Panel(st)
    p._idle.stop()
    p.render(force=True)
    assert "<td>n/a</td>" in p.view.value


def test_sliders_follow_applied_values_without_sending_a_change(sent):
    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel import Panel
    from hvdnb.rank.metrics import knobs as kn

    st = MetricsStore()
    st.on_spec({"spec": kn.make_spec({"batch_size": 32, "lr": 0.1})})
    p = Panel(st, render_interval=0.0)
    p._idle.stop()
    p.render(force=True)
    requests = []
    p.controls.request = lambda values: requests.append(values)  # what a user's move would send
    # a new knob set (same names, other values) and an applied change beyond the slider
    st.on_spec({"spec": kn.make_spec({"batch_size": 1024, "lr": 0.1})})
    st.on_applied({"rank": 0, "id": "k1", "step": 5, "values": {"lr": 0.004}})
    p.render(force=True)
    assert p.controls.knob_widgets["batch_size"].value == 1024
    assert p.controls.knob_widgets["lr"].value == pytest.approx(0.004)
    assert requests == [], "showing the ranks' values must not ask them for a change"
    p.controls.knob_widgets["batch_size"].value = 64  # a user's move still sends one
    assert requests == [{"batch_size": 64}]


def test_runs_chart_overlays_runs_with_their_knobs_in_the_legend():
    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel.svg import runs_html
    from hvdnb.rank.metrics import knobs as kn

    st = MetricsStore()
    st.on_spec({"spec": kn.make_spec({"batch_size": 32})})
    for cell in (1, 2):
        st.begin_cell(cell)
        _feed(st, cell)
        st.end_cell()
    out = runs_html(st, "step")
    assert out.count("<polyline") == 2
    assert "run 1: batch_size=32" in out and "run 2: batch_size=32" in out
    assert "n/a" in runs_html(st, "samples")  # these runs logged no samples=


def test_svg_curve_coordinates_land_on_the_plot_corners_and_skip_nan():
    """The curves are written in tenths of a pixel inside a scale(0.1) group: a line from
    (0, 0) to (10, 1) through a missing point runs from the plot's bottom-left corner to
    its top-right corner, and the NaN is left out (never drawn as 0)."""
    import re

    from hvdnb.notebook.panel.svg import B, H, L, R, T, W, line_chart

    svg = line_chart("t", [("a", [0.0, 5.0, 10.0], [0.0, float("nan"), 1.0])])
    assert "<g transform='scale(0.1)'>" in svg
    pts = re.search(r"<polyline points='([^']*)'", svg).group(1).split()
    assert [int(v) for v in pts] == [10 * L, 10 * (H - B), 10 * (W - R), 10 * T]


def test_allreduce_chart_keeps_the_steady_timings_readable_under_a_first_call_spike():
    """The first allreduce of a loop (connection set-up) took 319 ms where the others took
    ~0.13 ms: with ``clip_spikes`` the axis ends at 3x the 95th percentile, the spike runs
    along the top edge, and the chart says a point is above the axis and how large it is.
    Without it (the loss chart) the axis still spans every value."""
    import re

    from hvdnb.notebook.panel.charts import SPIKE_FACTOR
    from hvdnb.notebook.panel.svg import T, line_chart

    ys = [319.2] + [0.13 + 0.01 * (i % 5) for i in range(59)]
    xs = [float(i) for i in range(60)]
    svg = line_chart("allreduce", [("c", xs, ys)], clip_spikes=True)
    labels = [float(v) for v in re.findall(r"text-anchor='end' fill='#555'>([0-9.e+-]+)<", svg)]
    p95 = sorted(ys)[int(0.95 * 59)]
    assert max(labels) <= SPIKE_FACTOR * p95 * 1.01 and max(labels) < 1.0, labels
    assert "1 point above the axis (max 319.2)" in svg
    pts = [int(v) for v in re.search(r"<polyline points='([^']*)'", svg).group(1).split()]
    assert pts[1] == 10 * T  # the spike is drawn on the top edge, not off the chart
    # the steady points spread over the plot's height instead of lying on the axis
    heights = pts[3::2]
    assert max(heights) - min(heights) > 10 * 10  # 18 px here; unclipped: 0.02 px
    plain = line_chart("loss", [("c", xs, ys)])
    assert "above the axis" not in plain
    assert (
        max(float(v) for v in re.findall(r"text-anchor='end' fill='#555'>([0-9.e+-]+)<", plain))
        == 319.2
    )
    # a mild outlier (under twice the cap) keeps the full axis
    mild = [0.13] * 57 + [0.6, 0.7, 0.75]
    assert "above the axis" not in line_chart("a", [("c", xs, mild)], clip_spikes=True)
    # few points: nothing is clipped (too little to tell a spike from a trend)
    assert "above the axis" not in line_chart("a", [("c", xs[:10], ys[:10])], clip_spikes=True)
