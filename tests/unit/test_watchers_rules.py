"""The watchers without processes: the detection rules (nan, spike, drift), their settings,
the store's alarms and lines, the stop protocol's halves, the step listener and the
fingerprints."""

from __future__ import annotations

import math
import types
from array import array

import numpy as np
import pytest

from hvdnb.notebook.metrics.store import MetricsStore
from hvdnb.notebook.metrics.watchers import (
    DriftWatch,
    NanWatch,
    SpikeWatch,
    WatchSettings,
    is_user_metric,
    parse_settings,
)
from hvdnb.protocol import kinds
from hvdnb.rank.metrics import core as coremod
from hvdnb.rank.metrics import recorder as recmod
from hvdnb.rank.metrics import stop
from hvdnb.rank.metrics.recorder import Recorder, TrainingStopped

NAN = float("nan")


# ---------------------------------------------------------------------- nan
def test_nan_watch_finds_the_first_non_finite_step_once_per_rank_and_metric():
    w = NanWatch()
    assert w.check(0, "loss", array("q", range(5)), array("d", [1, 2, 3, 4, 5])) is None
    hit = w.check(1, "loss", array("q", range(10, 15)), array("d", [1, 2, math.inf, NAN, 5]))
    assert hit == (12, math.inf)
    assert w.check(1, "loss", array("q", [20]), array("d", [NAN])) is None  # once
    s, v = w.check(1, "acc", [3, 4], [NAN, 1.0])  # another metric: its own alarm
    assert s == 3 and math.isnan(v)
    assert w.check(0, "loss", [7], [-math.inf]) == (7, -math.inf)
    assert [is_user_metric(n) for n in ("loss", "acc", "samples", "time/step", "comm/b/time")] == [
        True,
        True,
        True,
        False,
        False,
    ]
    assert not is_user_metric("mem/rss") and not is_user_metric("knob/lr")


# ---------------------------------------------------------------------- spike
def _feed(w: SpikeWatch, rank: int, values: np.ndarray, chunk: int) -> list:
    found = []
    for a in range(0, len(values), chunk):
        found += w.check(rank, np.arange(a, min(a + chunk, len(values))), values[a : a + chunk])
    return found


def _noisy(n: int, seed: int = 0) -> np.ndarray:
    return 1.0 + 0.1 * np.random.default_rng(seed).standard_normal(n)


@pytest.mark.parametrize("chunk", [1, 7, 100, 1000])
def test_a_spike_is_flagged_once_per_episode_however_the_messages_cut_the_steps(chunk):
    v = _noisy(1000)
    v[300:310] = 10.0  # one episode, 10 steps long
    v[312] = 9.0  # within spike_end of it: the same episode
    v[600] = 20.0  # a second episode
    v[800] = 2.5  # under 3x: nothing
    found = _feed(SpikeWatch(WatchSettings()), 0, v, chunk)
    assert [(s, x) for s, x, _ in found] == [(300, 10.0), (600, 20.0)]
    assert all(0.9 < med < 1.1 for _, _, med in found)


def test_spike_needs_history_and_skips_nan_and_ranks_are_separate():
    w = SpikeWatch(WatchSettings(spike_history=50))
    v = _noisy(200)
    v[10] = 50.0  # before 50 losses: not judged
    v[100] = NAN  # the nan watcher's business
    v[150] = 8.0
    assert [s for s, _, _ in _feed(w, 0, v, 64)] == [150]
    assert _feed(w, 1, _noisy(200, 1), 64) == []


def test_the_floor_keeps_a_loss_near_zero_from_crying_spike():
    # a loss falling from 2.3 to ~0.005 whose noisy batches read 0.1-0.25 (notebook 03's
    # model: 40x its median by ratio alone); a real blow-up back to 2.5 is still a spike
    rng = np.random.default_rng(3)
    v = np.concatenate([np.linspace(2.3, 0.3, 60), 0.005 + 0.002 * rng.random(940)])
    v[[300, 450, 700]] = [0.25, 0.2, 0.1]
    w = SpikeWatch(WatchSettings())
    assert _feed(w, 0, v, 100) == []
    bad = v.copy()
    bad[900] = 2.5
    found = _feed(SpikeWatch(WatchSettings()), 0, bad, 100)
    assert [s for s, _, _ in found] == [900]
    # without the floor, the noise alone is "spiky"
    assert _feed(SpikeWatch(WatchSettings(spike_floor=0.0)), 0, v, 100)


