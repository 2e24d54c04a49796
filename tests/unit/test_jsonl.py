"""The protocol's file form (``hvdnb.protocol.jsonl``), what an exported script's ranks write
with it (``JsonlChannel``) and ``hvdnb.metrics.load`` reading it back: no processes.

Every message kind a rank sends is round-tripped through this encoder and through the wire,
and the two must agree (a second encoder beside the wire drifts from it otherwise)."""

from __future__ import annotations

import math
import os
import warnings
from array import array
from pathlib import Path

import numpy as np
import pytest

import hvdnb
from hvdnb.protocol import jsonl, kinds, wire
from hvdnb.rank.metrics import knobs as kn
from hvdnb.rank.metrics.recorder import Recorder
from hvdnb.rank.script import JsonlChannel

KEY = b"k" * 32


def _canon(x):
    """A form to compare with ``==``: NaN equals NaN, arrays equal lists of their values."""
    if isinstance(x, dict):
        return {k: _canon(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, array)):
        return [_canon(v) for v in x]
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return x


def _recorder_message(tmp_path: Path) -> dict:
    """A real recorder's ``metrics`` message: points, odd values, meta, fingerprints."""
    rec = Recorder(1, None, flush_interval=1e9, capacity=1024)
    for step in range(20):
        loss = [math.nan, math.inf, -math.inf][step] if step < 3 else 1.0 / (step + 1)
        rec.log(step, loss, samples=32, total_steps=20, lr=np.float32(0.1))
    rec.log(2**62, 0.5)  # a step past a float's exact integers
    rec.add_fingerprint({"key": "m", "n": 3, "step": 7, "sums": [1.5, -0.0], "scale": [1e-300]})
    return rec.pack()


def _rank_messages(tmp_path: Path) -> dict[str, dict]:
    """One message of every kind a rank sends, from the real senders where they are
    plain objects (recorder, knobs), built like the engine builds the others."""
    sent: list[dict] = []

    class Capture:
        def send(self, kind, **payload):
            sent.append(kinds.outgoing(kind, payload))

    k0 = kn.Knobs({"lr": 0.1, "batch_size": 64}, None, 0, Capture())
    k0.announce()  # knobs_spec
    k0.on_request({"id": "a", "values": {"lr": 0.2}})  # knobs_plan (rank 0)
    k0.on_plan({"id": "a", "apply_at": None, "values": {"lr": 0.2}})  # knobs_applied
    msgs = {m["kind"]: m for m in sent}
    built = [
        (kinds.METRICS, _recorder_message(tmp_path)),
        (kinds.HELLO, {"pid": os.getpid()}),
        (kinds.ELASTIC_LEFT, {"slot": 1, "error": "RuntimeError: check_rank and exit"}),
        (kinds.ELASTIC_LOOP, {"slot": 1, "inside": True}),
        (kinds.IMPORTED, {"module": "sklearn"}),
        (kinds.RANK_INFO, {"host": "node-1", "local_rank": 0, "pid": 12}),
        (kinds.STOP_PLAN, {"id": "s1", "stop_at": 40, "reason": "loss is NaN", "cell": 3}),
        (kinds.RDV_ANNOUNCE, {"addr": "10.0.0.1", "port": 29500}),
        (kinds.RDV_ASK, {}),
        (kinds.WHERE, {"ask": 1, "cell": 2, "line": 5, "code": "loss.backward()", "stack": []}),
        (kinds.PDB_OUT, {"text": "(Pdb) ", "waiting": True}),
        (kinds.DEBUG_READY, {"ask": "debug-1", "host": "127.0.0.1", "port": 5678, "pid": 4321}),
    ]
    for kind, payload in built:
        msgs[kind.name] = kinds.outgoing(kind, payload)
    return {name: {**m, "rank": 1} for name, m in msgs.items()}


def test_every_kind_a_rank_sends_reads_back_as_the_wire_delivers_it(tmp_path):
    msgs = _rank_messages(tmp_path)
    # hvdnb's own kinds (module constants of protocol.kinds), not ones a test registered
    # at run time (test_magics' "test_ping"): what is in KINDS depends on the test order
    ours = {v.name for v in vars(kinds).values() if isinstance(v, kinds.Kind)}
    rank_sent = {
        k.name for k in kinds.KINDS.values() if k.sender in ("rank", "both") and k.name in ours
    }
    assert set(msgs) == rank_sent, "a kind a rank sends has no sample here: add one"
    for name, msg in msgs.items():
        line = jsonl.dumps_line(msg)
        assert "\n" not in line
        got = jsonl.loads_line(line)
        via_wire = wire.decode(KEY, wire.encode(KEY, msg))
        assert via_wire is not None
        assert _canon(got) == _canon(via_wire) == _canon(msg), name
    cols = jsonl.loads_line(jsonl.dumps_line(msgs["metrics"]))["cols"]
    steps, _, values = cols["loss"]
    assert steps.typecode == "q" and values.typecode == "d"  # typed, as off the wire
    assert (
        steps[-1] == 2**62
        and math.isnan(values[0])
        and values[1:3].tolist()
        == [
            math.inf,
            -math.inf,
        ]
    )
    assert cols["lr"][2][0] == float(np.float32(0.1))  # the float32's value, every digit


