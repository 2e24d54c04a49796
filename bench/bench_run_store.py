"""What the run store costs the notebook: ``bench_scale.py`` with and without ``--run-store``.

The run store (``hvdnb/notebook/metrics/runstore.py``) writes every point the notebook's
store receives to SQLite, so runs outlive the kernel. This bench runs ``bench/bench_scale.py``
(simulated ranks over real ZeroMQ sockets into the real store and a headless panel redrawn
every 50 ms) at 64 and 1,024 ranks, 2 Hz, ``--seconds`` each, once without the run store and
once with it, in that order per size, each in a fresh process (``--run-store`` writes into a
temporary ``HVDNB_HOME``). For each pair it reports the notebook process's CPU (% of a core),
the panel's mean and p95 redraw, and, with the store, the points held against the points on
disk once the writer caught up.

Usage: ``python bench/bench_run_store.py [--seconds 10] [--pairs 1]``; prints a table and
writes ``bench/results/run_store.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIZES = ((64, 4), (1024, 16))  # ranks, hosts


def one(nranks: int, nhosts: int, seconds: float, run_store: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hvdnb-bench-runstore-") as tmp:
        out = Path(tmp) / "scale.json"
        cmd = [
            sys.executable,
            str(ROOT / "bench" / "bench_scale.py"),
            "--ranks",
            str(nranks),
            "--hosts",
            str(nhosts),
            "--seconds",
            str(seconds),
            "--out",
            str(out),
        ] + (["--run-store"] if run_store else [])
        env = dict(os.environ, HVDNB_HOME=tmp)
        subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, timeout=600)
        row: dict[str, Any] = json.loads(out.read_text())
        return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "run_store.json"))
    args = ap.parse_args(argv)
    rows = []
    for _ in range(args.pairs):
        for nranks, nhosts in SIZES:
            for run_store in (False, True):
                rows.append(one(nranks, nhosts, args.seconds, run_store))
    keep = (
        "ranks",
        "run_store",
        "seconds",
        "rows_sent",
        "rows_stored",
        "lost_rows",
        "client_cpu_pct",
        "render_ms_mean",
        "render_ms_p95",
        "points_in_store",
        "points_on_disk",
        "run_store_catch_up_s",
        "load_avg",
    )
    res = {
        "rows": [{k: r.get(k) for k in keep} for r in rows],
        "hz": 2.0,
        "machine": f"{os.cpu_count()} cores, shared with other work",
        "date": time.strftime("%Y-%m-%d"),
    }
    print(f"run store cost, 2 Hz, {args.seconds:g} s per run")
    print(
        f"{'ranks':>5} | {'run store':>9} | {'CPU % core':>10} | {'redraw mean/p95 ms':>18} | "
        f"{'rows sent/stored':>17} | on disk / held | load"
    )
    for r in res["rows"]:
        disk = f"{r['points_on_disk']}/{r['points_in_store']}" if r["run_store"] else "-"
        print(
            f"{r['ranks']:>5} | {'on' if r['run_store'] else 'off':>9} | "
            f"{r['client_cpu_pct']:>10.1f} | "
            f"{r['render_ms_mean']:>8.0f}/{r['render_ms_p95']:<9.0f} | "
            f"{r['rows_sent']:>8}/{r['rows_stored']:<8} | {disk} | {r['load_avg'][0]:.2f}"
        )
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