# ---------------------------------------------------------------------- drift
def _fp(n: int, step: int, sums: list[float], key: str = "k", names: bool = False) -> dict:
    e = {"key": key, "n": n, "step": step, "sums": sums, "scale": [100.0] * len(sums)}
    if names:
        e["names"] = [f"p{i}" for i in range(len(sums))]
    return e


def test_drift_names_the_first_parameter_the_ranks_and_the_range():
    w = DriftWatch(WatchSettings())
    base = [1.0, 2.0, 3.0]
    ranks = (0, 1)
    for r in ranks:  # rank 0's first fingerprint waits for rank 1's
        assert w.add(r, _fp(16, 15, base, names=True), ranks) is None
    for n in (32, 48):
        for r in ranks:
            assert w.add(r, _fp(n, n - 1, base), ranks) is None
    assert w.compared == 3 and w.last_match["k"] == (48, 47)
    assert w.add(0, _fp(64, 63, base), ranks) is None  # rank 1's not in yet
    found = w.add(1, _fp(64, 63, [1.0, 2.5, 3.5]), ranks)
    assert found["param"] == "p1" and found["params"] == 2 and found["index"] == 1
    assert found["ranks"] == [1] and found["ref_ranks"] == [0] and found["tie"]
    assert found["since"] == (48, 47) and found["step"] == 63
    assert w.add(0, _fp(80, 79, base)) is None and w.add(1, _fp(80, 79, [9.0] * 3)) is None  # once
    # a rank that never sends holds nothing up for ever: the oldest waiting are compared
    w3 = DriftWatch(WatchSettings())
    for n in range(1, w3.KEEP + 3):
        for r in (0, 1):
            w3.add(r, _fp(n, n, [1.0]), ranks=(0, 1, 2))
    assert w3.compared == 2


def test_drift_tolerance_majority_and_ranks_on_coarser_grids():
    w = DriftWatch(WatchSettings(drift_rtol=1e-6))
    # within 1e-6 x scale (100): rounding, not drift
    for r, s in enumerate([1.0, 1.0 + 5e-5, 1.0 - 5e-5]):
        assert w.add(r, _fp(16, 15, [s]), (0, 1, 2)) is None
    assert w.compared == 1 and w.last_match["k"] == (16, 15)
    # rank 2 samples every 32 steps, ranks 0 and 1 every 16: step 32 is compared, 48 with two
    assert w.add(0, _fp(32, 31, [1.0])) is None and w.add(1, _fp(32, 31, [1.0])) is None
    assert w.add(0, _fp(48, 47, [1.0])) is None and w.add(1, _fp(48, 47, [1.0])) is None
    found = w.add(2, _fp(32, 31, [1.5]))  # the odd one of three
    assert found is not None and found["ranks"] == [2] and found["ref_ranks"] == [0, 1]
    assert not found["tie"]
    assert found["param"] == "parameter 0" and found["since"] == (16, 15)
    # a rank whose fingerprint is NaN everywhere equals another NaN one (the nan watcher's)
    w2 = DriftWatch(WatchSettings())
    assert w2.add(0, _fp(1, 0, [NAN]), (0, 1)) is None
    assert w2.add(1, _fp(1, 0, [NAN]), (0, 1)) is None
    assert w2.compared == 1


# ---------------------------------------------------------------------- settings
def test_settings_are_validated_and_read_from_text():
    s = WatchSettings().update(nan="stop", spike_factor=5, spike_window=20)
    assert (s.nan, s.spike, s.spike_factor, s.spike_window) == ("stop", "warn", 5.0, 20)
    for bad in ({"nan": "halt"}, {"spike_factor": 1.0}, {"spike_window": 0}, {"nope": 1}):
        with pytest.raises(ValueError):
            s.update(**bad)
    assert parse_settings("nan=stop, spike = off drift_rtol=1e-5") == {
        "nan": "stop",
        "spike": "off",
        "drift_rtol": 1e-5,
    }
    assert parse_settings(["spike_window=20"]) == {"spike_window": 20}
    with pytest.raises(ValueError, match="watcher=action"):
        parse_settings("nan")
    assert "nan=warn" in WatchSettings().text()


