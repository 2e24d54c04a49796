"""Metrics at scale: 1,024 simulated ranks at 2 Hz for 60 s into the notebook's store and panel.

Run: ``python bench/bench_scale.py [--ranks 1024] [--hosts 16] [--seconds 60] [--hz 2]``,
or ``--quick`` (128 ranks, 6 s: what the test suite runs). One sender process stands in
for every rank: it opens one real ZeroMQ DEALER socket per rank (as each rank's
``EngineChannel`` does) to the real ``ClientChannel``, says each rank's host once
(``rank_info``, ranks spread over ``--hosts`` hosts), then every ``1/hz`` seconds sends
each rank one signed ``metrics`` message in the recorder's format (one step: loss, step
time, samples, allreduce time and bytes, RSS). The notebook side is the real
``MetricsStore`` and a headless ``Panel`` redrawn every 50 ms, as a running cell's wait
hook does (min/max band, one median line per host, the per-host table).

Reports rows and messages sent vs stored, sequence gaps, the notebook process's CPU and
memory growth, and the panel's render times; prints a table and writes
``bench/results/scale.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SENDER = r"""
import json, os, random, sys, time
sys.path.insert(0, os.environ["HVDNB_ROOT"])
import zmq
from hvdnb.protocol.wire import encode
endpoint, key, nranks, nhosts, seconds, hz = (sys.argv[1], sys.argv[2].encode(),
    int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6]))
ctx = zmq.Context.instance()
ctx.set(zmq.MAX_SOCKETS, nranks + 64)
socks = []
for r in range(nranks):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 5000)
    s.setsockopt(zmq.SNDHWM, 100000)
    s.connect(endpoint)
    socks.append(s)
