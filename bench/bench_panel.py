"""Live panel costs: training overhead, log-to-widget latency, and 64 simulated ranks.

Run: ``python bench/bench_panel.py [--blocks 60] [--block-seconds 1] [--slice-seconds 0.1]
[--models mid,mlp,small] [--skip-scale]``.
Three parts:

1. overhead, at three step sizes: a real 2-rank cluster (1 torch thread per rank, hvdnb
   DistributedOptimizer) trains a ~1 ms step (``mid``: 256-256-128-10, batch 64), the MLP
   of ``bench_mlp.py`` (``mlp``: 784-512-512-10, batch 64, 6-8.5 ms) and the teaching
   notebooks' size (``small``: 64-32-10, batch 32, ~0.5 ms), one cell each, in three
   modes: ``steady`` (``hvdnb.log`` every step, the allreduce listener, messages every
   ``flush_interval_steady``, as in a loop past its first seconds), ``warm`` (messages
   every ``flush_interval``, collectives sampled densely: a loop's first seconds) and
   ``off`` (the loop does not call ``hvdnb.log`` and ``hvdnb.metrics.set_enabled(False)``
   unregisters the listener: a loop that never logs). A block is ``--block-seconds`` of
   training in each mode, cut into slices of ``--slice-seconds`` interleaved with the
   other two modes' slices (the order turning through all six permutations): this box's
   speed drifts by +-20 % over seconds, and slices this close see the same speed (per
   block on/off ratios scatter by ~5 %, against ~12 % for adjacent 0.25 s blocks); 0.1 s
   slices hold most of the work a message sets off (the notebook's redraw follows it
   within ~50 ms). Each mode's message clock, sampling grids and listener state carry
   over from its previous slice, so it sends and times collectives as often per step as a
   loop in that mode would. Block time: max over ranks. Overhead of a mode = median over
   blocks of (its block / the off block) - 1 (the issue's statistic) with a 95 %
   bootstrap interval, and the mean (total on / total off - 1). Then 4 steady blocks of
   ~1 s time, inside the loop, each ``hvdnb.log`` call and each collective's report (``in
   loop us/step``: the ranks' direct cost, free of the machine's noise), and the CPU of
   each rank's threads other than the training thread (side channel, MPI) by mode.
   Then the second way, in a cell of its own (``--ab-pairs`` pairs of ``--ab-steps``-step
   blocks, after 3 s of logging): a plain loop that switches
   ``hvdnb.metrics.set_enabled`` between blocks, ``hvdnb.log`` every step when on, the
   order alternating pair by pair, nothing carried over by hand; the same statistics.
2. latency: from a rank's ``hvdnb.log`` call (its timestamp) to the panel's widget model
   holding that point, for every loss point of the "on" blocks.
3. scale: one process stands in for 64 ranks (64 real ``EngineChannel`` sockets and 64
   ``Recorder`` objects), each logging 10 steps/s and flushing every 100 ms for
   ``--scale-seconds`` (default 60) into the real ``ClientChannel``, store and panel;
   reports points sent vs stored, sequence gaps and the notebook process's CPU.

Prints a table and writes ``bench/results/panel.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: the step sizes measured (off-step times on this 2-core box in brackets)
MODELS = {
    "mid": {"layers": [256, 256, 128, 10], "batch": 64},  # ~1.0-1.1 ms
    "mlp": {"layers": [784, 512, 512, 10], "batch": 64},  # ~6-7 ms (bench_mlp.py's MLP)
    "small": {"layers": [64, 32, 10], "batch": 32},  # ~0.5 ms (teaching notebooks)
}

# both cells' model, batch and loss (the same on both ranks but the batch)
SETUP = r"""
import itertools, time, torch, hvdnb
import hvdnb.torch as hvd
from mpi4py import MPI
hvd.init()
torch.set_num_threads(1)
comm = MPI.COMM_WORLD
torch.manual_seed(0)
sizes = __LAYERS__
layers = []
for a, b in zip(sizes[:-1], sizes[1:]):
    layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers[:-1])
torch.manual_seed(1 + hvd.rank())
X, Y = torch.randn(__BATCH__, sizes[0]), torch.randint(0, sizes[-1], (__BATCH__,))
loss_fn = torch.nn.CrossEntropyLoss()
"""

CELL = (
    SETUP
    + r"""