# ---------------------------------------------------------------------- the store
class ClientCh:
    ranks = [0, 1]

    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, rank, kind, **p) -> None:
        self.sent.append((rank, kind, p))


def _metrics(rank: int, seq: int, steps: range, loss, fp: list | None = None) -> dict:
    t = [3000.0 + s for s in steps]
    msg = {
        "kind": "metrics",
        "rank": rank,
        "seq": seq,
        "pid": 5,
        "cols": {
            "loss": [list(steps), t, [loss(rank, s) for s in steps]],
            "time/step": [list(steps), t, [NAN] * len(steps)],  # hvdnb's own rows: not watched
        },
    }
    if fp is not None:
        msg["fp"] = fp
    return msg


def test_store_one_line_per_alarm_with_the_other_ranks_values(monkeypatch):
    monkeypatch.setenv("HVDNB_FLUSH_INTERVAL_STEADY", "0.05")  # a short wait for peers
    st = MetricsStore()
    st._channel = ClientCh()
    st.begin_cell(1)

    def loss(r: int, s: int) -> float:
        return NAN if r == 1 and s >= 57 else 1.0 / (1 + s)

    st.ingest(_metrics(1, 1, range(100), loss))
    # rank 0's values at step 57 have not arrived: the line waits for them
    assert st.take_lines() == [] and st.alarm_marks() == [(57, "nan r1")]
    st.ingest(_metrics(0, 1, range(100), loss))
    assert st.take_lines() == [
        "hvdnb nan watcher: loss is nan on rank 1 from step 57; rank 0 at step 57: 0.01724"
    ]
    st.ingest(_metrics(1, 2, range(100, 200), loss))
    assert st.take_lines(final=True) == []  # never twice
    assert "nan loss r1@57" in st.alarm_summary()
    assert st._channel.sent == []  # warn: nothing sent to the ranks
    st.end_cell()


def test_store_ranks_of_one_round_share_a_line_and_a_peer_that_never_answers_is_na(
    monkeypatch,
):
    monkeypatch.setenv("HVDNB_FLUSH_INTERVAL_STEADY", "0.0")
    st = MetricsStore()
    st._channel = ClientCh()
    st._channel.ranks = [0, 1, 2]
    st.begin_cell(1)

    def loss(r: int, s: int) -> float:
        return math.inf if (r == 0 and s >= 10) or (r == 2 and s >= 12) else 1.0

    st.ingest(_metrics(0, 1, range(20), loss))
    st.ingest(_metrics(2, 1, range(20), loss))
    import time

    time.sleep(0.3)  # past ready_by (a message interval of 0 s + 0.25 s)
    lines = st.take_lines()
    assert lines == [
        "hvdnb nan watcher: loss is inf on ranks 0,2 from step 10 (rank 2 from step 12); "
        "rank 1 at step 10: n/a"
    ]


def test_store_stop_asks_rank0_once_and_forwards_its_plan(monkeypatch):
    monkeypatch.setenv("HVDNB_FLUSH_INTERVAL_STEADY", "0.0")
    st = MetricsStore()
    ch = st._channel = ClientCh()
    st.set_watch(nan="stop")
    st.begin_cell(4)

    def loss(r: int, s: int) -> float:
        return NAN if s >= 30 else 1.0

    st.ingest(_metrics(1, 1, range(50), loss))
    st.ingest(_metrics(0, 1, range(50), loss))  # rank 0 turns NaN too: no second request
    assert [(r, k) for r, k, _ in ch.sent] == [(0, kinds.STOP_REQ)]
    req = ch.sent[0][2]
    assert req["cell"] == 4 and req["reason"] == "nan watcher: loss is nan on rank 1 from step 30"
    st.on_stop_plan(
        {"kind": "stop_plan", "rank": 0, "id": req["id"], "stop_at": 70, "reason": "x", "cell": 4}
    )
    assert [(r, k) for r, k, _ in ch.sent[1:]] == [(0, kinds.STOP_PLAN), (1, kinds.STOP_PLAN)]
    assert ch.sent[1][2] == {"id": req["id"], "stop_at": 70, "reason": "x", "cell": 4}
    lines = st.take_lines(final=True)
    assert "stopping every rank" in lines[0] and "ranks 0,1 from step 30" in lines[0]
    assert lines[1] == "hvdnb: every rank stops at step 70 (a watcher is set to stop: hvdnb.watch)"
    # a new run starts afresh: its first alarm may ask again
    st.end_cell()
    st.begin_cell(5)
    st.ingest(_metrics(1, 2, range(50), loss))
    assert [k for _, k, _ in ch.sent].count(kinds.STOP_REQ) == 2


