"""What one metrics message costs on the side channel: JSON lists vs packed columns.

A rank's recorder logs a 0.4 ms-step loop for one flush interval (625 steps: loss,
samples, step time, a data phase and one bucket's time / exposed / bytes, as
DistributedOptimizer reports them), ``pack()`` builds the message, and the channel
encodes + signs it on the rank (holding the rank's GIL) and verifies + decodes it in
the notebook. Both encodings are timed interleaved in one run (medians of ``--reps``).

Prints a table and writes ``bench/results/channel.json``.
Usage: ``python bench/bench_channel.py [--reps 200] [--steps 625]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hvdnb import channel  # noqa: E402
from hvdnb.metrics.recorder import Recorder  # noqa: E402

OUT = Path(__file__).parent / "results" / "channel.json"
KEY = b"k" * 32


class _Capture:
    msg: dict = {}

    def send(self, kind: str, **msg: object) -> None:
        self.msg = dict(msg, kind=kind, rank=0)

    def on(self, *a: object) -> None:
        pass


def _message(steps: int) -> dict:
    cap = _Capture()
    rec = Recorder(0, channel=cap)
    rec.flush_in_loop = False
    rnd = random.Random(0)
    for s in range(steps):
        rec.on_comm("DistributedOptimizer.bucket.0", 9000, 4e-5 * rnd.random(), "mpi", 1e-5)
        rec.record(s, "time/data", 1e-4 * rnd.random())
        rec.log(s, 1.0 / (s + 1) + rnd.random() * 0.01, samples=32, total_steps=10**6)
    msg = rec.pack()
    assert msg is not None
    return dict(msg, kind="metrics", rank=0)


def _json_lists(msg: dict) -> list[bytes]:  # the encoding before packed columns
    body = json.dumps(msg, separators=(",", ":"), allow_nan=True).encode()
    return [channel.sign(KEY, body), body]


def _json_lists_decode(frames: list[bytes]) -> dict:
    assert channel.verify(KEY, frames[0], frames[1])
    return json.loads(frames[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--steps", type=int, default=625)
    args = ap.parse_args()
    msg = _message(args.steps)
    rows = sum(len(c[0]) for c in msg["cols"].values())
    ways = {"json lists": (_json_lists, _json_lists_decode),
            "packed columns": (lambda m: channel.encode(KEY, m),
                               lambda f: channel.decode(KEY, f))}
    times: dict[str, dict[str, list[float]]] = {w: {"encode": [], "decode": []} for w in ways}
    size = {}
    for _ in range(args.reps):
        for w, (enc, dec) in ways.items():  # interleaved: same machine state for both
            t0 = time.perf_counter()
            frames = enc(msg)
            t1 = time.perf_counter()
            back = dec(frames)
            t2 = time.perf_counter()
            times[w]["encode"].append(t1 - t0)
            times[w]["decode"].append(t2 - t1)
            size[w] = len(frames[1])
            assert back["cols"].keys() == msg["cols"].keys()
    res = {w: {k: statistics.median(v) * 1e3 for k, v in t.items()} | {"bytes": size[w]}
           for w, t in times.items()}
    print(f"one metrics message: {rows} rows ({args.steps} steps), medians of {args.reps}")
    print(f"{'encoding':<16}{'encode+sign ms':>16}{'verify+decode ms':>18}{'bytes':>10}")
    for w, r in res.items():
        print(f"{w:<16}{r['encode']:>16.3f}{r['decode']:>18.3f}{r['bytes']:>10,}")
    a, b = res["json lists"], res["packed columns"]
    print(f"ratio lists/packed: encode {a['encode'] / b['encode']:.1f}x, "
          f"decode {a['decode'] / b['decode']:.1f}x")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"command": "python bench/bench_channel.py " + " ".join(sys.argv[1:]),
                               "rows": rows, "steps": args.steps, "reps": args.reps,
                               "results_ms": res}, indent=1))


if __name__ == "__main__":
    main()
