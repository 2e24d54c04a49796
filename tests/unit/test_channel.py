"""The side channel's signing and its sockets (real ZeroMQ over loopback, one process)."""

from __future__ import annotations

import json
import math
import threading
import time

import zmq

from hvdnb.notebook.cluster.channel import ClientChannel
from hvdnb.protocol import kinds
from hvdnb.protocol.wire import decode, encode, sign
from hvdnb.rank.channel import EngineChannel

KEY = b"k" * 32


def _wait(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_signed_json_roundtrip_and_tampering():
    frames = encode(KEY, {"kind": "x", "rank": 1, "v": [1.5, None]})
    assert decode(KEY, frames) == {"kind": "x", "rank": 1, "v": [1.5, None]}
    sig, body = frames
    assert decode(KEY, [sig, body.replace(b"1.5", b"2.5")]) is None  # body changed
    assert decode(b"other-key", frames) is None  # wrong key
    assert decode(KEY, [body]) is None  # missing frame
    assert decode(b"", frames) is None  # no key: refuse everything
    # a correctly signed pickle is still refused: only JSON objects with a kind pass
    import pickle

    blob = pickle.dumps({"kind": "x"})
    assert decode(KEY, [encode(KEY, {"kind": "y"})[0], blob]) is None


def test_metrics_columns_travel_packed_and_come_back_exact():
    from array import array

    inf = float("inf")
    steps = [0, 1, 2**40]
    cols = {
        "loss": [steps, [1e9 + 0.123456, 1e9 + 0.5, 1e9 + 1.0], [0.5, inf, -0.0]],
        "samples": [
            array("q", steps),
            [1e9 + 0.123456, 1e9 + 0.5, 1e9 + 1.0],
            array("d", [32.0, 32.0, 32.0]),
        ],
        "odd": [[1.5], [2.0], [3.0]],  # a float step: stays JSON, still arrives
        "empty": [[], [], []],
    }
    msg = {"kind": "metrics", "rank": 1, "seq": 3, "cols": cols}
    sig, body, blob = encode(KEY, msg)
    wire = json.loads(body)
    assert set(wire["colsx"]) == {"loss", "samples", "empty"} and set(wire["cols"]) == {"odd"}
    # equal columns are sent once: steps and times shared by loss and samples
    assert wire["colsx"]["loss"][1:3] == wire["colsx"]["samples"][1:3]
    assert len(blob) == wire["blob"] == 8 * 3 * 4  # steps, times, two value columns
    back = decode(KEY, [sig, body, blob])
    assert {k: [list(c) for c in v] for k, v in back["cols"].items()} == {
        k: [list(c) for c in v] for k, v in cols.items()
    }  # exact doubles and int64
    assert type(back["cols"]["loss"][2]) is array and msg["cols"] is cols  # sender untouched
    nan = decode(KEY, encode(KEY, {"kind": "metrics", "cols": {"x": [[0], [0.0], [math.nan]]}}))
    assert math.isnan(nan["cols"]["x"][2][0])
    # the signature covers the blob: one changed byte and the message is dropped
    assert decode(KEY, [sig, body, blob[:-1] + bytes([blob[-1] ^ 1])]) is None
    assert decode(KEY, [sig, body]) is None  # the blob left out
    # a signed message whose columns do not fit its blob is dropped, not half-read
    for bad_cols, size in (
        ({"x": [2, 0, 0, 0]}, 8),
        ({"x": [1, 0, 8, 16]}, 16),
        ({"x": [1, -8, 0, 0]}, 24),
        ({"x": "AA"}, 24),
        ({"x": [1, 0, 8, 16]}, 23),
    ):
        body = json.dumps({"kind": "metrics", "cols": {}, "colsx": bad_cols, "blob": size}).encode()
        raw = bytes(24)
        assert decode(KEY, [sign(KEY, body, raw), body, raw]) is None, bad_cols


def test_client_listens_on_loopback_only():
    ch = ClientChannel(ip="127.0.0.1", key=KEY)
    try:
        assert ch.endpoint.startswith("tcp://127.0.0.1:")
        import os

        import psutil

        mine = [
            c
            for c in psutil.Process(os.getpid()).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == ch.port
        ]
        assert mine and all(c.laddr.ip == "127.0.0.1" for c in mine)
    finally:
        ch.close()


def test_messages_flow_both_ways_and_forgeries_are_dropped():
    ch = ClientChannel(key=KEY)
    got: list[dict] = []
    ch.on(kinds.METRICS, got.append)
    eng = EngineChannel(ch.endpoint, KEY, rank=3)
    try:
        eng.send(kinds.METRICS, seq=0, t=0.0, cols={}, rows=[[3, 1, "loss", 0.5, 0.0]])
        assert _wait(lambda: got)
        assert got[0]["rank"] == 3 and got[0]["rows"][0][3] == 0.5
        assert ch.ranks == [3]
        heard: list[dict] = []
        eng.on(kinds.KNOBS_PLAN, heard.append)
        ch.send(3, kinds.KNOBS_PLAN, id="k1", values={"lr": 0.2})
        assert _wait(lambda: heard)
        assert heard[0]["values"] == {"lr": 0.2}
        # a forger without the key is ignored
        rogue = zmq.Context.instance().socket(zmq.DEALER)
        rogue.connect(ch.endpoint)
        rogue.send_multipart(encode(b"wrong", {"kind": "metrics", "rank": 9}))
        rogue.send_multipart([b"garbage"])
        assert _wait(lambda: ch.dropped >= 2)
        rogue.close(0)
        assert len(got) == 1 and 9 not in ch.ranks
    finally:
        eng.close()
        ch.close()


def test_many_messages_lose_nothing():
    ch = ClientChannel(key=KEY)
    seen: list[int] = []
    lock = threading.Lock()

    def add(m):
        with lock:
            if "seq" in m:  # not an engine's own hello
                seen.append(m["seq"])

    ch.on(kinds.HELLO, add)
    engines = [EngineChannel(ch.endpoint, KEY, rank=r) for r in range(4)]
    try:
        for i in range(2000):
            engines[i % 4].send(kinds.HELLO, pid=0, seq=i)
        assert _wait(lambda: len(seen) == 2000, timeout=20)
        assert sorted(seen) == list(range(2000))
    finally:
        for e in engines:
            e.close()
        ch.close()