def test_store_drift_from_fingerprints_in_messages():
    st = MetricsStore()
    st._channel = ClientCh()
    st.begin_cell(1)

    def loss(r: int, s: int) -> float:
        return 1.0

    for seq, (n, a, b) in enumerate([(16, 1.0, 1.0), (32, 1.0, 1.0), (48, 1.0, 2.0)], 1):
        for r, v in ((0, a), (1, b)):
            fp = [_fp(n, n - 1, [0.5, v], names=seq == 1)]
            st.ingest(_metrics(r, seq, range(16 * seq - 16, 16 * seq), loss, fp))
    assert st.drift_checks == 3
    (line,) = st.take_lines()
    assert line.startswith(
        "hvdnb drift watcher: parameter p1 differs between rank 0 and rank 1; it began between "
        "step 31 (last matching check) and step 47"
    )
    assert st.alarm_marks() == [(47, "drift")]


def test_off_watchers_find_nothing_and_clear_forgets():
    st = MetricsStore()
    st.set_watch(nan="off", spike="off", drift="off")
    st.begin_cell(1)
    st.ingest(_metrics(0, 1, range(100), lambda r, s: NAN))
    assert st.alarms == [] and st.take_lines(final=True) == []
    st.set_watch(nan="warn")
    st.ingest(_metrics(0, 2, range(100, 200), lambda r, s: NAN))
    assert len(st.alarms) == 1
    st.clear()
    assert st.alarms == [] and st.run_alarms() == []


# ---------------------------------------------------------------------- the ranks' stop
class RankCh:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.sent: list[tuple] = []
        self.handlers: dict = {}

    def send(self, kind, **p) -> None:
        self.sent.append((kind, p))

    def on(self, kind, fn) -> None:
        self.handlers[kind] = fn


@pytest.fixture
def rank_recorder(monkeypatch):
    rec = Recorder(0, RankCh(0), flush_interval=100.0)
    rec.flusher.start = lambda: None
    monkeypatch.setattr(recmod, "_RECORDER", rec)
    monkeypatch.setattr(recmod, "_CELL", 7)
    rec.cell_running = True
    yield rec
    stop._PLAN = None


def test_rank0_plans_the_stop_ahead_and_every_rank_raises_at_that_step(rank_recorder):
    rec = rank_recorder
    ch = rec.channel
    stop.listen(ch)
    assert set(ch.handlers) == {kinds.STOP_REQ, kinds.STOP_PLAN}
    for s in range(20):
        rec.log(s, 0.5)
    ch.handlers[kinds.STOP_REQ]({"id": "s1", "reason": "nan watcher: x", "cell": 7})
    kind, plan = ch.sent[-1]
    assert kind is kinds.STOP_PLAN and plan["stop_at"] >= 20 + recmod.MIN_LEAD
    ch.handlers[kinds.STOP_REQ]({"id": "s1", "reason": "again", "cell": 7})  # planned once
    assert len(ch.sent) == 1
    stop.on_plan({"kind": "stop_plan", **plan})
    at = plan["stop_at"]
    s = 20
    with pytest.raises(TrainingStopped) as info:
        while s < at + 10:
            rec.log(s, 0.5)
            s += 1
    assert s == at - 1  # raised in log(stop_at - 1): step stop_at never starts
    assert str(info.value) == f"nan watcher: x (hvdnb stopped the loop at step {at} on every rank)"
    assert type(info.value).__module__ == "hvdnb" and stop.pending() is None
    rec.log(s + 1, 0.5)  # once


