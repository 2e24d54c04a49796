"""Recorder (ring, flush messages, step attribution), knobs validation and protocol, and the
store fed by simulated ranks: no processes."""

from __future__ import annotations

import math
from array import array

import pytest

from hvdnb.notebook.metrics.store import MetricsStore
from hvdnb.protocol import kinds
from hvdnb.protocol.kinds import outgoing
from hvdnb.protocol.wire import decode, encode
from hvdnb.rank.metrics import knobs as kn
from hvdnb.rank.metrics.recorder import Recorder

KEY = b"k" * 32


class FakeChannel:
    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.sent: list[dict] = []
        self.handlers: dict[str, list] = {}

    @property
    def queued(self) -> int:  # EngineChannel's count of messages queued, in send order
        return len(self.sent)

    def send(self, kind: str, **payload) -> None:
        # through the real wire: what the notebook receives, columns as plain lists
        frames = encode(KEY, {**outgoing(kind, payload), "rank": self.rank})
        msg = decode(KEY, frames)
        assert msg is not None, "the channel refused a recorder's message"
        for col in msg.get("cols", {}).values():
            col[:] = [list(c) for c in col]
        self.sent.append(msg)

    def on(self, kind: str, fn) -> None:
        self.handlers.setdefault(kind, []).append(fn)


def test_cell_end_message_comes_after_every_other_message_of_the_cell():
    """The notebook ends a cell once each rank's last metrics message is in: a knob set
    (or any message) sent after the last metrics message must be followed by one more,
    or ``%dist knobs`` right after the cell can still see the previous knob set."""
    from hvdnb.rank.metrics import recorder as recmod

    ch = FakeChannel(rank=0)
    rec = Recorder(0, ch, flush_interval=10, capacity=1024)
    old, recmod._RECORDER = recmod._RECORDER, rec
    try:
        for step in range(5):
            rec.log(step, 1.0)
        rec.flush()
        rec.cell_running = False  # the loop is over: an idle recorder sends no empty message
        assert recmod.flush_for_cell_end() == (rec.pid, 1)
        assert len(ch.sent) == 1
        ch.send(kinds.KNOBS_SPEC, spec={"lr": {"kind": "float", "value": 0.1}})
        mark = recmod.flush_for_cell_end()
        assert [m["kind"] for m in ch.sent] == ["metrics", "knobs_spec", "metrics"]
        assert mark == (rec.pid, ch.sent[-1]["seq"]) == (rec.pid, 2)
    finally:
        recmod._RECORDER = old
        rec.close()


def test_time_spent_off_does_not_count_toward_the_next_message(monkeypatch):
    """set_enabled(False) stops the message clock and set_enabled(True) goes on where it
    stopped: a loop that switches recording off for longer than an interval sends no
    message on its first step back (it has logged nothing new), and sends one once it has
    logged for the rest of the interval. On the test's own clock (1 ms steps)."""
    import hvdnb.rank.metrics.core as coremod
    import hvdnb.rank.metrics.drain as drainmod
    from hvdnb.rank.metrics import recorder as recmod

    clock = [100.0]
    monkeypatch.setattr(coremod, "_perf_counter", lambda: clock[0])
    monkeypatch.setattr(drainmod, "_perf_counter", lambda: clock[0])
    monkeypatch.setattr(coremod.time, "perf_counter", lambda: clock[0])
    ch = FakeChannel(rank=0)
    rec = Recorder(0, ch, flush_interval=0.3, capacity=1024, warm=0.0)
    rec.flush_interval_steady = 0.3
    rec.flusher.start = lambda: None  # only the loop sends (no timer thread)
    old, recmod._RECORDER = recmod._RECORDER, rec
    try:
        step = 0
        while len(ch.sent) < 2 and step < 10_000:  # the clock runs
            rec.log(step, 1.0)
            step += 1
            clock[0] += 0.001
        assert len(ch.sent) == 2
        left = rec._due - clock[0]  # just after a message: ~a whole interval
        recmod.set_enabled(False)
        assert 0.15 < left <= 0.3
        clock[0] += 0.5  # longer than the interval
        recmod.set_enabled(True)
        assert rec._due - clock[0] == pytest.approx(left, abs=1e-9)
        rec.log(step, 1.0)
        assert len(ch.sent) == 2, "a message went out for time spent off"
        # past the rest of the interval (and its slack, in which a loop waits for the step
        # that every rank sends on): the next step sends
        clock[0] = max(clock[0], rec.flusher.due_late) + 0.05
        rec.log(step + 1, 1.0)
        assert len(ch.sent) == 3
    finally:
        recmod._RECORDER = old
        rec.close()


def test_log_and_flush_carry_every_point_in_order():
    ch = FakeChannel(rank=1)
    rec = Recorder(1, ch, flush_interval=10, capacity=1024)
    for step in range(10):
        rec.log(step, 1.0 / (step + 1), samples=32, data_time=0.001)
        rec.on_comm("DistributedOptimizer.bucket.0", 4096, 0.002, "gloo", 0.0005)
    rec.flush()
    (msg,) = ch.sent
    assert msg["kind"] == "metrics" and msg["seq"] == 1 and msg["lost"] == 0
    cols = msg["cols"]
    assert cols["loss"][0] == list(range(10))
    assert cols["samples"][2] == [32.0] * 10
    assert cols["time/data"][0] == list(range(10))
    # an allreduce reported after log(step=s) belongs to step s + 1 (the step in progress)
    assert cols["comm/bucket.0/time"][0] == list(range(1, 11))
    assert cols["comm/bucket.0/time"][2] == [0.002] * 10
    assert cols["comm/bucket.0/exposed"][2] == [0.0005] * 10
    assert "mem/rss" in cols and cols["mem/rss"][2][0] > 0
    assert msg["backend"] == "gloo"


def test_a_loop_faster_than_the_interval_loses_no_point():
    """Backpressure: with a channel, log sends before the ring laps (the interval is an
    hour here, so only the queue's bound sends): 40 steps into a 16-row ring."""
    ch = FakeChannel()
    rec = Recorder(0, ch, flush_interval=3600, capacity=16)
    for step in range(40):
        rec.log(step, 0.5)
    rec.flush()
    assert len(ch.sent) > 2  # sent while the loop ran, not only by the flush
    losses = [s for m in ch.sent for s in m["cols"].get("loss", [[]])[0]]
    steps = [s for m in ch.sent for s in m["cols"].get("time/step", [[]])[0]]
    assert losses == list(range(40)) and steps == list(range(1, 40))
    assert all(m["lost"] == 0 for m in ch.sent)


def test_ring_overflow_without_a_channel_is_counted_not_hidden():
    """Nothing takes the ring of a process without a channel: it keeps the latest rows and
    counts the rest."""
    rec = Recorder(0, None, capacity=16)
    for step in range(40):
        rec.log(step, 0.5)
    rec._try_drain()
    cols = rec.ring.take()
    assert len(cols["loss"][0]) + len(cols["time/step"][0]) == 16
    assert rec.ring.lost == 40 + 39 - 16


def test_log_without_a_channel_is_cheap_and_silent():
    rec = Recorder(0, None, capacity=64)
    for step in range(200):
        rec.log(step, 0.1)
    rec.flush()  # no channel: nothing to do, no error
    assert rec.flusher.thread is None


