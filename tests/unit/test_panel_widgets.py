"""The panel with a recording dummy comm: batched updates, throttling, knob controls."""

from __future__ import annotations

import pytest

from hvdnb.protocol import kinds

pytest.importorskip("ipywidgets")


def _ticks(svg: str, axis: str) -> list[str]:
    """The tick labels of one axis ("x" or "y") of an SVG line chart."""
    import re

    group = re.search(rf"<g class='hvdnb-ticks-{axis}'[^>]*>(.*?)</g>", svg)
    assert group, svg[:400]
    return re.findall(r">([^<]*)</text>", group.group(1))


def _is_125(values: list[float]) -> bool:
    """Evenly spaced by 1, 2 or 5 x 10^k, each a multiple of the step."""
    import math

    if len(values) < 2:
        return False
    step = values[1] - values[0]
    mant = step / 10 ** math.floor(math.log10(step))
    return (
        any(math.isclose(mant, m) for m in (1, 2, 5))
        and all(math.isclose(b - a, step) for a, b in zip(values, values[1:]))
        and all(abs(v / step - round(v / step)) < 1e-6 for v in values)
    )


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


def test_knob_controls_send_to_rank0_and_refuse_bad_values(sent, recording_channel):
    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel import Panel
    from hvdnb.rank.metrics import knobs as kn

    st = MetricsStore()
    st._channel = recording_channel([0, 1])
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


def test_ranks_in_the_set_box_refuses_on_a_fixed_size_cluster_and_sends_no_knob(
    sent, recording_channel
):
    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel import Panel
    from hvdnb.rank.metrics import knobs as kn

    st = MetricsStore()
    st._channel = recording_channel([0, 1])
    st.on_spec({"spec": kn.make_spec({"lr": 0.1})})
    p = Panel(st)
    p._idle.stop()
    p.knob_text.value = "ranks=3"  # no cluster attached: nothing to scale
    assert "refused: ranks=N changes an elastic cluster's size" in p.controls.note
    assert st._channel.sent == []  # "ranks" never goes to rank 0 as a knob


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
    labels = [float(v) for v in _ticks(svg, "y")]
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
    assert max(float(v) for v in _ticks(plain, "y")) == 300  # round ticks up to 319.2
    # a mild outlier (under twice the cap) keeps the full axis
    mild = [0.13] * 57 + [0.6, 0.7, 0.75]
    assert "above the axis" not in line_chart("a", [("c", xs, mild)], clip_spikes=True)
    # few points: nothing is clipped (too little to tell a spike from a trend)
    assert "above the axis" not in line_chart("a", [("c", xs[:10], ys[:10])], clip_spikes=True)


def test_saved_picture_is_never_drawn_on_a_cells_path(sent):
    """A cell's end draws the live view only if the store changed and never the PNG; the
    idle timer draws a stale PNG in the background (once per change) and swaps it into the
    display handles; %dist stop draws a stale one at once."""
    import time

    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel import Panel

    st = MetricsStore()
    p = Panel(st)
    p._idle.stop()
    shown: list[bytes] = []

    class Handle:
        def update(self, obj):
            shown.append(p.png)

    p._handles = [(Handle(), object())]
    _feed(st, 1)
    renders = p.renders
    p.tick(final=True)  # a cell with new points ends
    assert p.renders == renders + 1 and p.snapshots == 0 and not shown
    p.tick(final=True)  # a no-op cell ends: nothing is drawn at all
    assert p.renders == renders + 1 and p.snapshots == 0
    p._idle_tick()  # the kernel is idle: the PNG is drawn on a thread ...
    p._png_thread.join(10)
    assert p.snapshots == 1 and not shown
    p._idle_tick()  # ... and shown from the event loop
    assert len(shown) == 1 and shown[0].startswith(b"\x89PNG")
    p._last_snapshot = 0.0
    p._idle_tick()  # nothing changed: no second draw
    assert p._png_thread is None or not p._png_thread.is_alive()
    assert p.snapshots == 1
    _feed(st, 2)
    p._last_snapshot = time.monotonic()  # changed, but drawn less than 2 s ago: later
    p._idle_tick()
    assert p.snapshots == 1
    p.snapshot(if_stale=True)  # %dist stop: a stale picture is drawn at once
    assert p.snapshots == 2 and len(shown) == 2
    p.snapshot(if_stale=True)
    assert p.snapshots == 2


def test_a_picture_put_in_between_cells_is_put_in_again_at_the_end(sent):
    """The idle timer draws the start cell's picture and puts it in between cells, where a
    headless run reads no message; ``%dist stop`` (and ``hvdnb run``'s last cell) put it
    in again from their cell, without drawing it again."""
    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel import Panel

    st = MetricsStore()
    p = Panel(st)
    p._idle.stop()
    shown: list[bytes] = []

    class Handle:
        def update(self, obj):
            shown.append(p.png)

    p._handles = [(Handle(), object())]
    _feed(st, 1)
    p._idle_tick()  # between cells: drawn on a thread ...
    p._png_thread.join(10)
    p._idle_tick()  # ... and put in (a message nbclient never reads)
    assert p.snapshots == 1 and len(shown) == 1
    p.snapshot(if_stale=True)  # %dist stop: nothing changed since
    assert p.snapshots == 1, "drawn again"
    assert len(shown) == 2 and shown[-1] == shown[0] and shown[0].startswith(b"\x89PNG")


