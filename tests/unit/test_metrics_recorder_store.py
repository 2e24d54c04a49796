"""Recorder (ring, flush messages, step attribution), knobs validation and protocol, and the
store fed by simulated ranks: no processes."""

from __future__ import annotations

import math

import pytest

from hvdnb.metrics import knobset as kn
from hvdnb.metrics.recorder import Recorder
from hvdnb.metrics.store import MetricsStore


class FakeChannel:
    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.sent: list[dict] = []
        self.handlers: dict[str, list] = {}

    def send(self, kind: str, **payload) -> None:
        self.sent.append({"kind": kind, "rank": self.rank, **payload})

    def on(self, kind: str, fn) -> None:
        self.handlers.setdefault(kind, []).append(fn)


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


def test_ring_overflow_is_counted_not_hidden():
    ch = FakeChannel()
    rec = Recorder(0, ch, capacity=16)
    for step in range(40):
        rec.log(step, 0.5)
    rec.flush()
    msg = ch.sent[-1]
    assert len(msg["cols"]["loss"][0]) + len(msg["cols"]["time/step"][0]) == 16
    assert msg["lost"] == 40 + 39 - 16


def test_log_without_a_channel_is_cheap_and_silent():
    rec = Recorder(0, None, capacity=64)
    for step in range(200):
        rec.log(step, 0.1)
    rec.flush()  # no channel: nothing to do, no error
    assert rec._thread is None


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
    return {"kind": "metrics", "rank": rank, "seq": seq, "pid": pid, "lost": 0,
            "step": steps[-1] + 1, "backend": "nccl", "idle": False,
            "cols": {"loss": [list(steps), t, [1.0 / (s + 1) for s in steps]],
                     "time/step": [list(steps), t, [0.01 + 0.002 * rank] * len(steps)],
                     "comm/bucket.0/time": [list(steps), t, [0.002] * len(steps)],
                     "comm/bucket.0/exposed": [list(steps), t, [0.0015] * len(steps)],
                     "comm/bucket.0/bytes": [list(steps), t, [4e6] * len(steps)],
                     "mem/gpu_allocated": [[steps[-1]], [t[-1]], [2e9]]}}


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
    st.ingest(_msg(0, 1, range(0, 5), pid=8))  # a restarted rank starts over: no gap
    assert st.lost_messages == 2


def test_store_views_breakdown_hint_comm_memory(tmp_path):
    st = MetricsStore()
    for rank in range(4):
        st.ingest(_msg(rank, 1, range(0, 60)))
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


def test_store_forwards_rank0_plan_to_every_rank():
    class ClientCh:
        ranks = [0, 1, 2]

        def __init__(self) -> None:
            self.sent: list[tuple] = []

        def send(self, rank, kind, **p) -> None:
            self.sent.append((rank, kind, p))

    st = MetricsStore()
    st._channel = ClientCh()
    st.begin_cell(1)
    st.on_spec({"spec": kn.make_spec({"lr": 0.1})})
    ok, _ = st.request_knobs(lr=0.2)
    assert ok and st._channel.sent[-1][:2] == (0, "knobs_req")
    rid = st._channel.sent[-1][2]["id"]
    st.on_plan({"rank": 0, "id": rid, "apply_at": 40, "values": {"lr": 0.2}})
    assert [(r, k) for r, k, _ in st._channel.sent[1:]] == [(0, "knobs_plan"), (1, "knobs_plan"),
                                                             (2, "knobs_plan")]
    for r in range(3):
        st.on_applied({"rank": r, "id": rid, "step": 40, "late": False, "values": {"lr": 0.2}})
    status = st.knob_status()
    assert sorted(status["applied"]) == [0, 1, 2] and st.marks == [(40, "lr=0.2")]
    ok, msg = st.request_knobs(lr=50.0)
    assert not ok and "out of range" in msg and len(st._channel.sent) == 4


def _log_msg(rank: int, seq: int, steps: range, loss: float, samples: float = 32.0) -> dict:
    t = [2000.0 + s for s in steps]
    return {"kind": "metrics", "rank": rank, "seq": seq, "pid": 9, "lost": 0,
            "step": steps[-1] + 1, "idle": False,
            "cols": {"loss": [list(steps), t, [loss + rank] * len(steps)],
                     "samples": [list(steps), t, [samples] * len(steps)]}}


def test_runs_segments_and_knobs_in_rows():
    st = MetricsStore()
    st.on_spec({"spec": kn.make_spec({"batch_size": 32, "warmup_steps": 10})})
    # between cells: memory heartbeats start no run
    st.begin_cell(1)
    st.ingest({"rank": 0, "seq": 1, "pid": 9, "cols": {"mem/rss": [[0], [1.0], [5e8]]}})
    assert st.runs == [] and st.run_id == 0
    st.ingest(_log_msg(0, 2, range(0, 10), 1.0))
    st.ingest(_log_msg(1, 1, range(0, 10), 1.0))
    for r in (0, 1):  # a change applied on both ranks at step 6 starts segment 1
        st.on_applied({"rank": r, "id": "k1", "step": 6, "late": False,
                       "values": {"batch_size": 64}})
    st.end_cell()
    st.begin_cell(2)  # a second logging cell is run 2, starting from the values in force
    st.ingest(_log_msg(0, 3, range(0, 5), 3.0))
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
        st.ingest(_log_msg(0, 2 * cell - 1, range(0, 4), loss, samples=32))
        st.ingest(_log_msg(1, cell, range(0, 4), loss, samples=32))
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