rec = hvdnb.metrics.get_recorder()  # registers the allreduce listener (hvdnb.torch is loaded)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
step = 0
warm = rec.clock.warm
# each "on" mode is a loop of its own that pauses while the other modes run: its message
# clock (time left to the next message), sampling grids and listener state are put back at
# the start of each of its slices, so it sends and times collectives as often per step as
# a loop in that mode would
saved = {}
def run(n, mode, cpu=None):
    global step
    on = mode != "off"
    hvdnb.metrics.set_enabled(on)
    # "steady": messages every flush_interval_steady, as in a loop past its first seconds;
    # "warm": every flush_interval, as in a loop's first flush_warm seconds
    rec.clock.warm = 0.0 if mode == "steady" else float("inf")
    if on:
        sv = saved.get(mode)
        if sv is not None:
            rec.comm_every, rec.flusher.grid, rec.flusher.due_cell = sv[2], sv[3], sv[4]
        rec.comm.switch(step % rec.comm_every == 0)  # as log() of the previous step would
    comm.Barrier()
    c0, th0 = time.process_time(), time.thread_time()
    t0 = time.perf_counter()
    if on:
        if sv is not None and rec._due:
            rec._due, rec.flusher.due_late = t0 + sv[0], t0 + sv[1]
        for _ in range(n):
            opt.zero_grad()
            loss = loss_fn(model(X), Y)
            loss.backward()
            opt.step()
            hvdnb.log(step, loss, samples=__BATCH__)
            step += 1
        now = time.perf_counter()
        saved[mode] = (rec._due - now, rec.flusher.due_late - now, rec.comm_every, rec.flusher.grid,
                       rec.flusher.due_cell)
    else:  # a loop that never logs
        for _ in range(n):
            opt.zero_grad()
            loss = loss_fn(model(X), Y)
            loss.backward()
            opt.step()
            step += 1
    wall = time.perf_counter() - t0
    if cpu is not None:  # the training thread's CPU and the process's other threads'
        th = time.thread_time() - th0
        c = cpu[mode]
        c[0] += th
        c[1] += time.process_time() - c0 - th
        c[2] += n
    return comm.allreduce(wall, op=MPI.MAX)
MODES = ("steady", "warm", "off")
per = run(200, "off") / 200  # the same on every rank (a max over ranks)
# a block: ~__BLOCK_S__ s of each mode, in slices of ~__SLICE_S__ s interleaved with the
# other modes' (the order turning through the six permutations): the three see the same
# machine speed, which drifts by +-20 % over seconds here
slice_steps = max(4, round(__SLICE_S__ / per))
slices = max(1, round(__BLOCK_S__ / (slice_steps * per)))
for m in MODES * 3:
    run(slice_steps, m)
PERMS = list(itertools.permutations(MODES))
res = {m: [] for m in MODES}
cpu_log = []
k = 0
for b in range(__BLOCKS__):
    tot = dict.fromkeys(MODES, 0.0)
    cpu = {m: [0.0, 0.0, 0] for m in MODES}
    for _ in range(slices):
        for m in PERMS[k % 6]:
            tot[m] += run(slice_steps, m, cpu)
        k += 1
    for m in MODES:
        res[m].append(tot[m] / (slices * slice_steps))
        cpu_log.append((m, cpu[m][0] / cpu[m][2], cpu[m][1] / cpu[m][2]))
res["steps"] = slice_steps
res["slices"] = slices
# in the loop, precisely: seconds per step inside hvdnb.log (its share of each message's
# drain, pack and send included) and inside the report of each timed collective (listener
# and queueing), perf_counter around each call, steady mode
from hvdnb.torch import rounds
pc = time.perf_counter
acc = [0.0, 0.0]
report = rounds.Handle.report
def timed_report(self):
    t = pc()
    report(self)
    acc[1] += pc() - t
hvdnb.metrics.set_enabled(True)
rec.clock.warm = 0.0
probe = []
n_probe = slice_steps * slices  # a block's steps, ~1 s
for b in range(4):
    rounds.Handle.report = timed_report
    acc[:] = [0.0, 0.0]
    comm.Barrier()
    for _ in range(n_probe):
        opt.zero_grad()
        loss = loss_fn(model(X), Y)
        loss.backward()
        opt.step()
        t = pc()
        hvdnb.log(step, loss, samples=__BATCH__)
        acc[0] += pc() - t
        step += 1
    rounds.Handle.report = report
    probe.append([a / n_probe for a in acc])