def test_ticks_are_round_and_labelled_for_their_range():
    """Ticks are 1, 2 or 5 x 10^k apart on both axes (decades on a log axis), never
    lo + (hi - lo) * i / 4 (0.1246, 0.6756, ...; 0, 102, 205, ...), and their labels fit
    the range: 0.05 apart, two decimals; 20,000, "20k"; 2e-4 without a row of zeros."""
    import math

    from hvdnb.notebook.panel.charts import nice_ticks
    from hvdnb.notebook.panel.svg import line_chart

    xs = [float(s) for s in range(411)]
    ys = [0.1246 + 2.2054 * math.exp(-s / 60) for s in range(411)]
    svg = line_chart("loss", [("rank 0", xs, ys)])
    assert _ticks(svg, "y") == ["0.5", "1.0", "1.5", "2.0"]
    assert _ticks(svg, "x") == ["0", "100", "200", "300", "400"]
    assert _is_125([float(v) for v in _ticks(svg, "y")])

    def labels(lo, hi, **kw):
        return [lab for _, lab in nice_ticks(lo, hi, **kw)]

    assert labels(0.12, 0.31) == ["0.15", "0.20", "0.25", "0.30"]
    assert labels(0, 20000, integer=True) == ["0", "5k", "10k", "15k", "20k"]
    assert labels(0, 4000, integer=True) == ["0", "1,000", "2,000", "3,000", "4,000"]
    assert labels(0, 3, integer=True) == ["0", "1", "2", "3"]  # steps: never 0.5 apart
    assert labels(1e-4, 2.6e-4) == ["1.0e-4", "1.5e-4", "2.0e-4", "2.5e-4"]
    assert labels(2e-4, 6e-4) == ["0.0002", "0.0003", "0.0004", "0.0005", "0.0006"]
    assert labels(0.2, 1.5) == ["0.2", "0.4", "0.6", "0.8", "1.0", "1.2", "1.4"]
    # log y: decades over 3 or more of them, 1-2-5 values over fewer, round values within one
    lg = math.log10
    assert labels(lg(0.004), lg(3.0), log=True) == ["0.01", "0.1", "1"]
    assert labels(lg(0.05), lg(2.3), log=True) == ["0.05", "0.1", "0.2", "0.5", "1", "2"]
    assert labels(lg(0.3), lg(0.9), log=True) == ["0.4", "0.6", "0.8"]
    assert labels(-9, 3, log=True) == ["1e-9", "1e-6", "0.001", "1", "1,000"]
    pos = [p for p, _ in nice_ticks(lg(0.004), lg(3.0), log=True)]
    assert pos == [-2.0, -1.0, 0.0]  # positions in log10 units, as the axis limits are
    logsvg = line_chart("loss", [("r", xs, [v / 50 for v in ys])], log_y=True)
    assert _ticks(logsvg, "y") == ["0.005", "0.01", "0.02"]


def test_hover_reads_each_ranks_value_at_the_step_under_the_pointer():
    """Every line chart carries its hover: transparent columns (in a g.hvdnb-hover), each with
    a <title> (the browser's tooltip) and a readout the chart's CSS shows on :hover, with
    the step and each rank's value there (min / median / max over a band)."""
    import re

    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel.charts import HOVER_COLUMNS, readouts
    from hvdnb.notebook.panel.svg import charts_html

    st = MetricsStore()
    for rank in range(2):
        steps = list(range(241))  # 0..240: 40 columns of 6 steps (all drawn: no thinning)
        st.ingest(
            {
                "rank": rank,
                "seq": 1,
                "pid": 1,
                "step": 241,
                "cols": {"loss": [steps, [1.0] * 241, [rank + s / 1000 for s in steps]]},
            }
        )
    loss = charts_html(st, runs_x=None).split("</svg>")[0]
    assert ".hvdnb-hover>g:hover .readout{visibility:visible}" in loss
    hover = loss.split("<g class='hvdnb-hover'>")[1]
    groups = re.findall(r"<g>(<rect.*?)</g></g>", hover, re.S)
    assert len(groups) == HOVER_COLUMNS  # each column reads its own step
    by_step = {}
    for g in groups:
        title = re.search(r"<title>(.*?)</title>", g, re.S).group(1).split("\n")
        readout = re.findall(r">([^<]+)</text>", g.split("<g class='readout'>")[1])
        assert readout == title, (readout, title)  # the same text, both ways
        by_step[int(title[0].split()[1])] = title[1:]
    assert by_step[123] == ["rank 0 0.123", "rank 1 1.123"]
    # the columns tile the plot, and each reads the step at its middle
    assert sorted(by_step) == list(range(3, 240, 6))
    xs = [int(x) for x in re.findall(r"<g><rect x='(\d+)'", hover)]
    assert xs[0] == 52 and all(9 <= b - a <= 11 for a, b in zip(xs, xs[1:]))
    # the readout names its lines in their colours
    g123 = next(g for g in groups if "<title>step 123" in g)
    assert "fill='#4c78a8'>rank 0 0.123<" in g123 and "fill='#f58518'>rank 1 1.123<" in g123
    # a line without a point near the step has no row (rank 1 stops at step 100)
    reads = readouts(
        [("rank 0", [0.0, 100.0, 200.0], [1.0, 2.0, 3.0]), ("rank 1", [0.0, 100.0], [5.0, 6.0])],
        None,
        0.0,
        200.0,
        columns=3,
    )
    assert [(r.x, [(lab, v) for lab, v, _ in r.rows]) for r in reads] == [
        (0.0, [("rank 0", 1.0), ("rank 1", 5.0)]),
        (100.0, [("rank 0", 2.0), ("rank 1", 6.0)]),
        (200.0, [("rank 0", 3.0)]),
    ]
    # 64 ranks: a band; the readout says its max, median and min at a whole step
    st64 = MetricsStore()
    _feed(st64, 1, nranks=64)
    band = charts_html(st64, runs_x=None).split("</svg>")[0]
    title = re.search(r"<title>(step \d+\n[^<]*)</title>", band).group(1).split("\n")
    assert [t.split()[0] for t in title[1:4]] == ["max", "median", "min"], title