def test_tensor_like_values_are_read_at_flush():
    class T:
        def item(self) -> float:
            return 2.5

    ch = FakeChannel()
    rec = Recorder(0, ch, capacity=64)
    rec.log(0, T())
    rec.flush()
    assert ch.sent[-1]["cols"]["loss"][2] == [2.5]


def test_knob_validation():
    spec = kn.make_spec({"batch_size": 64, "warmup_steps": 100, "lr": 0.1})
    assert kn.validate(spec, {"lr": 0.05}) is None
    assert "out of range" in kn.validate(spec, {"lr": -1.0})
    assert "whole number" in kn.validate(spec, {"batch_size": 3.5})
    assert "unknown knob" in kn.validate(spec, {"momentum": 0.9})
    assert "finite" in kn.validate(spec, {"lr": math.inf})
    assert "bool" in kn.validate(spec, {"warmup_steps": True})
    assert kn.validate(spec, {"batch_size": 128.0}) is None
    with pytest.raises(TypeError):
        kn.make_spec({"name": "x"})


def test_knob_plan_applies_on_the_planned_step_and_reports_late():
    ch0, ch1 = FakeChannel(0), FakeChannel(1)
    k0 = kn.Knobs({"warmup_steps": 10}, None, 0, ch0)
    k1 = kn.Knobs({"warmup_steps": 10}, None, 1, ch1)
    plan = {"id": "k1", "apply_at": 5, "values": {"warmup_steps": 42}}
    k0.on_plan(plan)
    k1.on_plan(plan)
    for step in range(5):
        k0._advance(step)
    assert k0.warmup_steps == 10
    k0._advance(5)
    assert k0.warmup_steps == 42 and k0.history == [(5, {"warmup_steps": 42}, False)]
    k1._advance(7)  # heard too late: applied at once, reported
    assert k1.history == [(7, {"warmup_steps": 42}, True)]
    assert ch1.sent[-1]["late"] is True and ch1.sent[-1]["step"] == 7
    bad = {"id": "k2", "apply_at": 8, "values": {"warmup_steps": -3}}
    k0.on_plan(bad)
    k0._advance(8)  # refused on the rank, reported, training goes on
    assert k0.warmup_steps == 42 and "out of range" in ch0.sent[-1]["error"]


def _msg(rank: int, seq: int, steps: range, pid: int = 7) -> dict:
    t = [1000.0 + s for s in steps]
    return {
        "kind": "metrics",
        "rank": rank,
        "seq": seq,
        "pid": pid,
        "lost": 0,
        "step": steps[-1] + 1,
        "backend": "nccl",
        "idle": False,
        "cols": {
            "loss": [list(steps), t, [1.0 / (s + 1) for s in steps]],
            "time/step": [list(steps), t, [0.01 + 0.002 * rank] * len(steps)],
            "comm/bucket.0/time": [list(steps), t, [0.002] * len(steps)],
            "comm/bucket.0/exposed": [list(steps), t, [0.0015] * len(steps)],
            "comm/bucket.0/bytes": [list(steps), t, [4e6] * len(steps)],
            "mem/gpu_allocated": [[steps[-1]], [t[-1]], [2e9]],
        },
    }


def test_store_with_simulated_ranks_loses_nothing_and_detects_gaps():
    st = MetricsStore()
    for seq in range(1, 21):
        for rank in range(8):
            st.ingest(_msg(rank, seq, range((seq - 1) * 5, seq * 5)))
    assert st.lost_messages == 0
    rows = st.rows("loss")
    assert len(rows) == 8 * 100
    assert [r.step for r in rows if r.rank == 3] == list(range(100))
    st.ingest(_msg(0, 23, range(110, 115)))  # seq 21, 22 never arrived
    assert st.lost_messages == 2
    st.ingest(_msg(0, 1, range(5), pid=8))  # a restarted rank starts over: no gap
    assert st.lost_messages == 2


def test_store_takes_wire_arrays_and_lists_alike_and_drops_bad_columns():
    st = MetricsStore()
    wire = decode(
        KEY,
        encode(
            KEY,
            {
                "kind": "metrics",
                "rank": 0,
                "seq": 1,
                "cols": {"loss": [[0, 1, 2], [10.0, 10.5, 11.0], [1.0, 0.5, 0.25]]},
            },
        ),
    )
    assert type(wire["cols"]["loss"][2]) is array
    st.ingest(wire)
    st.ingest(
        {
            "rank": 1,
            "seq": 1,
            "cols": {
                "loss": [[0, 1.0, 2], [10.0, 10.5, 11.0], [1.0, None, 0.25]],  # None: NaN
                "half": [[0.5], [1.0], [1.0]],  # not a whole step
                "ragged": [[0, 1], [1.0], [1.0, 2.0]],
                "text": [[0], [1.0], ["x"]],
            },
        }
    )
    assert st.series("loss", 0) == ([0, 1, 2], [1.0, 0.5, 0.25], [10.0, 10.5, 11.0])
    steps, vals, _ = st.series("loss", 1)
    assert steps == [0, 1, 2] and vals[0] == 1.0 and math.isnan(vals[1])
    assert type(steps) is list and type(vals) is list  # views are plain lists
    assert st.names() == ["loss"] and st.points == 6


def test_store_views_breakdown_hint_comm_memory(tmp_path):
    st = MetricsStore()
    for rank in range(4):
        st.ingest(_msg(rank, 1, range(60)))
    b = st.breakdown()
    # the breakdown's comm is the exposed time, not the collective's own duration
    assert b[3]["step"] == pytest.approx(0.016) and b[0]["comm"] == pytest.approx(0.0015)
    hint = st.hint()
    assert hint.startswith("bottleneck: compute") and "straggler: rank 3" in hint
    comm = st.comm_summary()[0]
    # bus bandwidth as nccl-tests: 4 MB x 2 (4 - 1) / 4 / 2 ms
    assert comm["bus_bandwidth"] == pytest.approx(3e9) and comm["backend"] == "nccl"
    assert comm["time"] == pytest.approx(0.002) and comm["exposed"] == pytest.approx(0.0015)
    mem = st.memory()[0]
    assert mem["gpu_allocated"] == 2e9 and mem["rss"] is None  # unknown stays unknown
    rows = st.rows()
    assert st.rows("loss").to_csv(tmp_path / "m.csv").read_text().startswith("rank,step,name")
    lines = rows.to_jsonl(tmp_path / "m.jsonl").read_text().splitlines()
    assert len(lines) == len(rows)


def test_store_forwards_rank0_plan_to_every_rank(recording_channel):
    st = MetricsStore()
    st._channel = recording_channel([0, 1, 2])
    st.begin_cell(1)
    st.on_spec({"spec": kn.make_spec({"lr": 0.1})})
    ok, _ = st.request_knobs(lr=0.2)
    assert ok and st._channel.sent[-1][:2] == (0, kinds.KNOBS_REQ)
    rid = st._channel.sent[-1][2]["id"]
    st.on_plan({"rank": 0, "id": rid, "apply_at": 40, "values": {"lr": 0.2}})
    assert [(r, k) for r, k, _ in st._channel.sent[1:]] == [
        (0, kinds.KNOBS_PLAN),
        (1, kinds.KNOBS_PLAN),
        (2, kinds.KNOBS_PLAN),
    ]
    for r in range(3):
        st.on_applied({"rank": r, "id": rid, "step": 40, "late": False, "values": {"lr": 0.2}})
    status = st.knob_status()
    assert sorted(status["applied"]) == [0, 1, 2] and st.marks == [(40, "lr=0.2")]
    ok, msg = st.request_knobs(lr=50.0)
    assert not ok and "out of range" in msg and len(st._channel.sent) == 4