res["in_loop"] = probe
res["cpu"] = cpu_log
rec.clock.warm = warm
rec.flush()
res
"""
)


# The second method (issue #26): an A/B inside one plain loop, nothing carried over by hand.
# Pairs of blocks of the same number of steps, ``set_enabled(True)`` with ``hvdnb.log``
# every step against ``set_enabled(False)`` without it, the order alternating pair by pair;
# a few seconds of logging first, so the loop is past its warm seconds as a user's is.
CELL_AB = (
    SETUP
    + r"""
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
step = 0
def block(on, n):
    global step
    hvdnb.metrics.set_enabled(on)
    comm.Barrier()
    t0 = time.perf_counter()
    if on:
        for _ in range(n):
            opt.zero_grad()
            loss = loss_fn(model(X), Y)
            loss.backward()
            opt.step()
            hvdnb.log(step, loss, samples=__BATCH__)
            step += 1
    else:
        for _ in range(n):
            opt.zero_grad()
            loss = loss_fn(model(X), Y)
            loss.backward()
            opt.step()
            step += 1
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) / n
t_end = time.perf_counter() + 3.0
while comm.allreduce(time.perf_counter() < t_end, op=MPI.LAND):
    block(True, 50)
ab = {"on": [], "off": []}
for i in range(__PAIRS__):
    for on in ((True, False) if i % 2 == 0 else (False, True)):
        ab["on" if on else "off"].append(block(on, __STEPS__))