def test_a_late_plan_raises_at_once_and_a_plan_for_another_cell_never(rank_recorder):
    stop.on_plan({"id": "p2", "stop_at": 5, "reason": "spike watcher: y", "cell": 6})
    assert stop.pending() is None  # another cell's loop
    stop.on_plan({"id": "p3", "stop_at": 5, "reason": "spike watcher: y", "cell": 7})
    with pytest.raises(TrainingStopped, match="at step 9 on this rank: the plan for step 5"):
        stop.check(9)
    stop.on_plan({"id": "p3", "stop_at": 5, "reason": "again", "cell": 7})  # done already
    assert stop.pending() is None


def test_rank0_refuses_when_no_loop_of_that_cell_runs(rank_recorder):
    rec = rank_recorder
    rec.cell_running = False
    stop.on_request({"id": "s9", "reason": "r", "cell": 7})
    assert "no loop of cell 7" in rec.channel.sent[-1][1]["error"]


def test_knobs_step_raises_the_stop_too(rank_recorder):
    from hvdnb.rank.metrics import knobs as kn

    k = kn.Knobs({"lr": 0.1}, None, 0, None)
    stop.on_plan({"id": "p4", "stop_at": 3, "reason": "drift watcher: z", "cell": 7})
    k.step(2)
    with pytest.raises(TrainingStopped, match="drift watcher: z"):
        k.step(3)


def test_step_hooks_of_several_parts_are_all_called():
    calls = []
    recmod.on_step_start(lambda s: calls.append(("a", s)) or False, "test_a")
    recmod.on_step_start(lambda s: calls.append(("b", s)) or True, "test_b")
    try:
        assert coremod._STEP_HOOK(4) is True
        assert ("a", 4) in calls and ("b", 4) in calls
    finally:
        recmod.on_step_start(None, "test_a")
        recmod.on_step_start(None, "test_b")
    assert set(coremod._STEP_HOOKS) == {"knobs", "stop"}


# ---------------------------------------------------------------------- fingerprints
def test_step_listener_counts_steps_and_fingerprints_go_out_with_the_metrics(
    rank_recorder, monkeypatch
):
    torch = pytest.importorskip("torch")
    from hvdnb.rank.metrics import fingerprint
    from hvdnb.torch import listeners

    rec = rank_recorder
    model = torch.nn.Linear(4, 2)

    class Opt:
        _parameter_names = {p: n for n, p in model.named_parameters()}

    opt = Opt()
    seen = []
    listeners.add_step_listener(lambda n, named: seen.append((n, [x for x, _ in named])))
    listeners.add_step_listener(fingerprint.on_step)
    try:
        for s in range(40):
            rec.cur_step = s
            assert listeners.after_step(opt, s) == s
    finally:
        listeners.STEP_LISTENERS.clear()
    assert [n for n, _ in seen] == list(range(1, 41))
    assert seen[0][1] == ["weight", "bias"]
    msg = rec.pack()
    fps = msg["fp"]
    assert [e["n"] for e in fps][:2] == [16, 32]  # the first grid: 16 steps
    e = fps[0]
    assert e["names"] == ["weight", "bias"] and "names" not in fps[1]  # once per cell
    assert e["step"] == 15
    assert e["sums"] == pytest.approx(
        [float(p.detach().double().sum()) for p in model.parameters()]
    )
    w = model.weight.detach().double()
    assert e["scale"][0] == pytest.approx(float(w.norm()) * math.sqrt(w.numel()))
    assert "fp" not in (rec.pack() or {})


def test_fingerprints_hook_in_and_out_with_the_recorders_torch_attachment():
    pytest.importorskip("torch")
    from hvdnb.rank.metrics import comm, fingerprint
    from hvdnb.torch import listeners

    was = comm._TORCH_ON
    try:
        fingerprint.install()
        comm._torch_hooks(True)  # a recorder attached to hvdnb.torch
        assert fingerprint.on_step in listeners.STEP_LISTENERS
        comm._torch_hooks(False)  # hvdnb.metrics.set_enabled(False): a loop as without hvdnb
        assert fingerprint.on_step not in listeners.STEP_LISTENERS
    finally:
        comm._torch_hooks(was)
        listeners.STEP_LISTENERS.clear()