def _log_msg(rank: int, seq: int, steps: range, loss: float, samples: float = 32.0) -> dict:
    t = [2000.0 + s for s in steps]
    return {
        "kind": "metrics",
        "rank": rank,
        "seq": seq,
        "pid": 9,
        "lost": 0,
        "step": steps[-1] + 1,
        "idle": False,
        "cols": {
            "loss": [list(steps), t, [loss + rank] * len(steps)],
            "samples": [list(steps), t, [samples] * len(steps)],
        },
    }


def test_runs_segments_and_knobs_in_rows():
    st = MetricsStore()
    st.on_spec({"spec": kn.make_spec({"batch_size": 32, "warmup_steps": 10})})
    # between cells: memory heartbeats start no run
    st.begin_cell(1)
    st.ingest({"rank": 0, "seq": 1, "pid": 9, "cols": {"mem/rss": [[0], [1.0], [5e8]]}})
    assert st.runs == [] and st.run_id == 0
    st.ingest(_log_msg(0, 2, range(10), 1.0))
    st.ingest(_log_msg(1, 1, range(10), 1.0))
    for r in (0, 1):  # a change applied on both ranks at step 6 starts segment 1
        st.on_applied(
            {"rank": r, "id": "k1", "step": 6, "late": False, "values": {"batch_size": 64}}
        )
    st.end_cell()
    st.begin_cell(2)  # a second logging cell is run 2, starting from the values in force
    st.ingest(_log_msg(0, 3, range(5), 3.0))
    st.end_cell()
    st.begin_cell(3)  # a cell that logs nothing starts no run
    st.ingest({"rank": 0, "seq": 4, "pid": 9, "cols": {"mem/rss": [[0], [1.0], [5e8]]}})
    st.end_cell()
    assert [r["id"] for r in st.runs] == [1, 2] and st.run_id == 2
    rows = [r for r in st.rows("loss") if r.rank == 0]
    first = [r for r in rows if r.run == 1]
    assert [r.segment for r in first] == [0] * 6 + [1] * 4
    assert first[0].knobs == {"batch_size": 32, "warmup_steps": 10}
    assert first[-1].knobs == {"batch_size": 64, "warmup_steps": 10}
    second = [r for r in rows if r.run == 2]
    assert len(second) == 5 and second[0].knobs["batch_size"] == 64 and second[0].segment == 0
    # live views show the current run only; run=-1 every run
    assert st.series("loss", 0)[0] == list(range(5))
    assert len(st.series("loss", 0, run=-1)[0]) == 15
    assert st.marks == [] and st.runs[0]["marks"] == [(6, "batch_size=64")]
    df = st.rows().to_pandas()
    assert set(df.run) == {0, 1, 2} and set(df[df.name == "loss"].run) == {1, 2}
    assert "knob.batch_size" in df.columns
    assert set(df[df.run == 1]["knob.batch_size"]) == {32, 64}


def test_run_curves_overlay_by_step_and_samples_and_hide():
    st = MetricsStore()
    st.on_spec({"spec": kn.make_spec({"batch_size": 32})})
    for cell, loss in ((1, 2.0), (2, 4.0)):
        st.begin_cell(cell)
        st.ingest(_log_msg(0, 2 * cell - 1, range(4), loss, samples=32))
        st.ingest(_log_msg(1, cell, range(4), loss, samples=32))
        if cell == 2:
            for r in (0, 1):
                st.on_applied({"rank": r, "id": "k", "step": 2, "values": {"batch_size": 64}})
        st.end_cell()
    curves = st.run_curves()
    assert [c["id"] for c in curves] == [1, 2]
    assert curves[0]["ys"] == [2.5] * 4  # mean of rank 0 (2.0) and rank 1 (3.0)
    assert curves[1]["label"] == "run 2: batch_size=32 -> batch_size=64 @ 2"
    assert curves[1]["marks"] == [(2.0, "batch_size=64")]
    by_samples = st.run_curves(x="samples")
    assert by_samples[0]["xs"] == [64.0, 128.0, 192.0, 256.0]  # two ranks x 32 per step
    assert st.hide_runs(keep_last=1) == 1 and [c["id"] for c in st.run_curves()] == [2]
    assert len({r.run for r in st.rows("loss")}) == 2  # hidden, not deleted


def test_run_curves_built_up_between_redraws_equal_curves_built_at_once():
    """The panel redraws while points arrive: summing only the new points each time must
    give the same curves, marks and throughput as a store that got everything at once."""
    live, whole = MetricsStore(), MetricsStore()
    for st in (live, whole):
        st.on_spec({"spec": kn.make_spec({"batch_size": 32})})
        st.begin_cell(1)
    msgs = []
    for k in range(6):  # rank 1 lags one message behind rank 0, as on a real cluster
        steps = range(10 * k, 10 * k + 10)
        msgs.append(_log_msg(0, k + 1, steps, 1.0 + k, samples=32))
        if k:
            msgs.append(_log_msg(1, k, range(10 * k - 10, 10 * k), 0.5, samples=16))
    for i, m in enumerate(msgs):
        live.ingest(m)
        if i == 5:
            for r in (0, 1):
                live.on_applied({"rank": r, "id": "k", "step": 23, "values": {"batch_size": 64}})
        live.run_curves(), live.run_curves(x="samples")  # a redraw between messages
    for i, m in enumerate(msgs):
        whole.ingest(m)
        if i == 5:
            for r in (0, 1):
                whole.on_applied({"rank": r, "id": "k", "step": 23, "values": {"batch_size": 64}})
    for x in ("step", "samples"):
        assert live.run_curves(x=x) == whole.run_curves(x=x)
    c = whole.run_curves()[0]
    # _log_msg adds the rank to the loss: rank 1 logs 1.5; rank 0 logs 1 + k in message k
    assert c["ys"][:50] == [(1.0 + k + 1.5) / 2 for k in range(5) for _ in range(10)]
    assert c["ys"][50:] == [6.0] * 10 and c["marks"] == [(23.0, "batch_size=64")]
    assert live.throughput() == whole.throughput()