def test_window_shows_the_last_steps_of_the_loss_and_allreduce_charts(sent, monkeypatch):
    """The steps window (all / last 100 / 1,000 / 10,000) cuts the loss and allreduce
    charts to the run's last N steps, in the live SVG and the saved PNG alike; its comm is
    routed to the control subshell like the other view controls; a change redraws."""
    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel import Panel
    from hvdnb.notebook.panel import kernel as _kernel
    from hvdnb.notebook.panel.charts import allreduce_chart, loss_chart
    from hvdnb.notebook.panel.png import render_png

    routed: list = []
    monkeypatch.setattr(_kernel, "control_subshell", lambda: "sub-1")
    monkeypatch.setattr(_kernel, "route_comms", lambda ws, sid: routed.extend(ws) or len(ws))
    st = MetricsStore()
    for seq in range(1, 101):  # 2,000 steps, the allreduce timed every 5th
        for rank in range(2):
            steps = list(range((seq - 1) * 20, seq * 20))
            t = [1000.0 + s for s in steps]
            st.ingest(
                {
                    "rank": rank,
                    "seq": seq,
                    "pid": 1,
                    "step": steps[-1] + 1,
                    "cols": {
                        "loss": [steps, t, [3.0 if s < 10 else 0.2 for s in steps]],
                        "comm/b0/time": [steps[::5], t[::5], [2e-4] * 4],
                        "comm/b0/exposed": [steps[::5], t[::5], [1e-4] * 4],
                    },
                }
            )
    whole = loss_chart(st)
    assert whole.limits().x0 == 0 and whole.limits().y1 == 3.0
    last = loss_chart(st, window=100)
    assert [lab for lab, _, _ in last.lines] == ["rank 0", "rank 1"]
    assert min(last.lines[0][1]) == 1900 and max(last.lines[0][1]) == 1999
    assert last.limits().y1 < 1.0 < whole.limits().y1  # the first steps no longer flatten it
    big = loss_chart(st, window=1000, points=300)  # thinned to ~300 points of the window
    assert 1000 <= min(big.lines[0][1]) <= 1004 and len(big.lines[0][1]) <= 302
    comm = allreduce_chart(st, window=100)
    assert comm.lines and all(min(xs) > 1899 for _, xs, _ in comm.lines)

    p = Panel(st, render_interval=0.0)
    p._idle.stop()
    assert p.window in routed and p.log_y in routed  # to the subshell, as the others
    assert p.window.options[0] == ("steps: all", 0) and 100 in dict(p.window.options).values()
    p.render(force=True)
    loss_svg = p.view.value.split("</svg>")[0]
    assert _ticks(loss_svg, "x")[0] == "0"
    renders = p.renders
    p.window.value = 100  # what picking "last 100 steps" does
    p._last_render, p.settle = 0.0, 0.0
    p.tick()  # the next tick redraws, though the store did not change
    assert p.renders == renders + 1
    loss_svg = p.view.value.split("</svg>")[0]
    assert "last 100 steps" in loss_svg
    assert [int(v.replace(",", "")) for v in _ticks(loss_svg, "x")] == [
        1900,
        1920,
        1940,
        1960,
        1980,
    ]
    assert "last 100 steps" in p.view.value.split("</svg>")[1]  # the allreduce chart too
    png = render_png(st, window=100)
    assert png.startswith(b"\x89PNG") and png != render_png(st)
