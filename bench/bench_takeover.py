"""What the server's watch over running cells (``hvdnb.server.takeover``) costs per kernel message.

The server gets each IOPub message of a kernel a page is connected to once more, on its
own subscription, and reads its header (``TakeOver._published``); a message answering a
running cell is kept (until the cell ends), one that answers nothing is dropped. This times
that, per message, on real messages signed and serialized by jupyter_client's ``Session``
(stream lines as a flooding cell sends them), side by side with what the server already
does for every message it forwards to a page: reading it back whole (``Session.deserialize``
with its content), the cheaper of its two ways.

Prints a table and writes ``bench/results/takeover.json``. Usage:
``python bench/bench_takeover.py [--messages 20000] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jupyter_client.session import Session

from hvdnb.server.takeover import Request, TakeOver

OUT = ROOT / "bench" / "results" / "takeover.json"


def _messages(session: Session, n: int, parent: dict) -> list[list[bytes]]:
    out = []
    for i in range(n):
        msg = session.msg("stream", {"name": "stdout", "text": f"[0,1] step {i} loss 0.5\n"})
        msg["parent_header"] = parent
        out.append(session.serialize(msg))
    return out


def _time(fn, frames: list[list[bytes]]) -> float:
    t0 = time.perf_counter()
    for f in frames:
        fn(f)
    return (time.perf_counter() - t0) / len(frames) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    session = Session(key=b"bench-key")
    running = session.msg_header("execute_request")
    other = session.msg_header("execute_request")
    watch = TakeOver(serverapp=None, hook=lambda *a: None)
    tracked, untracked = _messages(session, args.messages, running), None
    untracked = _messages(session, args.messages, other)
    rows: dict[str, list[float]] = {
        "forward (deserialize whole)": [],
        "watch: kept": [],
        "watch: dropped": [],
    }

    def fresh() -> Session:
        # a receiver of its own per pass: a Session refuses a signature it has seen
        return Session(key=b"bench-key")

    for _ in range(args.repeats):
        watch.requests = {running["msg_id"]: Request(running["msg_id"], "k", "s", "c")}
        rx = fresh()
        rows["forward (deserialize whole)"].append(
            _time(lambda f, rx=rx: rx.deserialize(rx.feed_identities(f)[1]), tracked)
        )
        rx = fresh()
        rows["watch: kept"].append(_time(lambda f, rx=rx: watch._published(rx, f), tracked))
        rx = fresh()
        rows["watch: dropped"].append(_time(lambda f, rx=rx: watch._published(rx, f), untracked))
    med = {k: round(statistics.median(v), 2) for k, v in rows.items()}
    base = med["forward (deserialize whole)"]
    print(
        f"{'per kernel message':34s} {'µs (median of ' + str(args.repeats) + ')':>20s} {'vs forward':>11s}"
    )
    for k, v in med.items():
        print(f"{k:34s} {v:20.2f} {v / base:10.2f}x")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "messages": args.messages,
                "repeats": args.repeats,
                "median_us": med,
                "samples_us": rows,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