def test_a_loop_that_starts_its_steps_over_is_judged_afresh():
    # two loops in one run: the second's first losses (2.3) are no spike against the first
    # loop's converged ones (0.003)
    w = SpikeWatch(WatchSettings())
    first = np.concatenate([np.linspace(2.3, 0.01, 100), np.full(900, 0.003)])
    assert _feed(w, 0, first, 100) == []
    assert _feed(w, 0, np.concatenate([np.full(60, 2.3), _noisy(200)]), 100) == []


def test_a_late_message_of_a_finished_cells_loop_is_stored_not_watched():
    st = MetricsStore()
    st.begin_cell(2)
    late = _metrics(0, 1, range(100), lambda r, s: NAN)
    late["cell"] = 1  # the previous cell's last message, after this cell began
    st.ingest(late)
    assert st.alarms == [] and len(st.rows("loss")) == 100
    now = _metrics(0, 2, range(100), lambda r, s: NAN)
    now["cell"] = 2
    st.ingest(now)
    assert [a.watcher for a in st.alarms] == ["nan"]


def test_messages_say_their_cell(rank_recorder):
    rec = rank_recorder
    recmod.begin_cell(7)
    rec.log(0, 0.5)
    assert rec.pack()["cell"] == 7


# ---------------------------------------------------------------------- a cell's last fingerprint
def test_end_fingerprints_are_compared_with_end_ones_only_after_the_counts_own():
    w = DriftWatch(WatchSettings())
    ranks = (0, 1)
    before, after = [1.0, 2.0], [1.5, 2.0]  # a DDP model's sampled print is before the update
    # rank 0 sampled count 400 (before its update), rank 1's coarser grid did not
    assert w.add(0, _fp(384, 383, before, names=True), ranks) is None
    assert w.add(1, _fp(384, 383, before), ranks) is None
    assert w.add(0, _fp(400, 399, before), ranks) is None
    # the cell's end: both ranks after count 400's update, the same: no drift
    end = {"end": True}
    assert w.add(0, {**_fp(400, 400, after), **end}, ranks) is None
    assert w.add(1, {**_fp(400, 400, after), **end}, ranks) is None
    assert w.compared == 2 and w.last_match["k"] == (400, 400)
    # the next cell: rank 1 drifted after count 416's sample; only the end prints show it
    for r in ranks:
        assert w.add(r, _fp(416, 415, after), ranks) is None
    assert w.add(0, {**_fp(420, 419, after), **end}, ranks) is None
    found = w.add(1, {**_fp(420, 419, [1.5, 2.25]), **end}, ranks)
    assert found is not None and found["count"] == 420 and found["param"] == "p1"
    assert found["since"] == (416, 415) and found["step"] == 419


def _cell_on_a_rank(
    monkeypatch, rank: int, nudge: bool = False, fail: bool = False
) -> tuple[dict, list[dict]]:
    """Run a 40-step cell through the engine's ``run_cell`` in this process, as rank
    ``rank`` (a fresh recorder and fingerprint state): its reply and the messages sent."""
    pytest.importorskip("torch")
    from hvdnb.rank import engine
    from hvdnb.rank.metrics import fingerprint
    from hvdnb.torch import listeners

    monkeypatch.setattr(fingerprint, "_MODELS", {})
    monkeypatch.setattr(fingerprint, "_KEYS", {})
    monkeypatch.setattr(engine, "_release_peers", lambda: None)  # no process group here
    rec = Recorder(rank, RankCh(rank), flush_interval=100.0)  # no message from the loop
    rec.flusher.start = lambda: None
    monkeypatch.setattr(recmod, "_RECORDER", rec)
    ns: dict = {}  # the cell's namespace (an engine's IPython user_ns)
    monkeypatch.setattr(
        engine, "_shell", lambda: types.SimpleNamespace(user_ns=ns, transform_cell=str)
    )
    code = f"""
import torch, hvdnb
from hvdnb.torch import listeners
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
class Opt:
    _parameter_names = {{p: n for n, p in model.named_parameters()}}
opt = Opt()
for step in range(40):
    with torch.no_grad():
        model.weight.mul_(0.99)                  # the same update on every rank
        if {nudge} and step == 34:               # after the last sample (count 32)
            model.bias[1] += 0.5
    listeners.after_step(opt, None)              # DistributedOptimizer.step()'s end
    hvdnb.log(step, 0.5)
if {fail}:
    raise ValueError("the cell fails after its loop")
"""
    listeners.add_step_listener(fingerprint.on_step)
    try:
        reply = engine.run_cell(code, 9)
    finally:
        listeners.remove_step_listener(fingerprint.on_step)
    assert reply.ok is not fail, reply
    sent = [p for k, p in rec.channel.sent if k == kinds.METRICS]
    return reply, sent