def test_thinned_views_are_the_full_views_sampled_and_read_only_the_tail():
    """What the live charts draw (``points=`` / ``thinned`` / ``last=``) equals the full
    view sampled at ``thin_indices``, also when a rank's first message for some steps
    comes after later steps (the run curve stays in step order)."""
    from hvdnb.notebook.metrics.points import thin_indices

    st = MetricsStore()
    st.on_spec({"spec": kn.make_spec({"batch_size": 32})})
    st.begin_cell(1)
    st.ingest(_log_msg(0, 1, range(500), 1.0))
    st.ingest(_log_msg(1, 1, range(500, 900), 2.0))  # rank 1 reports later steps first
    st.ingest(_log_msg(1, 2, range(500), 2.0))
    st.ingest(_log_msg(0, 2, range(500, 900), 1.0))
    st.on_applied({"rank": 0, "id": "k", "step": 633, "values": {"batch_size": 64}})
    full, thin = st.run_curves()[0], st.run_curves(points=50)[0]
    assert full["xs"] == [float(x) for x in range(900)] and full["ys"] == [2.0] * 900
    idx, _ = thin_indices(900, 50)
    assert thin["xs"] == [full["xs"][i] for i in idx] and thin["ys"] == [full["ys"][i] for i in idx]
    assert thin["marks"] == full["marks"] == [(633.0, "batch_size=64")]
    steps, vals, _ = st.series("loss", 1)
    xs, ys, stride = st.thinned("loss", 1, 50)
    assert xs == [float(steps[i]) for i in idx] and ys == [vals[i] for i in idx]
    assert stride == 18
    assert st.thinned("loss", 1, 5000)[:2] == ([float(x) for x in steps], vals)
    assert st.count("loss", 1) == 900
    assert st.series("loss", 1, last=3) == tuple(c[-3:] for c in st.series("loss", 1))


# ---------------------------------------------------------------- packing and in-loop sends
def _rows_of(msgs: list[dict]) -> dict[str, list[tuple]]:
    out: dict[str, list[tuple]] = {}
    for m in msgs:
        for name, (steps, times, vals) in m["cols"].items():
            if not name.startswith("mem/"):
                out.setdefault(name, []).extend(zip(steps, times, vals))
    return out


def test_irregular_rows_wrapping_the_ring_pack_like_row_by_row():
    """The strided fast path (same names every step) and the general path (a metric every
    third step, a phase now and then) give every row, in order, across the ring's end."""
    import random

    ch = FakeChannel()
    rec = Recorder(0, ch, flush_interval=1e9, capacity=256)  # ~1800 rows: wraps 7 times
    rng = random.Random(1)
    for step in range(300):
        rec.on_comm("DistributedOptimizer.bucket.0", 100, 0.001 * step, "mpi", 0.0)
        extra = {"acc": step / 7} if step % 3 == 0 else {}
        rec.log(step, 1.0 / (step + 1), samples=8, **extra)
        if rng.random() < 0.2:
            rec.record(step, "time/data", 0.5)
        if rng.random() < 0.3:  # flushes at irregular points, some of them mid-pattern
            rec.flush()
    rec.flush()
    got = _rows_of(ch.sent)
    assert ch.sent[-1]["lost"] == 0
    assert [s for s, _, _ in got["loss"]] == list(range(300))
    assert [v for _, _, v in got["loss"]] == [1.0 / (s + 1) for s in range(300)]
    assert [s for s, _, _ in got["acc"]] == list(range(0, 300, 3))
    assert [v for _, _, v in got["samples"]] == [8.0] * 300
    assert all(type(v) is float for _, _, v in got["samples"])
    assert [v for _, _, v in got["comm/bucket.0/time"]] == [0.001 * s for s in range(300)]
    assert [s for s, _, _ in got["time/step"]] == list(range(1, 300))
    for name, rows in got.items():  # times never go back within a name
        ts = [t for _, t, _ in rows]
        assert ts == sorted(ts), name


def test_pack_fast_path_and_general_path_agree():
    from hvdnb.rank.metrics.ring import _columns

    names = ["a", "b", "c"]
    nids = array("i", [0, 1, 2] * 5 + [0, 1])  # a flush in the middle of a step
    steps = array("q", range(len(nids)))
    times = array("d", steps)
    vals = array("d", [s * 0.5 for s in steps])
    fast = _columns(steps, times, nids, vals, names)
    broken = nids[:-1] + array("i", [0])  # breaks the pattern
    slow = _columns(steps, times, broken, vals, names)
    assert list(fast["a"][0]) == [0, 3, 6, 9, 12, 15]
    assert list(fast["b"][0]) == [1, 4, 7, 10, 13, 16]
    assert list(slow["a"][0]) == [0, 3, 6, 9, 12, 15, 16] and "b" in slow
    assert list(fast["c"][2]) == [1.0, 2.5, 4.0, 5.5, 7.0]
    for name in names:  # both paths give typed columns, in row order
        for got in (fast, slow):
            assert [c.typecode for c in got[name]] == ["q", "d", "d"]


def test_values_are_floats_and_none_is_no_value():
    class Span:  # what NCCL timings look like: only .item()
        def item(self) -> float:
            return 0.25

    ch = FakeChannel()
    rec = Recorder(0, ch, flush_interval=1e9, capacity=64)
    rec.log(0, 1, samples=True, span=Span(), none=None)
    rec.flush()
    cols = ch.sent[-1]["cols"]
    assert cols["loss"][2] == [1.0] and type(cols["loss"][2][0]) is float
    assert cols["samples"][2] == [1.0]
    assert cols["span"][2] == [0.25]
    assert "none" not in cols  # None: no value this step, not a NaN


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"loss": "low"}, "loss must be a number, not str"),
        ({"loss": {"a": 1}}, "loss must be a number, not dict"),
        ({"loss": [0.5]}, "loss must be a number, not list"),
        ({"loss": 10**400}, "too large for a float"),
        ({"acc": "x"}, "acc must be a number, not str"),
        ({"total_steps": "many"}, "total_steps must be a whole number of steps, or None"),
    ],
)
def test_a_value_that_is_no_number_is_refused_and_loses_nothing(kwargs, words):
    ch = FakeChannel()
    rec = Recorder(0, ch, flush_interval=1e9, capacity=64)
    rec.log(0, 0.5)
    with pytest.raises((TypeError, ValueError), match=words):
        rec.log(1, **kwargs)
    rec.log(2, 0.25)
    rec.flush()
    assert list(ch.sent[-1]["cols"]["loss"][2]) == [0.5, 0.25]


@pytest.mark.parametrize("step", ["5", 5.5, None, [1], True])
def test_a_step_that_is_no_whole_number_is_refused(step):
    rec = Recorder(0, None, capacity=64)
    with pytest.raises((TypeError, ValueError), match="step must be a whole number"):
        rec.log(step, 0.5)


def test_cpu_tensor_loss_is_read_in_log_and_not_kept():
    torch = pytest.importorskip("torch")
    import weakref

    ch = FakeChannel()
    rec = Recorder(0, ch, flush_interval=1e9, capacity=64)
    x = torch.ones(3, requires_grad=True)
    loss = (x * 2).sum()
    acc = (x * 3).mean()
    ref, ref_acc = weakref.ref(loss), weakref.ref(acc)
    rec.log(0, loss, acc=acc)
    del loss, acc
    # the queue holds floats, not the tensors and their graphs (nor a value that an
    # in-place change before the next flush would alter)
    assert ref() is None and ref_acc() is None
    rec.flush()
    assert ch.sent[-1]["cols"]["loss"][2] == [6.0]
    assert ch.sent[-1]["cols"]["acc"][2] == [3.0]