per_host = -(-nranks // nhosts)
for r, s in enumerate(socks):
    s.send_multipart(encode(key, {"kind": "rank_info", "rank": r, "host": f"node{r // per_host:03d}",
                                  "local_rank": r % per_host, "pid": 10000 + r}))
rng = random.Random(0)
rows = msgs = 0
period = 1.0 / hz
t0 = time.time()
step = 0
late = 0
while True:
    tick = t0 + step * period
    now = time.time()
    if now - t0 >= seconds:
        break
    if tick > now:
        time.sleep(tick - now)
    else:
        late += 1
    now = time.time()
    for r, s in enumerate(socks):
        st = 0.05 + 0.01 * rng.random() + 0.02 * (r // per_host == 0)
        loss = 2.0 * (0.99 ** step) * (1 + 0.05 * rng.random())
        cols = {"loss": [[step], [now], [loss]], "time/step": [[step], [now], [st]],
                "samples": [[step], [now], [64.0]], "comm/grad/time": [[step], [now], [0.2 * st]],
                "comm/grad/bytes": [[step], [now], [4.0 * 2 ** 20]],
                "mem/rss": [[step], [now], [5e8 + r]]}
        s.send_multipart(encode(key, {"kind": "metrics", "rank": r, "seq": step + 1,
            "pid": 10000 + r, "t": now, "cols": cols, "lost": 0, "step": step,
            "step_time": st, "backend": "gloo", "idle": False}))
        rows += 5
        msgs += 1
    step += 1
for s in socks:
    s.close()
ctx.term()
print(json.dumps({"rows": rows, "messages": msgs, "steps": step, "late_ticks": late,
                  "seconds": time.time() - t0}))
"""


def run(nranks: int, nhosts: int, seconds: float, hz: float, run_store: bool = False) -> dict:
    import psutil

    from hvdnb.notebook.cluster.channel import ClientChannel
    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel.panel import Panel
    from hvdnb.protocol import kinds

    me = psutil.Process()
    rss0 = me.memory_info().rss
    key = secrets.token_hex(16).encode()
    ch = ClientChannel(key=key)
    if run_store:  # the notebook's store writes every point to a run store in a temp home
        import tempfile

        os.environ["HVDNB_HOME"] = tempfile.mkdtemp(prefix="hvdnb-bench-home-")
    store = MetricsStore(keep_runs=run_store)
    store._channel = ch
    ch.on(kinds.METRICS, store.ingest)
    ch.on(kinds.RANK_INFO, store.on_rank_info)
    panel = Panel(store)
    env = dict(os.environ, HVDNB_ROOT=str(ROOT))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SENDER,
            ch.endpoint,
            key.decode(),
            str(nranks),
            str(nhosts),
            str(seconds),
            str(hz),
        ],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    renders: list[float] = []
    gaps: list[float] = []  # time between two ticks of the main loop: responsiveness
    cpu0, t0 = me.cpu_times(), time.perf_counter()
    last = time.perf_counter()
    while proc.poll() is None:  # the notebook's main thread, as the cell's wait hook runs
        t = time.perf_counter()
        gaps.append(t - last)  # includes the previous tick's redraw and the 50 ms sleep
        last = t
        n = panel.renders
        panel.tick()
        if panel.renders > n:
            renders.append(time.perf_counter() - t)
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    cpu1 = me.cpu_times()
    sent = json.loads(proc.stdout.read().strip().splitlines()[-1])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and store.messages < sent["messages"]:
        time.sleep(0.05)
    logged = sum(1 for r in store.rows() if not r.name.startswith("mem/"))
    on_disk, flush_s = None, None
    if run_store:  # every point the store holds is on disk once the writer caught up
        import sqlite3

        t = time.perf_counter()
        path = store.run_log.store().path
        flush_s = time.perf_counter() - t
        con = sqlite3.connect(path)
        on_disk = con.execute("SELECT sum(n) FROM points").fetchone()[0]
        con.close()
    t = time.perf_counter()
    panel.render(force=True)
    final_ms = 1e3 * (time.perf_counter() - t)
    view = panel.view.value
    rss1 = me.memory_info().rss
    hosts = store.hosts()
    ch.close()
    panel.close()
    rs = sorted(renders) or [0.0]
    return {
        "ranks": nranks,
        "hosts": nhosts,
        "hz": hz,
        "seconds": sent["seconds"],
        "rows_sent": sent["rows"],
        "rows_stored": logged,
        "messages_sent": sent["messages"],
        "messages_stored": store.messages,
        "lost_messages": store.lost_messages,
        "lost_rows": store.lost_rows,
        "bad_signatures": ch.dropped,
        "sender_late_ticks": sent["late_ticks"],
        "client_cpu_pct": 100 * ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / wall,
        "client_rss_growth_mb": (rss1 - rss0) / 2**20,
        "client_rss_mb": rss1 / 2**20,
        "panel_renders": len(renders),
        "render_ms_mean": 1e3 * statistics.fmean(rs),
        "render_ms_p95": 1e3 * rs[int(0.95 * (len(rs) - 1))],
        "render_ms_max": 1e3 * rs[-1],
        "final_render_ms": final_ms,
        "main_loop_gap_ms_max": 1e3 * max(gaps or [0.0]),
        "hosts_seen": len(hosts),
        "band_drawn": "hvdnb-chart" in view and "hosts</b>" in view,
        "panel_html_kb": len(view) / 1024,
        "run_store": run_store,
        "points_in_store": store.points,
        "points_on_disk": on_disk,
        "run_store_catch_up_s": flush_s,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--hosts", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--hz", type=float, default=2.0)
    ap.add_argument("--quick", action="store_true", help="128 ranks for 6 s (the test suite's)")
    ap.add_argument(
        "--run-store", action="store_true", help="also write every point to the run store"
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "scale.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.hosts, args.seconds = 128, 4, 6.0
    res = run(args.ranks, args.hosts, args.seconds, args.hz, args.run_store)
    res["machine"] = f"{os.cpu_count()} cores, shared with other work"
    res["load_avg"] = os.getloadavg()
    r = res
    print(
        f"metrics at scale: {r['ranks']} ranks on {r['hosts']} hosts x {r['hz']:g} Hz for "
        f"{r['seconds']:.0f} s (load avg {r['load_avg'][0]:.2f})"
    )
    print(f"{'measure':<42} | {'value':>16} | target")
    rows = [
        ("rows sent / stored", f"{r['rows_sent']}/{r['rows_stored']}", "equal"),
        ("messages sent / stored", f"{r['messages_sent']}/{r['messages_stored']}", "equal"),
        ("sequence gaps / bad signatures", f"{r['lost_messages']}/{r['bad_signatures']}", "0/0"),
        ("client CPU (% of a core)", f"{r['client_cpu_pct']:.1f}", ""),
        ("client RSS growth (MiB)", f"{r['client_rss_growth_mb']:.0f}", ""),
        (
            "panel render mean / p95 / max (ms)",
            f"{r['render_ms_mean']:.0f}/{r['render_ms_p95']:.0f}/{r['render_ms_max']:.0f}",
            "p95 <= 500",
        ),
        (
            "longest main-loop gap, 50 ms sleep incl. (ms)",
            f"{r['main_loop_gap_ms_max']:.0f}",
            "<= 500",
        ),
        ("panel renders", f"{r['panel_renders']}", ""),
        ("hosts grouped / band + host table drawn", f"{r['hosts_seen']}/{r['band_drawn']}", ""),
        ("panel HTML (KiB)", f"{r['panel_html_kb']:.0f}", ""),
        (
            "run store: points held / on disk",
            f"{r['points_in_store']}/{r['points_on_disk']}",
            "equal" if r["run_store"] else "off",
        ),
    ]
    for name, val, target in rows:
        print(f"{name:<42} | {val:>16} | {target}")
    if not args.quick:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"wrote {args.out}")
    return res


if __name__ == "__main__":
    main()
