"""What the panel's saved picture costs: ``render_png`` (matplotlib, Agg) on a filled store.

The ``%dist start`` cell keeps a PNG of the panel's four charts (loss, allreduce, step-time
breakdown, memory) for a saved notebook; ``hvdnb/notebook/panel/layout.py`` draws it in a
background thread once the kernel is idle, and ``%dist stop`` draws a stale one at once.
This bench times that draw in one fresh process: the first call (importing matplotlib and
building the figure included), then ``--repeat`` more, for a store of 2 ranks and one of 64
ranks (the min/max band and host medians), each with ``--steps`` steps of loss, step time,
data time, samples, an allreduce's time, exposed time and bytes, and RSS, ingested as ranks
send them (20 steps a message). No ranks, no kernel: the real ``MetricsStore`` and
``render_png``.

Usage: ``python bench/bench_png.py [--steps 2000] [--repeat 10]``; prints a table and writes
``bench/results/png.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hvdnb.notebook.metrics.store import MetricsStore
from hvdnb.notebook.panel.png import render_png  # matplotlib is imported at the first draw


def filled_store(nranks: int, steps: int, per: int = 20) -> MetricsStore:
    """A store holding ``steps`` steps of every rank, as the flusher sends them."""
    store = MetricsStore()
    for seq, first in enumerate(range(0, steps, per), start=1):
        for rank in range(nranks):
            s = list(range(first, min(first + per, steps)))
            t = [1000.0 + 0.05 * k for k in s]
            col = lambda vals: [s, t, vals]  # noqa: E731
            store.ingest(
                {
                    "rank": rank,
                    "seq": seq,
                    "pid": 1000 + rank,
                    "step": s[-1],
                    "cols": {
                        "loss": col([2.0 * 0.999**k + 0.01 * (rank % 5) for k in s]),
                        "time/step": col([0.05 + 0.001 * (k % 7) for k in s]),
                        "time/data": col([0.01] * len(s)),
                        "samples": col([64.0] * len(s)),
                        "comm/grad/time": col([0.002 + 0.0001 * (k % 3) for k in s]),
                        "comm/grad/exposed": col([0.001] * len(s)),
                        "comm/grad/bytes": col([4.0 * 2**20] * len(s)),
                        "mem/rss": col([5e8 + 1e6 * rank] * len(s)),
                    },
                }
            )
    return store


def time_renders(store: MetricsStore, repeat: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    png = render_png(store)
    first = time.perf_counter() - t0
    later = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        render_png(store)
        later.append(time.perf_counter() - t0)
    return {
        "first_ms": 1e3 * first,
        "median_ms": 1e3 * statistics.median(later),
        "min_ms": 1e3 * min(later),
        "max_ms": 1e3 * max(later),
        "samples_ms": [1e3 * x for x in later],
        "png_kb": len(png) / 1024,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "png.json"))
    args = ap.parse_args(argv)
    rows = []
    for nranks in (2, 64):  # the first row's first draw imports matplotlib
        store = filled_store(nranks, args.steps)
        row = {"ranks": nranks, "steps": args.steps, **time_renders(store, args.repeat)}
        rows.append(row)
    res = {
        "rows": rows,
        "repeat": args.repeat,
        "machine": f"{os.cpu_count()} cores, shared with other work",
        "python": platform.python_version(),
        "load_avg": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(f"render_png, {args.steps} steps (load avg {res['load_avg'][0]:.2f})")
    print(
        f"{'ranks':>5} | {'first draw (ms)':>15} | {'median (ms)':>11} | {'range (ms)':>13} | PNG"
    )
    for r in rows:
        print(
            f"{r['ranks']:>5} | {r['first_ms']:>15.0f} | {r['median_ms']:>11.0f} | "
            f"{r['min_ms']:>5.0f}-{r['max_ms']:<7.0f} | {r['png_kb']:.0f} KiB"
        )
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