def test_object_values_are_read_at_pack_then_released_and_lapped_ones_dropped():
    import gc
    import weakref

    class Span:  # a value that must not be read in the step (an NCCL timing, a CUDA loss)
        def __init__(self, v: float) -> None:
            self.v = v

        def item(self) -> float:
            return self.v

    ch = FakeChannel()
    rec = Recorder(0, ch, flush_interval=1e9, capacity=16)
    spans = [Span(0.5 + s) for s in range(3)]
    refs = [weakref.ref(sp) for sp in spans]
    for s, sp in enumerate(spans):
        rec.log(s, sp)
    del spans, sp
    assert all(r() is not None for r in refs)  # kept until the next pack reads them
    rec.flush()
    assert ch.sent[-1]["cols"]["loss"][2] == [0.5, 1.5, 2.5]
    gc.collect()
    assert all(r() is None for r in refs)  # and not a moment longer
    # more rows than the ring holds between two messages: sent in several (backpressure),
    # each object read into its own row and released, none lost
    lapped = [Span(10.0 + s) for s in range(12)]
    lrefs = [weakref.ref(sp) for sp in lapped]
    before = len(ch.sent)
    for s, sp in enumerate(lapped):
        rec.log(100 + s, sp, other=1.0)  # 2-3 rows a step: 16 rows hold 6-8 steps
    del lapped, sp
    rec.flush()
    msgs = ch.sent[before:]
    got = {}
    for m in msgs:
        got.update(
            zip(m["cols"].get("loss", [[], [], []])[0], m["cols"].get("loss", [[], [], []])[2])
        )
    assert len(msgs) > 1 and all(m["lost"] == 0 for m in msgs)
    assert got == {100 + s: 10.0 + s for s in range(12)}
    gc.collect()
    assert all(r() is None for r in lrefs)
    # a pack that cleared the flag just before this object was stored still reads it
    rec.log(200, Span(7.0))
    rec.ring.has_objects = False  # what a pack racing the store leaves behind
    rec.flush()
    assert ch.sent[-1]["cols"]["loss"][2] == [7.0]


def test_log_sends_from_the_loop_once_per_interval_without_the_flusher_thread(monkeypatch):
    """0.5 s of 1 ms steps on the test's own clock, the flusher thread never started: the
    loop's own ``log`` sends, about once per 50 ms interval, never once per step."""
    import threading

    import hvdnb.rank.metrics.core as coremod
    import hvdnb.rank.metrics.drain as drainmod

    clock = [100.0]
    monkeypatch.setattr(coremod, "_perf_counter", lambda: clock[0])
    monkeypatch.setattr(drainmod, "_perf_counter", lambda: clock[0])
    monkeypatch.setattr(coremod.time, "perf_counter", lambda: clock[0])
    ch = FakeChannel()
    rec = Recorder(0, ch, flush_interval=0.05, capacity=1024)
    rec.flusher.start = lambda: None
    sender = set()
    send = ch.send

    def spy(kind, **payload):
        sender.add(threading.get_ident())
        send(kind, **payload)

    ch.send = spy
    for step in range(500):
        rec.log(step, 0.5)
        clock[0] += 0.001
    step += 1
    rec.close()
    seqs = [m["seq"] for m in ch.sent]
    assert seqs == list(range(1, len(seqs) + 1))
    assert 5 <= len(ch.sent) <= 12, len(ch.sent)  # ~one per 50 ms, not one per step
    assert sender == {threading.get_ident()}
    got = _rows_of(ch.sent)
    assert [s for s, _, _ in got["loss"]] == list(range(step))


def test_slow_steps_rows_between_logs_still_go_out():
    """A loop that stopped logging (a long step): the flusher thread sends what was
    recorded since (a phase, an allreduce) within a few intervals."""
    import time as _time

    ch = FakeChannel()
    rec = Recorder(0, ch, flush_interval=0.05, capacity=1024)
    for step in range(3):
        rec.log(step, 0.5)
        _time.sleep(0.06)
    rec.log(3, 0.5)  # sends from the loop
    rec.on_comm("allreduce.x", 8, 0.001, "mpi", 0.0)
    deadline = _time.monotonic() + 2
    while _time.monotonic() < deadline and "comm/allreduce.x/time" not in _rows_of(ch.sent):
        _time.sleep(0.01)
    rec.close()
    assert "comm/allreduce.x/time" in _rows_of(ch.sent)


def test_objects_are_read_by_the_flusher_thread_not_in_log():
    import threading
    import time as _time

    readers = []

    class CudaLike:
        def item(self) -> float:
            readers.append(threading.get_ident())
            return 1.5

    ch = FakeChannel()
    rec = Recorder(0, ch, flush_interval=0.03, capacity=1024)
    t0 = _time.perf_counter()
    step = 0
    while _time.perf_counter() - t0 < 0.3:
        rec.log(step, CudaLike())
        step += 1
        _time.sleep(0.002)
    deadline = _time.monotonic() + 2
    while _time.monotonic() < deadline and len(_rows_of(ch.sent).get("loss", [])) < step:
        _time.sleep(0.01)
    assert readers and threading.get_ident() not in readers
    rec.close()
    assert [v for _, _, v in _rows_of(ch.sent)["loss"]] == [1.5] * step


def test_log_and_comm_from_another_thread_go_through_the_side_queue():
    import threading

    ch = FakeChannel()
    rec = Recorder(0, ch, flush_interval=1e9, capacity=64)

    def train() -> None:
        for step in range(5):
            rec.on_comm("DistributedOptimizer.bucket.0", 10, 0.5, "gloo", 0.25)
            rec.log(step, 2.0, samples=4, data_time=0.1, total_steps=5)

    th = threading.Thread(target=train)
    th.start()
    th.join()
    assert rec.ring.w == 0  # nothing went into the ring from that thread
    rec.flush()
    got = _rows_of(ch.sent)
    assert [s for s, _, _ in got["loss"]] == list(range(5))
    assert [v for _, _, v in got["time/data"]] == [0.1] * 5
    assert [s for s, _, _ in got["comm/bucket.0/exposed"]] == [0, 1, 2, 3, 4]
    assert [s for s, _, _ in got["time/step"]] == [1, 2, 3, 4]
    assert ch.sent[-1]["meta"]["total_steps"] == 5 and ch.sent[-1]["step"] == 5


def test_set_enabled_off_stops_logging_and_the_collective_timing():
    """Off means the loop runs as without the panel: no rows, and hvdnb.torch's listener
    list empty again (its collectives then skip the clock reads and take the fast path)."""
    from hvdnb.rank.metrics import recorder as R
    from hvdnb.torch import listeners as L

    rec = R.get_recorder()
    try:
        R.set_enabled(True)
        assert rec.on_comm in L.LISTENERS
        R.set_enabled(False)
        assert rec.on_comm not in L.LISTENERS
        w = rec.ring.w
        R.log(0, 1.0, samples=4)
        rec.on_comm("x", 4, 0.001, "mpi")
        assert rec.ring.w == w
        R.set_enabled(True)
        assert L.LISTENERS.count(rec.on_comm) == 1
        R.log(0, 1.0)
        assert rec.ring.w > w
    finally:
        R.set_enabled(True)


