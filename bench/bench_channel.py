"""What one metrics message costs on the side channel: three encodings side by side.

A rank's recorder logs a 1 ms-step loop for one steady flush interval (1000 steps:
loss, samples, step time, a data phase and one bucket's time / exposed / bytes, as
DistributedOptimizer reports them), ``pack()`` builds the message (timed: it runs on the
training thread), and the channel encodes + signs it on the rank (the I/O thread, holding
the rank's GIL) and verifies + decodes it in the notebook. Encodings, timed interleaved
in one run (medians of ``--reps``):

- ``json lists``: every column as JSON numbers (the first wire format);
- ``base64 columns``: int64/float64 columns as base64 strings inside the JSON (the
  second);
- ``binary blob``: the columns as raw bytes in a third frame, equal columns sent once
  (``hvdnb.protocol.wire.encode`` now).

Prints a table and writes ``bench/results/channel.json``.
Usage: ``python bench/bench_channel.py [--reps 200] [--steps 1000]``
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import statistics
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hvdnb.protocol import wire as channel
from hvdnb.protocol.kinds import Kind, outgoing
from hvdnb.rank.metrics.recorder import Recorder

OUT = Path(__file__).parent / "results" / "channel.json"
KEY = b"k" * 32


class _Capture:
    msg: dict = {}

    def send(self, kind: Kind, **msg: object) -> None:
        self.msg = {**outgoing(kind, dict(msg)), "rank": 0}

    def on(self, *a: object) -> None:
        pass


def _fill(rec: Recorder, steps: int, s0: int = 0) -> None:
    rnd = random.Random(s0)
    for s in range(s0, s0 + steps):
        rec.on_comm("DistributedOptimizer.bucket.0", 9000, 4e-5 * rnd.random(), "mpi", 1e-5)
        rec.record(s, "time/data", 1e-4 * rnd.random())
        rec.log(s, 1.0 / (s + 1) + rnd.random() * 0.01, samples=32, total_steps=10**6)


def _recorder() -> Recorder:
    rec = Recorder(0, channel=_Capture())
    rec.flusher.flush_in_loop = False
    rec._due = float("inf")  # no message from log(): pack() is called by hand
    return rec


def _message(steps: int) -> dict:
    rec = _recorder()
    _fill(rec, steps)
    msg = rec.pack()
    assert msg is not None
    return dict(msg, kind="metrics", rank=0)


def _pack_ms(steps: int, reps: int) -> float:
    """Median time of ``pack()`` over one interval's rows (the training thread's share)."""
    rec = _recorder()
    out = []
    for k in range(reps):
        _fill(rec, steps, k * steps)
        t0 = time.perf_counter()
        rec.pack()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def _plain(msg: dict) -> dict:
    """The message with its columns as lists (what the JSON encodings take)."""
    return dict(msg, cols={k: [list(c) for c in v] for k, v in msg["cols"].items()})


def _json_lists(msg: dict) -> list[bytes]:  # the first encoding
    body = json.dumps(_plain(msg), separators=(",", ":"), allow_nan=True).encode()
    return [channel.sign(KEY, body), body]


def _json_decode(frames: list[bytes]) -> dict:
    assert channel.verify(KEY, frames[0], frames[1])
    return json.loads(frames[1])


def _b64(kind: str, values: list) -> str:
    return base64.b64encode(array(kind, values).tobytes()).decode("ascii")


def _base64_columns(msg: dict) -> list[bytes]:  # the second encoding
    plain = _plain(msg)
    packed = {
        k: [len(c[0]), _b64("q", c[0]), _b64("d", c[1]), _b64("d", c[2])]
        for k, c in plain.pop("cols").items()
    }
    body = json.dumps(
        dict(plain, cols={}, colsb=packed), separators=(",", ":"), allow_nan=True
    ).encode()
    return [channel.sign(KEY, body), body]


def _base64_decode(frames: list[bytes]) -> dict:
    msg = _json_decode(frames)
    for k, (n, st, ti, va) in msg.pop("colsb").items():
        cols = []
        for kind, text in (("q", st), ("d", ti), ("d", va)):
            a = array(kind)
            a.frombytes(base64.b64decode(text))
            cols.append(a.tolist())
        msg["cols"][k] = cols
    return msg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()
    msg = _message(args.steps)
    pack_ms = _pack_ms(args.steps, args.reps)
    rows = sum(len(c[0]) for c in msg["cols"].values())
    ways = {
        "json lists": (_json_lists, _json_decode),
        "base64 columns": (_base64_columns, _base64_decode),
        "binary blob": (lambda m: channel.encode(KEY, m), lambda f: channel.decode(KEY, f)),
    }
    times: dict[str, dict[str, list[float]]] = {w: {"encode": [], "decode": []} for w in ways}
    size = {}
    for _ in range(args.reps):
        for w, (enc, dec) in ways.items():  # interleaved: same machine state for all
            t0 = time.perf_counter()
            frames = enc(msg)
            t1 = time.perf_counter()
            back = dec(frames)
            t2 = time.perf_counter()
            times[w]["encode"].append(t1 - t0)
            times[w]["decode"].append(t2 - t1)
            size[w] = sum(len(f) for f in frames[1:])
            assert back["cols"].keys() == msg["cols"].keys()
            assert list(back["cols"]["loss"][2]) == list(msg["cols"]["loss"][2])
    res = {
        w: {k: statistics.median(v) * 1e3 for k, v in t.items()} | {"bytes": size[w]}
        for w, t in times.items()
    }
    print(f"one metrics message: {rows} rows ({args.steps} steps), medians of {args.reps}")
    print(f"pack() on the training thread: {pack_ms:.3f} ms (median of {args.reps})")
    print(f"{'encoding':<16}{'encode+sign ms':>16}{'verify+decode ms':>18}{'bytes':>10}")
    for w, r in res.items():
        print(f"{w:<16}{r['encode']:>16.3f}{r['decode']:>18.3f}{r['bytes']:>10,}")
    b = res["binary blob"]
    for w in ("json lists", "base64 columns"):
        a = res[w]
        print(
            f"{w} / binary blob: encode {a['encode'] / b['encode']:.1f}x, "
            f"decode {a['decode'] / b['decode']:.1f}x, bytes {a['bytes'] / b['bytes']:.1f}x"
        )
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "command": "python bench/bench_channel.py " + " ".join(sys.argv[1:]),
                "rows": rows,
                "steps": args.steps,
                "reps": args.reps,
                "pack_ms": pack_ms,
                "results_ms": res,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