def test_values_json_lacks_round_trip_numpy_bytes_tensors_nan():
    torch = pytest.importorskip("torch")
    msg = {
        "kind": "metrics",
        "rank": 0,
        "seq": 1,
        "t": 1.0,
        "cols": {
            "a": [np.arange(3), np.linspace(0, 1, 3), np.array([np.nan, np.inf, -0.0])],
            "b": [torch.tensor([5]), torch.tensor([2.5], dtype=torch.float64), [None]],
        },
        "meta": {"blob": b"\x00\xff\n", "n": np.int64(7), "v": np.float32(0.5)},
    }
    got = jsonl.loads_line(jsonl.dumps_line(msg))
    a = got["cols"]["a"]
    assert a[0] == array("q", [0, 1, 2]) and a[1] == array("d", [0.0, 0.5, 1.0])
    assert math.isnan(a[2][0]) and a[2][1] == math.inf and math.copysign(1, a[2][2]) == -1
    assert got["cols"]["b"] == [[5], [2.5], [None]]  # not all numbers: kept as written
    assert got["meta"] == {"blob": b"\x00\xff\n", "n": 7, "v": 0.5}
    with pytest.raises(TypeError, match="cannot be written to a metrics file"):
        jsonl.dumps_line({"kind": "hello", "pid": object()})


@pytest.mark.parametrize(
    "line, words",
    [
        (b'{"kind": "metrics", "seq": 1', "not a JSON line"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"kind": "nope"}', "unknown message kind 'nope'"),
        (b'{"kind": "metrics", "seq": 1}', "without 't', 'cols'"),
        (b'{"kind": "metrics", "seq": 1, "t": 0, "cols": {}, "b": {"$bytes": "!"}}', "JSON"),
        (b"\xff\xfe", "not a JSON line"),
    ],
)
def test_a_bad_line_is_a_value_error_that_says_what(line, words):
    with pytest.raises(ValueError, match=words):
        jsonl.loads_line(line)


def _write_rank(
    path: Path, rank: int, steps: range, pid: int | None = None, lr: float = 0.1
) -> list[float]:
    """What a script's rank writes: a real recorder and knobs on a ``JsonlChannel``."""
    ch = JsonlChannel(path / f"rank{rank}.jsonl", rank)
    rec = Recorder(rank, ch, flush_interval=1e9, capacity=4096)
    if pid is not None:
        rec.pid = pid
    kn.Knobs({"lr": lr}, None, rank, ch).announce()
    losses = []
    for i, step in enumerate(steps):
        loss = 1.0 / (step + 1) + rank
        losses.append(loss)
        rec.log(step, loss, samples=8)
        if i % 7 == 6:
            rec.flush()  # several messages per file
    rec.flush()
    ch.close()
    return losses


def test_load_reads_every_rank_file_into_metrics_rows(tmp_path):
    want = {r: _write_rank(tmp_path, r, range(30)) for r in (0, 1)}
    rows = hvdnb.metrics.load(tmp_path, "loss")
    assert len(rows) == 60
    for r in (0, 1):
        mine = [row for row in rows if row.rank == r]
        assert [row.step for row in mine] == list(range(30))
        assert [row.value for row in mine] == want[r]
        assert {row.run for row in mine} == {1} and mine[0].knobs == {"lr": 0.1}
    df = hvdnb.metrics.load(tmp_path).to_pandas()
    assert set(df.name) >= {"loss", "samples"} and df[df.name == "samples"].value.sum() == 480
    store = hvdnb.metrics.load_store(tmp_path / "rank1.jsonl")  # one file works too
    assert store.ranks() == [1] and store.count("loss", 1) == 30


def test_each_script_run_appended_to_a_directory_is_its_own_run(tmp_path):
    for r in (0, 1):
        _write_rank(tmp_path, r, range(10), pid=100 + r)
        _write_rank(tmp_path, r, range(5), pid=200 + r, lr=0.3)
    rows = hvdnb.metrics.load(tmp_path, "loss")
    assert [(row.run, row.rank) for row in rows].count((1, 0)) == 10
    assert [(row.run, row.rank) for row in rows].count((2, 1)) == 5
    assert {row.run: row.knobs["lr"] for row in rows} == {1: 0.1, 2: 0.3}
    assert len(hvdnb.metrics.load(tmp_path, "loss", run=2)) == 10


def test_a_corrupt_line_is_named_and_the_rest_is_loaded(tmp_path):
    _write_rank(tmp_path, 0, range(30))
    f = tmp_path / "rank0.jsonl"
    lines = f.read_bytes().splitlines(keepends=True)
    assert len(lines) >= 4
    lines[2] = lines[2][: len(lines[2]) // 2] + b"\n"  # a torn write
    f.write_bytes(b"".join(lines) + b'{"kind": "metrics"')  # and a last line cut short
    with pytest.warns(UserWarning) as caught:
        rows = hvdnb.metrics.load(tmp_path, "loss")
    (w,) = caught
    text = str(w.message)
    assert f"{f}:3:" in text and f"{f}:{len(lines) + 1}:" in text and "skipped 2 lines" in text
    assert 0 < len(rows) < 30 and rows[-1].step == 29  # the lines around them are kept


def test_no_rank_files_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no rank<N>\.jsonl file.*HVDNB_METRICS_DIR="):
        hvdnb.metrics.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hvdnb.metrics.load(tmp_path / "missing")
    (tmp_path / "rank0.jsonl").write_text("")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert hvdnb.metrics.load(tmp_path) == []
    assert any("holds no message" in str(w.message) for w in caught)