def test_flush_interval_stretches_once_a_loop_has_run_and_resets_after_a_pause(monkeypatch):
    """Quick messages for the first ``warm`` seconds of a loop, ``steady_interval`` after:
    the panel comes alive at once, then each rank sends fewer (costly) messages."""
    # on a clock of the test's own (1 ms steps), messages from log() only: the gaps are the
    # schedule's, never the machine's load
    import hvdnb.rank.metrics.core as coremod
    import hvdnb.rank.metrics.drain as drainmod

    clock = [100.0]
    monkeypatch.setattr(coremod, "_perf_counter", lambda: clock[0])
    monkeypatch.setattr(drainmod, "_perf_counter", lambda: clock[0])
    monkeypatch.setattr(coremod.time, "perf_counter", lambda: clock[0])
    ch = FakeChannel()
    rec = Recorder(0, ch, flush_interval=0.04, steady_interval=0.2, warm=0.3, capacity=4096)
    rec.flusher.start = lambda: None
    sent_at: list[float] = []
    send = ch.send

    def spy(kind, **payload):
        sent_at.append(clock[0])
        send(kind, **payload)

    ch.send = spy

    def loop(seconds: float) -> float:
        start = clock[0]
        step = 0
        while clock[0] - start < seconds:
            rec.log(step, 0.5)
            step += 1
            clock[0] += 0.001
        return start

    def gaps(a: float, b: float) -> list[float]:
        ts = [t for t in sent_at if a <= t < b]
        return [y - x for x, y in zip(ts, ts[1:])]

    t0 = loop(1.2)
    early, late = gaps(t0, t0 + 0.3), gaps(t0 + 0.45, t0 + 1.2)
    assert early and max(early) < 0.1, early  # every 40 ms while warming up
    assert late and min(late) > 0.15, late  # every 200 ms once steady
    clock[0] += 1.3  # the loop pauses longer than IDLE_AFTER: a new loop warms up again
    t1 = loop(0.3)
    again = gaps(t1, t1 + 0.3)
    assert again and max(again) < 0.1, again
    rec.close()
    seqs = [m["seq"] for m in ch.sent]
    assert seqs == list(range(1, len(seqs) + 1))


def test_queue_stays_bounded_without_log_or_channel():
    """Phases and allreduces recorded in a loop that never calls log(), with no cluster:
    the training thread's queue is written into the ring (which laps and counts) instead
    of growing without end."""
    rec = Recorder(0, None, capacity=64)
    for step in range(1000):
        rec.record(step, "time/data", 0.001)
        rec.on_comm("allreduce.x", 16, 0.0001, "mpi", 0.0001)
    assert len(rec._pend) <= rec.capacity
    queued_rows = sum(1 if e[0] == 2 else 3 for e in rec._pend)  # a record: 1, a comm: 3
    assert rec.ring.w + queued_rows == 4000  # every row is in the ring or still queued


def test_log_never_waits_for_a_pack_in_progress():
    """A pack on the flusher thread holds the lock while it reads a CUDA value, which can
    wait for the device: log(), due to send, must not wait for it (the pack drains the
    queue itself)."""
    import threading
    import time

    ch = FakeChannel()
    rec = Recorder(0, ch, flush_interval=0.01, capacity=1024)
    rec.log(0, 1.0)  # the first log only schedules the first message
    held, release, let_go = threading.Event(), threading.Event(), threading.Event()

    def slow_pack() -> None:  # as the flusher thread's flush(): both locks, then a slow read
        with rec.flusher.send_lock, rec._lock:
            held.set()
            release.wait(10)
            let_go.set()  # still holding both locks: a log() that waited for them sees it

    th = threading.Thread(target=slow_pack)
    th.start()
    held.wait(5)
    time.sleep(0.02)  # a message is due now
    for step in range(1, 40):
        rec.log(step, 1.0, samples=4)
        rec.on_comm("allreduce.x", 16, 0.0001, "mpi", 0.0)
        rec.record(step, "time/data", 0.001)
        time.sleep(0.002)  # several messages fall due during the loop
    # every call returned while the pack still held the locks: none waited for it
    waited = let_go.is_set()
    release.set()
    th.join()
    assert not waited, "log waited for a pack held elsewhere"
    rec.flush()
    assert [s for s, _, _ in _rows_of(ch.sent)["loss"]] == list(range(40))


def test_collectives_are_timed_on_one_step_in_k_while_a_loop_logs():
    """With ``comm_interval``, the recorder's listener is registered only for the steps
    ``s`` with ``s % comm_every == 0`` (k from the step time), and again between loops."""
    rec = Recorder(0, None, flush_interval=0.01, capacity=1 << 12, comm_interval=0.008)
    listeners: list = []
    rec.comm.listeners = listeners
    rec.comm.switch(True)
    registered = []
    clock = [100.0]
    import hvdnb.rank.metrics.core as recmod
    import hvdnb.rank.metrics.drain as ringmod

    real = recmod._perf_counter
    recmod._perf_counter = ringmod._perf_counter = lambda: clock[0]
    try:
        for step in range(200):
            registered.append((rec.cur_step, rec.comm.listener in listeners))
            if rec.comm.listener in listeners:
                rec.on_comm("bucket.0", 64, 1e-4, "mpi", 5e-5)
            clock[0] += 0.001  # 1 ms steps
            rec.log(step, 0.5)
    finally:
        recmod._perf_counter = ringmod._perf_counter = real
    rec._try_drain()
    assert rec.comm_every == 8  # 8 ms / 1 ms
    late = [(s, on) for s, on in registered if s >= 50]  # once the step time is known
    assert late and all(on == (s % 8 == 0) for s, on in late)
    timed = [r for r in _rows(rec) if r[1] == "comm/bucket.0/exposed"]
    assert {s for s, _, _ in timed if s >= 50} == {s for s in range(56, 200) if s % 8 == 0}
    rec.new_loop()  # a new cell: collectives outside a logging loop are all timed
    assert rec.comm.listener in listeners and rec.comm_every == 1
    # comm_interval 0 (the default of a bare Recorder): every step
    rec0 = Recorder(0, None, capacity=1 << 10)
    rec0.comm.listeners = []
    rec0.comm.switch(True)
    for step in range(20):
        rec0.log(step, 0.5)
        assert rec0.comm.listener in rec0.comm.listeners


def test_collectives_are_sampled_sparser_once_a_loop_is_past_its_first_seconds():
    """``comm_interval`` (8 ms) holds for the loop's first ``warm`` seconds, then the
    larger ``comm_interval_steady`` (50 ms): 1 ms steps are timed one in 8, then one in
    64 (the nearest power of two, so that ranks agree); a new loop starts dense again."""
    rec = Recorder(
        0,
        None,
        flush_interval=0.01,
        capacity=1 << 14,
        warm=2.0,
        comm_interval=0.008,
        comm_interval_steady=0.05,
    )
    listeners: list = []
    rec.comm.listeners = listeners
    rec.comm.switch(True)
    clock = [100.0]
    import hvdnb.rank.metrics.core as recmod
    import hvdnb.rank.metrics.drain as ringmod

    real = recmod._perf_counter
    recmod._perf_counter = ringmod._perf_counter = lambda: clock[0]
    timed: list[int] = []
    try:

        def loop(first: int, steps: int) -> None:
            for step in range(first, first + steps):
                if rec.comm.listener in listeners:
                    timed.append(step)
                    rec.on_comm("bucket.0", 64, 1e-4, "mpi", 5e-5)
                clock[0] += 0.001  # 1 ms steps
                rec.log(step, 0.5)

        loop(0, 4000)  # 4 s: 2 s dense, then sparse
        rec._try_drain()
        assert rec.comm_every == 64
        dense = [s for s in timed if 100 <= s < 1900]
        sparse = [s for s in timed if 2200 <= s < 4000]
        assert all(s % 8 == 0 for s in dense) and len(dense) == len(range(104, 1900, 8))
        assert all(s % 64 == 0 for s in sparse) and len(sparse) == len(range(2240, 4000, 64))
        rec.new_loop()  # the next cell's loop: its first seconds are dense again
        clock[0] += 5.0
        timed.clear()
        loop(0, 600)
        rec._try_drain()
        assert rec.comm_every == 8
        assert [s for s in timed if s >= 100] == list(range(104, 600, 8))
    finally:
        recmod._perf_counter = ringmod._perf_counter = real