hvdnb.metrics.set_enabled(True)
ab
"""
)


def ab_code(model: str, pairs: int, steps: int) -> str:
    m = MODELS[model]
    return (
        CELL_AB.replace("__LAYERS__", repr(m["layers"]))
        .replace("__BATCH__", str(m["batch"]))
        .replace("__PAIRS__", str(pairs))
        .replace("__STEPS__", str(steps))
    )


def cell_code(model: str, blocks: int, block_s: float, slice_s: float) -> str:
    m = MODELS[model]
    return (
        CELL.replace("__LAYERS__", repr(m["layers"]))
        .replace("__BATCH__", str(m["batch"]))
        .replace("__BLOCKS__", str(blocks))
        .replace("__BLOCK_S__", repr(block_s))
        .replace("__SLICE_S__", repr(slice_s))
    )


def interleaved_overhead(on: list[float], off: list[float]) -> dict:
    """Overhead of a mode's blocks against the ``off`` blocks they are interleaved with:
    the median of the per-block ratios and the mean (total on / total off), each - 1, in
    %, with 95 % bootstrap intervals over blocks."""
    pairs = list(zip(on, off))
    rng = random.Random(0)

    def median(ps: list) -> float:
        return 100 * (statistics.median(a / b for a, b in ps) - 1)

    def mean(ps: list) -> float:
        return 100 * (sum(a for a, _ in ps) / sum(b for _, b in ps) - 1)

    out: dict = {
        "blocks": len(pairs),
        "step_ms_on": 1e3 * statistics.median(on),
        "step_ms_off": 1e3 * statistics.median(off),
        "samples_ms": {"on": [1e3 * x for x in on], "off": [1e3 * x for x in off]},
    }
    for name, est in (("median", median), ("mean", mean)):
        boot = sorted(est(rng.choices(pairs, k=len(pairs))) for _ in range(2000))
        out[f"{name}_pct"] = est(pairs)
        out[f"{name}_pct_ci95"] = (boot[50], boot[1949])
    return out


def overhead_and_latency(
    blocks: int,
    models: list[str],
    block_s: float,
    slice_s: float,
    ab_pairs: int = 40,
    ab_steps: int = 120,
) -> dict:
    import hvdnb
    from hvdnb.notebook.cellout import cells
    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel.panel import Panel

    store = MetricsStore()
    out: dict = {}
    with hvdnb.Cluster(n=2) as cluster:
        store.attach(cluster)
        panel = Panel(store)
        panel.measure_latency = True
        cells.add_wait_hook(panel.tick)
        cpu0, t0 = os.times(), time.perf_counter()
        try:
            for model in models:
                t_model = time.time()
                res = cells.run_cell(
                    cluster, cell_code(model, blocks, block_s, slice_s), quiet=True, stream=False
                )
                v = res.values[0]
                r = {mode: interleaved_overhead(v[mode], v["off"]) for mode in ("steady", "warm")}
                per_rank = [x["in_loop"] for x in res.values.values()]
                r["in_loop_us"] = {  # median over blocks, max over ranks
                    "log": 1e6 * max(statistics.median(b[0] for b in p) for p in per_rank),
                    "comm_report": 1e6 * max(statistics.median(b[1] for b in p) for p in per_rank),
                }
                r["steps_per_slice"], r["slices_per_block"] = v["steps"], v["slices"]
                r["layers"], r["batch"] = MODELS[model]["layers"], MODELS[model]["batch"]
                r["hot_path_us_per_step"] = hot_path_cost()
                r["cpu_us_per_step"] = cpu_accounting(res.values)
                if ab_pairs:
                    res = cells.run_cell(
                        cluster, ab_code(model, ab_pairs, ab_steps), quiet=True, stream=False
                    )
                    v = res.values[0]
                    r["ab"] = {**interleaved_overhead(v["on"], v["off"]), "steps": ab_steps}
                r["minutes"] = (time.time() - t_model) / 60
                out[model] = r
        finally:
            cells.remove_wait_hook(panel.tick)
        wall = time.perf_counter() - t0
        cpu1 = os.times()
        panel.close()
    lat = sorted(panel.latencies)
    out.update(
        {
            "latency_ms_p50": 1e3 * lat[len(lat) // 2] if lat else None,
            "latency_ms_p95": 1e3 * lat[int(0.95 * (len(lat) - 1))] if lat else None,
            "latency_points": len(lat),
            "panel_renders": panel.renders,
            "panel_render_ms_mean": 1e3 * panel.render_seconds / max(1, panel.renders),
            "notebook_cpu_pct": 100
            * ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system))
            / wall,
            "points": store.points,
            "lost_messages": store.lost_messages,
        }
    )
    return out


def cpu_accounting(values: dict) -> dict:
    """CPU per step by mode (median over blocks, mean over ranks): each rank's training
    thread (``thread_time``; it includes MPI's busy wait for a late peer, so it moves with
    the machine's noise) and its other threads (``process_time`` minus it: side channel,
    MPI's own). On a 2-core box where 2 ranks in lockstep keep both cores busy, CPU that a
    side thread (or the notebook) takes delays one rank and its peer waits for it."""
    out: dict = {}
    modes = dict.fromkeys(b[0] for v in values.values() for b in v["cpu"])
    for mode in modes:

        def per_rank(col: int, mode: str = mode) -> float:
            meds = [
                statistics.median(b[col] for b in v["cpu"] if b[0] == mode) for v in values.values()
            ]
            return sum(meds) / len(meds)

        out[mode] = {"train_thread_us": 1e6 * per_rank(1), "other_threads_us": 1e6 * per_rank(2)}
    return out


def hot_path_cost() -> dict:
    """What streaming adds to one MLP step on a rank, measured without machine noise:
    ``log`` + one bucket's allreduce record, and the pack of 20 steps with its encoding
    for the wire (``hvdnb.protocol.wire.encode``: JSON, binary columns, signature)."""
    import timeit

    from hvdnb.protocol.kinds import Kind, outgoing
    from hvdnb.protocol.wire import encode
    from hvdnb.rank.metrics.recorder import Recorder

    class Sink:
        def send(self, kind: Kind, **payload: object) -> None:
            encode(b"k" * 32, {**outgoing(kind, dict(payload)), "rank": 0})

    rec = Recorder(0, Sink(), flush_interval=100.0)
    rec.flusher.start = lambda: None  # type: ignore[method-assign]
    n = 20000

    def one() -> None:
        rec.log(3, 0.5, samples=64)
        rec.on_comm("DistributedOptimizer.bucket.0", 1 << 20, 0.002, "mpi")

    per_step = timeit.timeit(one, number=n) / n
    rec.flush()
    flushes = []
    for _ in range(50):
        for s in range(20):
            one()
        t0 = time.perf_counter()
        rec.flush()
        flushes.append(time.perf_counter() - t0)
    flush = statistics.median(flushes)
    return {
        "log_and_comm_us": 1e6 * per_step,
        "flush_20_steps_us": 1e6 * flush,
        "total_us": 1e6 * (per_step + flush / 20),
    }


SENDER = r"""
import json, os, sys, time
sys.path.insert(0, os.environ["HVDNB_ROOT"])
from hvdnb.rank.channel import EngineChannel
from hvdnb.rank.metrics.recorder import Recorder
endpoint, key, n, seconds = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), float(sys.argv[4])
recs = [Recorder(r, EngineChannel(endpoint, key, r), flush_interval=0.1, capacity=1024)
        for r in range(n)]