def test_a_cell_ends_with_a_last_fingerprint_in_its_last_message(monkeypatch):
    reply, sent = _cell_on_a_rank(monkeypatch, 0)
    # the loop sent nothing (a 100 s interval): the cell's end sent one message, the one
    # its reply names, and it holds the sampled prints (counts 16, 32) and the last one
    assert len(sent) == 1 and reply.metrics == (sent[0]["pid"], sent[0]["seq"])
    fps = sent[0]["fp"]
    assert [(e["n"], e.get("end", False)) for e in fps] == [(16, False), (32, False), (40, True)]
    assert fps[-1]["step"] == 40  # after log(39): the step in progress
    # the parameters are let go at the cell's end: a cell that steps nothing takes none
    from hvdnb.rank import engine
    from hvdnb.rank.metrics import fingerprint
    from hvdnb.torch import listeners

    assert all(m.named is None for m in fingerprint._MODELS.values())
    assert fingerprint.at_cell_end() == 0
    # a cell whose steps log nothing (no new rows, the last message just sent): its last
    # print still goes out before the reply
    rec = recmod.current()
    listeners.add_step_listener(fingerprint.on_step)
    try:
        reply = engine.run_cell("for _ in range(5): listeners.after_step(opt, None)", 10)
    finally:
        listeners.remove_step_listener(fingerprint.on_step)
    last = rec.channel.sent[-1][1]
    assert reply.metrics == (last["pid"], last["seq"]) == (sent[0]["pid"], sent[0]["seq"] + 1)
    assert [(e["n"], e.get("end")) for e in last["fp"]] == [(45, True)]


def test_a_failed_cell_takes_no_last_fingerprint(monkeypatch):
    # a rank may have stopped inside a step (an interrupt, a peer gone): no last print
    reply, sent = _cell_on_a_rank(monkeypatch, 0, fail=True)
    assert reply.ename == "ValueError"
    fps = [e for p in sent for e in p.get("fp", [])]
    assert [(e["n"], e.get("end", False)) for e in fps] == [(16, False), (32, False)]
    from hvdnb.rank.metrics import fingerprint

    assert all(m.named is None for m in fingerprint._MODELS.values())  # let go all the same


def test_drift_after_the_last_sampled_step_is_named_by_the_cells_end(monkeypatch):
    msgs = {r: _cell_on_a_rank(monkeypatch, r, nudge=r == 1)[1] for r in (0, 1)}
    st = MetricsStore()
    st._channel = ClientCh()
    st.begin_cell(9)
    for r in (0, 1):
        for p in msgs[r]:
            st.ingest({**p, "kind": "metrics", "rank": r})
    assert st.drift_checks == 3  # counts 16 and 32, and the cell's end
    (line,) = st.take_lines(final=True)
    assert line.startswith(
        "hvdnb drift watcher: parameter bias differs between rank 0 and rank 1; it began "
        "between step 31 (last matching check) and step 40"
    ), line
    # one rank: nothing to compare, no alarm, no error
    one = MetricsStore()
    one._channel = ClientCh()
    one._channel.ranks = [0]
    one.begin_cell(9)
    for p in msgs[1]:
        one.ingest({**p, "kind": "metrics", "rank": 0})
    assert one.drift_checks == 0 and one.take_lines(final=True) == []