def _rows(rec: Recorder) -> list[tuple[int, str, float]]:
    n = rec.ring.w
    return [
        (rec.ring.steps[i], rec.ring.name_list[rec.ring.names[i]], rec.ring.vals[i])
        for i in range(max(0, n - rec.capacity), n)
    ]


def test_breakdown_pairs_each_timed_step_with_its_own_step_time():
    """Collectives timed on one step in 4: the breakdown's rows are those steps, each with
    its own step time and data phase (a timed step that took longer is not compared with
    the untimed ones)."""
    st = MetricsStore()
    steps = list(range(200))
    t = [1000.0 + 0.001 * s for s in steps]
    timed = [s for s in steps if s % 4 == 0]
    st.ingest(
        {
            "rank": 0,
            "seq": 1,
            "cols": {
                "time/step": [steps, t, [0.003 if s % 4 == 0 else 0.001 for s in steps]],
                "time/data": [steps, t, [0.0005] * len(steps)],
                "comm/bucket.0/exposed": [
                    timed,
                    [1000.0 + 0.001 * s for s in timed],
                    [0.002] * len(timed),
                ],
            },
        }
    )
    b = st.breakdown()[0]
    assert b["step"] == pytest.approx(0.003) and b["comm"] == pytest.approx(0.002)
    assert b["data"] == pytest.approx(0.0005) and b["compute"] == pytest.approx(0.0005)
    # the same data with no collective timed: every step, comm 0
    st2 = MetricsStore()
    st2.ingest(
        {
            "rank": 0,
            "seq": 1,
            "cols": {
                "time/step": [steps, t, [0.001] * len(steps)],
                "time/data": [steps, t, [0.0005] * len(steps)],
            },
        }
    )
    b2 = st2.breakdown()[0]
    assert b2["comm"] == 0.0 and b2["compute"] == pytest.approx(0.0005)


def _feed(rec: Recorder, clock: list[float], drain_every: int) -> None:
    """One script of training-thread calls: a loop that logs loss, samples and
    total_steps, a timed collective on one step in 5 and a phase on one in 7, a step that
    repeats, a value read at pack (an object), a pause that starts a new loop, steps
    without a loss, a keyword on one step in 100, and keywords that change; drained every
    ``drain_every`` steps."""

    class Span:
        def item(self) -> float:
            return 0.25

    step = 0
    for k in range(900):
        clock[0] += 0.0013 + 1e-5 * (k % 3)
        if k == 400:
            clock[0] += 1.5  # a pause longer than IDLE_AFTER: a loop starts again
        if k == 300:
            step -= 1  # a step logged twice
        if k < 500 and k % 100 == 50:
            rec.log(step, 1.0 / (1 + k), samples=64, total_steps=900, acc=0.5)  # one more
        elif k < 500:
            rec.log(step, 1.0 / (1 + k), samples=64, total_steps=900)
        elif k < 600:
            rec.log(step, samples=True)  # no loss; a bool
        elif k < 700:
            rec.log(step, 0.5, samples=64, data_time=0.0002)  # a keyword more
        elif k == 750:
            rec.log(step, Span(), samples=64, data_time=0.0002)  # read at pack
        else:
            rec.log(step, 0.5, samples=64, data_time=0.0002)
        if k % 5 == 0:
            rec.on_comm("DistributedOptimizer.bucket.0", 4096, 0.002, "mpi", 0.0005)
        if k % 7 == 0:
            rec.record(step, "time/data", 0.0003, t=1.0 + k)
        step += 1
        if k % drain_every == drain_every - 1:
            rec._try_drain()
    rec._try_drain()


@pytest.mark.parametrize("drain_every", [1, 37, 250, 1000])
def test_a_drain_in_one_go_writes_what_one_entry_at_a_time_writes(monkeypatch, drain_every):
    """The drain writes a run of alike log entries with numpy (``Drain._run``): the rows,
    the step-time estimate, the loop start, the sampling grid and what the message
    carries are those of writing them one by one."""
    import hvdnb.rank.metrics.core as recmod
    import hvdnb.rank.metrics.drain as ringmod

    got = []
    runs: list[bool] = []
    real_run = ringmod.Drain._run

    def spy(self, *a):
        r = real_run(self, *a)
        runs.append(r is not None)
        return r

    monkeypatch.setattr(ringmod.Drain, "_run", spy)
    run_min0 = ringmod._RUN_MIN
    for run_min in (run_min0, 10**9):  # numpy, then one by one
        monkeypatch.setattr(ringmod, "_RUN_MIN", run_min)
        clock = [100.0]
        monkeypatch.setattr(recmod, "_perf_counter", lambda: clock[0])
        monkeypatch.setattr(ringmod, "_perf_counter", lambda: clock[0])
        monkeypatch.setattr(recmod.time, "time", lambda: clock[0] + 1e9)
        rec = Recorder(0, None, flush_interval=0.25, capacity=1 << 12, comm_interval=0.008)
        _feed(rec, clock, drain_every)
        msg = rec.pack()
        got.append((rec, _rows(rec), msg["cols"]))
    (fast, fast_rows, fast_cols), (slow, slow_rows, slow_cols) = got
    # the numpy path wrote most of them (not the first log of a drain, nor a drain
    # holding a pause or the object)
    assert (sum(runs) >= 3) if drain_every > run_min0 else not any(runs)
    assert len(fast_rows) == len(slow_rows) > 3000
    for (s1, n1, v1), (s2, n2, v2) in zip(fast_rows, slow_rows):
        assert (s1, n1) == (s2, n2) and v1 == pytest.approx(v2, rel=1e-12, nan_ok=True)
    for name in ("time/step", "loss", "samples", "acc", "time/data", "comm/bucket.0/time"):
        assert list(fast_cols[name][0]) == list(slow_cols[name][0]), name
        assert list(fast_cols[name][1]) == pytest.approx(list(slow_cols[name][1]), abs=1e-6)
    assert list(fast_cols["loss"][2]) == pytest.approx(list(slow_cols["loss"][2]), nan_ok=True)
    assert 0.25 in list(fast_cols["loss"][2])  # the object, read at pack
    assert fast.step_time == pytest.approx(slow.step_time, rel=1e-9)
    assert (fast.clock.loop_t0, fast.clock.prev_step, fast.clock.last_log) == (
        slow.clock.loop_t0,
        slow.clock.prev_step,
        slow.clock.last_log,
    )
    assert fast.meta == slow.meta == {"total_steps": 900}
    assert (fast.comm_every, fast.flusher.grid) == (slow.comm_every, slow.flusher.grid)