time.sleep(1.0)  # let every socket connect (the hello messages) before the clock starts
t0 = time.perf_counter()
step = 0
next_t = t0
while time.perf_counter() - t0 < seconds:
    for r, rec in enumerate(recs):
        rec.log(step, 1.0 / (1 + step) + 0.001 * r, samples=64)
        rec.on_comm("DistributedOptimizer.bucket.0", 1 << 20, 0.002 + 1e-5 * r, "gloo")
    step += 1
    next_t += 0.1
    time.sleep(max(0.0, next_t - time.perf_counter()))
for rec in recs:  # each rank's own flusher thread sent every 100 ms; a last flush now
    rec.close()
sent_rows = sum(rec.ring.w for rec in recs)
msgs = sum(rec.seq for rec in recs)
for rec in recs:
    rec.channel.close()
print(json.dumps({"rows": sent_rows, "messages": msgs, "steps": step,
                  "seconds": time.perf_counter() - t0}))
"""


def scale(nranks: int, seconds: float) -> dict:
    from hvdnb.notebook.cluster.channel import ClientChannel
    from hvdnb.notebook.metrics.store import MetricsStore
    from hvdnb.notebook.panel.panel import Panel
    from hvdnb.protocol import kinds

    key = secrets.token_hex(16).encode()
    ch = ClientChannel(key=key)
    store = MetricsStore()
    store._channel = ch
    ch.on(kinds.METRICS, store.ingest)
    panel = Panel(store)
    env = dict(os.environ, HVDNB_ROOT=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", SENDER, ch.endpoint, key.decode(), str(nranks), str(seconds)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    cpu0, t0 = os.times(), time.perf_counter()
    while proc.poll() is None:  # the notebook's main thread: redraw as the wait hook would
        panel.tick()
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    cpu1 = os.times()
    sent = json.loads(proc.stdout.read().strip().splitlines()[-1])
    deadline = time.monotonic() + 10
    # every row logged is a stored point; memory readings (one per flush) come on top
    while time.monotonic() < deadline and store.messages < sent["messages"]:
        time.sleep(0.05)
    logged = sum(1 for r in store.rows() if not r.name.startswith("mem/"))
    panel.tick(final=True)
    ch.close()
    panel.close()
    return {
        "ranks": nranks,
        "seconds": sent["seconds"],
        "rate_hz": 10,
        "rows_sent": sent["rows"],
        "rows_stored": logged,
        "messages_sent": sent["messages"],
        "messages_stored": store.messages,
        "lost_messages": store.lost_messages,
        "lost_rows": store.lost_rows,
        "bad_signatures": ch.dropped,
        "client_cpu_pct": 100 * ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / wall,
        "panel_renders": panel.renders,
        "panel_render_ms_mean": 1e3 * panel.render_seconds / max(1, panel.renders),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--scale-seconds", type=float, default=60.0, help="length of the 64-rank run (default 60 s)"
    )
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument(
        "--blocks",
        type=int,
        default=60,
        help="blocks per mode and model (each mode's block interleaved with the "
        "other two modes' blocks)",
    )
    ap.add_argument("--block-seconds", type=float, default=1.0, help="training time of one block")
    ap.add_argument(
        "--slice-seconds",
        type=float,
        default=0.1,
        help="blocks are interleaved in slices of this length",
    )
    ap.add_argument(
        "--models",
        default="mid,mlp,small",
        help="step sizes to measure: mid (~1 ms), mlp (~6-8.5 ms), small (~0.5 ms)",
    )
    ap.add_argument(
        "--ab-pairs",
        type=int,
        default=40,
        help="pairs of blocks of the in-loop A/B (set_enabled on/off between blocks; 0: skip)",
    )
    ap.add_argument("--ab-steps", type=int, default=120, help="steps per A/B block")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "panel.json"))
    args = ap.parse_args()
    if args.blocks < 10:
        ap.error(
            f"--blocks {args.blocks}: at least 10 blocks are needed for a median worth reading"
        )
    out: dict = {
        "machine": f"{os.cpu_count()} cores, shared with other engineers' work",
        "command": " ".join(["python"] + sys.argv),
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "load_avg_start": os.getloadavg(),
    }
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    if not args.skip_overhead:
        out["overhead"] = overhead_and_latency(
            args.blocks,
            models,
            args.block_seconds,
            args.slice_seconds,
            args.ab_pairs,
            args.ab_steps,
        )
    if not args.skip_scale:
        out["scale"] = scale(args.ranks, args.scale_seconds)
    out["load_avg_end"] = os.getloadavg()
    o, s = out.get("overhead"), out.get("scale")
    print(
        "live panel benchmark (2 cores shared with other work; load avg "
        f"{out['load_avg_start'][0]:.2f} -> {out['load_avg_end'][0]:.2f})"
    )
    if o:
        print(
            "overhead of watching = (block with hvdnb.log + panel) / (off block interleaved "
            "with it) - 1; median over blocks, and mean (total on / total off); 95 % bootstrap "
            "intervals. steady: a loop past its first 2 s; warm: its first 2 s"
        )
        print(
            f"{'step size':<9} | {'off ms':>6} | {'blocks x steps':>14} | "
            f"{'steady median':>22} | {'steady mean':>22} | {'warm median':>22} | "
            f"{'in loop us/step':>15} | target"
        )
        for m in models:
            r = o[m]
            st, wa = r["steady"], r["warm"]
            il = r["in_loop_us"]
            hp = il["log"] + il["comm_report"]

            def fmt(x: dict, k: str) -> str:
                lo, hi = x[f"{k}_pct_ci95"]
                return f"{x[f'{k}_pct']:+5.2f}% ({lo:+5.2f}..{hi:+5.2f})"

            spb = r["steps_per_slice"] * r["slices_per_block"]
            print(
                f"{m:<9} | {st['step_ms_off']:6.3f} | {st['blocks']:>5} x {spb:<6} | "
                f"{fmt(st, 'median'):>22} | {fmt(st, 'mean'):>22} | {fmt(wa, 'median'):>22} | "
                f"{hp:7.1f} {100 * hp / (1e3 * st['step_ms_off']):5.2f}% | <= 2 %"
            )
        if any("ab" in o[m] for m in models):
            print(
                "the same, measured the second way: an A/B inside one loop, set_enabled(True) "
                "with hvdnb.log every step against set_enabled(False) without, blocks in "
                "alternating order (median of the per-pair ratios, mean; 95 % bootstrap)"
            )
            for m in models:
                ab = o[m].get("ab")
                if ab:
                    print(
                        f"{m:<9} | {ab['step_ms_off']:6.3f} | {ab['blocks']:>5} x "
                        f"{ab['steps']:<6} | {fmt(ab, 'median'):>22} | {fmt(ab, 'mean'):>22} | "
                        f"{'':>22} | {'':>15} | <= 2 %"
                    )
        print(
            "CPU per step beside the training thread, steady / off (side channel, MPI; "
            "median over blocks, mean over ranks)"
        )
        for m in models:
            c = o[m]["cpu_us_per_step"]
            on, off = c["steady"], c["off"]
            print(
                f"{m:<9} | rank's other threads {on['other_threads_us']:5.1f} / "
                f"{off['other_threads_us']:5.1f} us"
            )
        print(f"{'measure':<44} | {'value':>12} | target")
        print(f"{'log() -> widget model latency p50 (ms)':<44} | {o['latency_ms_p50']:12.0f} |")
        print(
            f"{'log() -> widget model latency p95 (ms)':<44} | {o['latency_ms_p95']:12.0f} | <= 1.5 x steady interval"
        )
        print(
            f"{'notebook CPU during training (% of a core)':<44} | {o['notebook_cpu_pct']:12.1f} |"
        )
    if s:
        label = f"{s['ranks']} ranks x 10 Hz, seconds"
        print(f"{label:<44} | {s['seconds']:12.1f} |")
        print(f"{'rows sent / stored':<44} | {s['rows_sent']:>6}/{s['rows_stored']:<6}| equal")
        print(
            f"{'messages sent / stored / seq gaps':<44} | {s['messages_sent']}/{s['messages_stored']}/{s['lost_messages']} | no gap"
        )
        print(f"{'client CPU (% of a core)':<44} | {s['client_cpu_pct']:12.1f} |")
        print(f"{'panel render at 64 ranks (mean ms)':<44} | {s['panel_render_ms_mean']:12.1f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
