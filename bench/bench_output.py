"""How the merging of rank output scales: cost per line against lines shown and ranks.

``hvdnb.notebook.cellout.output.OutputCollapser`` is pure code (no clock, no I/O), so it is measured
alone here, at 2, 64 and 1,024 ranks, for the two floods a training loop makes:

- ``same``: every rank prints the same lines (``epoch 3``), merged into one tagged line;
- ``differ``: every rank prints its own lines (``rank 5 loss 0.31``), never merged;
- ``lagging``: like ``same``, but one rank runs ``--lag`` lines behind the others, so the
  lines it has not printed yet are held (the backlog a merge must not scan).
- ``late``: like ``lagging`` with the clock running (a chunk per 10 ms, the real 0.25 s
  window), the last rank 24 to 26 chunks behind: some of its lines arrive after the
  others' copies waited out the window and were shown alone, the rest still merge; the
  mix a real kernel's 20,000-line flood makes.

Lines arrive in chunks of ``--chunk`` lines per rank, round robin, as the cell's reader feeds
them. For each case the table gives µs per input line over the first and the last tenth of
the run: equal columns mean the cost does not grow with the lines already shown; the
µs-per-line column across rank counts shows how it grows with the ranks.

Usage: ``python bench/bench_output.py [--lines 20000] [--chunk 50]``; writes
``bench/results/output.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hvdnb.notebook.cellout.output import OutputCollapser

OUT = ROOT / "bench" / "results" / "output.json"


def run(nranks: int, lines_per_rank: int, chunk: int, case: str, lag: int) -> dict:
    shown = 0

    def emit(stream: str, text: str) -> None:
        nonlocal shown
        shown += 1

    # nothing leaves by age, except in ``late``, where a chunk is fed every 10 ms
    c = OutputCollapser(range(nranks), emit, window=0.25 if case == "late" else 10.0)
    jitter = [(i * 7) % 3 for i in range(lines_per_rank // chunk + 1)]  # 0, 1 or 2 chunks
    marks: list[tuple[int, float]] = []
    fed = 0
    t0 = time.perf_counter()
    total = nranks * lines_per_rank
    steps = (lines_per_rank + lag) // chunk + 1
    if case == "late":
        steps = lines_per_rank // chunk + 30
    sent = 0  # the late rank's chunks fed so far
    for s in range(steps):
        for r in range(nranks):
            start = s * chunk - (lag if case == "lagging" and r == nranks - 1 else 0)
            if case == "late" and r == nranks - 1:  # every chunk due by now (24-26 behind)
                due = sent
                while due < len(jitter) and due + 24 + jitter[due] <= s:
                    due += 1
                start, sent = sent * chunk, due
                lo, hi = start, min(lines_per_rank, due * chunk)
            else:
                lo, hi = max(0, start), min(lines_per_rank, start + chunk)
            if hi <= lo:
                continue
            if case == "differ":
                text = "".join(f"rank {r} step {i} loss 0.{i:05d}\n" for i in range(lo, hi))
            else:
                text = "".join(f"step {i} loss 0.{i:05d}\n" for i in range(lo, hi))
            c.feed(r, "stdout", text, now=0.01 * s if case == "late" else 0.0)
            fed += hi - lo
            marks.append((fed, time.perf_counter() - t0))
    c.flush()
    elapsed = time.perf_counter() - t0

    def rate(a: float, b: float) -> float:
        """µs per input line between fractions a and b of the input."""
        lo = next(m for m in marks if m[0] >= a * total)
        hi = next(m for m in marks if m[0] >= b * total)
        return 1e6 * (hi[1] - lo[1]) / max(1, hi[0] - lo[0])

    return {
        "ranks": nranks,
        "case": case,
        "lines_in": total,
        "lines_shown": shown,
        "seconds": elapsed,
        "us_per_line": 1e6 * elapsed / total,
        "us_per_line_first_tenth": rate(0.0, 0.1),
        "us_per_line_last_tenth": rate(0.9, 1.0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=20000, help="lines per rank at 2 ranks")
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--lag", type=int, default=2000)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    rows = []
    for nranks in (2, 64, 1024):
        # the same number of input lines in all (2 ranks x --lines)
        per_rank = max(args.chunk * 4, 2 * args.lines // nranks)
        for case in ("same", "differ", "lagging", "late"):
            rows.append(run(nranks, per_rank, args.chunk, case, min(args.lag, per_rank // 2)))
    head = f"{'ranks':>5} {'case':>8} {'lines in':>9} {'shown':>7} {'s':>6} {'µs/line':>8}"
    print(head + f" {'first 10%':>10} {'last 10%':>9}")
    for r in rows:
        print(
            f"{r['ranks']:>5} {r['case']:>8} {r['lines_in']:>9} {r['lines_shown']:>7} "
            f"{r['seconds']:>6.2f} {r['us_per_line']:>8.2f} "
            f"{r['us_per_line_first_tenth']:>10.2f} {r['us_per_line_last_tenth']:>9.2f}"
        )
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