def test_ranks_in_lockstep_send_their_messages_on_the_same_step(monkeypatch):
    """Two ranks in lockstep reach a message's due time one or two steps apart; each
    message stalls the rank that packs it, and its peer waits at the next allreduce, so
    messages on different steps stall the pair twice. Sends are put on a grid of steps
    (a power of two, ~1/16 of an interval): both ranks send on the same step."""
    import hvdnb.rank.metrics.core as recmod
    import hvdnb.rank.metrics.drain as ringmod

    clock = [0.0]
    monkeypatch.setattr(recmod, "_perf_counter", lambda: clock[0])
    monkeypatch.setattr(ringmod, "_perf_counter", lambda: clock[0])
    monkeypatch.setattr(recmod.time, "perf_counter", lambda: clock[0])
    sent: dict[int, list[int]] = {0: [], 1: []}
    recs = []
    for r in (0, 1):

        class Ch:
            def send(self, kind: str, r: int = r, **payload) -> None:
                sent[r].append(payload["step"])

        rec = Recorder(
            r, Ch(), flush_interval=0.25, steady_interval=1.0, warm=2.0, capacity=1 << 16
        )
        rec.flusher.start = lambda: None  # messages from log() only, as in a busy loop
        recs.append(rec)
    base = 100.0
    for step in range(8000):  # 1.4 ms steps; rank 1 a little behind, by a varying amount
        base += 0.0014
        for r, rec in enumerate(recs):
            clock[0] = base + r * (0.0002 + 0.0012 * ((step // 500) % 2))
            rec.log(step, 0.5)
    assert len(sent[0]) >= 15  # 4 a second, then 1 a second, over ~11 s
    assert sent[0] == sent[1]
    steps = sent[0][1:]
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    assert all(100 <= g <= 1000 for g in gaps), gaps  # ~0.25 s, then ~1 s of steps


def test_columns_grouped_with_numpy_equal_columns_grouped_row_by_row(monkeypatch):
    import hvdnb.rank.metrics.ring as ringmod
    from hvdnb.rank.metrics.ring import _columns

    names = ["time/step", "loss", "samples", "comm/b/time", "comm/b/exposed", "comm/b/bytes"]
    ids: list[int] = []
    for s in range(400):  # a loop's rows and, on one step in 9, a collective's
        ids += [0, 1, 2] + ([3, 4, 5] if s % 9 == 0 else [])
    nids = array("i", ids)
    steps = array("q", range(len(ids)))
    times = array("d", [0.5 * s for s in steps])
    vals = array("d", [s * 0.25 for s in steps])
    fast = _columns(steps, times, nids, vals, names)
    monkeypatch.setattr(ringmod, "_GROUP_NP", 10**9)
    slow = _columns(steps, times, nids, vals, names)
    assert list(fast) == list(slow) == names  # in the order names first appear
    for name in names:
        assert [c.typecode for c in fast[name]] == ["q", "d", "d"]
        assert [list(c) for c in fast[name]] == [list(c) for c in slow[name]]


def test_a_plan_heard_between_log_events_applies_at_its_step():
    """``log`` looks at the knobs only on some steps (``_events``); a plan heard between
    them (the I/O thread calls ``on_plan``) makes the next ``log`` look, and the change is
    in force from its planned step on."""
    from hvdnb.rank.metrics import recorder as R

    rec = R.get_recorder()
    saved, old = rec.comm.listeners, kn.CURRENT
    try:
        R.set_enabled(True)
        rec.comm.switch(False)
        rec.comm.listeners = None  # no sampled collectives: no step-driven events at all
        rec.new_loop()
        k = kn.knobs(warmup_steps=10)
        seen = {}
        for step in range(100):
            seen[step] = k.warmup_steps
            if step == 40:
                k.on_plan({"id": "between-events", "apply_at": 60, "values": {"warmup_steps": 7}})
            R.log(step, 0.5)
        assert seen[59] == 10 and seen[60] == 7 and seen[99] == 7
        assert k.history == [(60, {"warmup_steps": 7}, False)]
    finally:
        kn.CURRENT = old
        rec.comm.listeners = saved
        R.set_enabled(True)


def test_gpu_utilisation_is_na_without_nvml_and_shown_beside_memory():
    """Without NVML (the [gpu] extra is not installed here, and no driver answers) the
    sampler reports no utilisation, never a fake 0, and the panel shows n/a; with readings
    the memory table shows them as percent beside the GPU memory."""
    from hvdnb.notebook.panel.tables import memory_table
    from hvdnb.rank.metrics.memory import MemorySampler

    m = MemorySampler()
    assert m._nvml_handle(0) is None and m.gpu_utilization(None) is None
    assert "mem/gpu_util_pct" not in m.sample()
    st = MetricsStore()
    cols = {
        "mem/gpu_allocated": [[1, 1], [1.0, 1.0], [2e9, 2e9]],
        "mem/gpu_reserved": [[1, 1], [1.0, 1.0], [3e9, 3e9]],
    }
    st.ingest({"rank": 0, "seq": 1, "cols": {**cols, "mem/gpu_util_pct": [[1], [1.0], [87.0]]}})
    st.ingest({"rank": 1, "seq": 1, "cols": cols})  # a rank without NVML
    html = memory_table(st)
    assert "GPU util" in html and "mem bw util" in html
    assert "<td>87 %</td>" in html
    row1 = html.split("<tr><td>1</td>")[1].split("</tr>")[0]
    assert row1.count("n/a") == 4  # nvml used, both utilisations, rss


def test_memory_after_a_restart_is_the_new_clusters_or_na():
    """A restart keeps the rank numbers: rank 0's RSS from the previous cluster is not
    shown as the new rank 0's (the parameter servers of notebook 09 showed it); its first
    reading after the new start is."""

    class Channel:
        ranks = (0, 1)

        def on(self, kind, fn) -> None:
            pass

    class Cluster:
        def __init__(self, started_at: float) -> None:
            self.channel, self.n, self.backend, self.device = Channel(), 2, "gloo", "cpu"
            self.hosts_seen = {0: "h", 1: "h"}
            self.started_at, self.start_seconds = started_at, 4.0

    def rss(rank: int, t: float, value: float) -> dict:
        return {"rank": rank, "seq": 1, "pid": 7, "cols": {"mem/rss": [[0], [t], [value]]}}

    st = MetricsStore()
    st.attach(Cluster(started_at=1000.0))
    st.ingest(rss(0, 1001.0, 5e8))
    assert st.memory()[0]["rss"] == 5e8
    st.attach(Cluster(started_at=2000.0))  # a restart: a new channel, the same rank numbers
    assert st.memory() == {0: dict.fromkeys(st.memory()[0]), 1: dict.fromkeys(st.memory()[1])}
    assert st.memory()[0]["rss"] is None  # n/a, not the earlier cluster's 500 MB
    st.ingest(rss(0, 1997.0, 7e8))  # taken during the new start (which began at 1996)
    assert st.memory()[0]["rss"] == 7e8
