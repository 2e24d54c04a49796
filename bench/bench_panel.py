"""Live panel costs: training overhead, log-to-widget latency, and 64 simulated ranks.

Run: ``python bench/bench_panel.py [--blocks 16] [--fine-pairs 200] [--models small,mlp]
[--skip-scale]``.
Three parts:

1. overhead, at three step sizes: a real 2-rank cluster (1 torch thread per rank, hvdnb
   DistributedOptimizer) trains the teaching notebooks' size (``small``: 64-32-10, batch
   32, 0.2-0.3 ms per step on the 2-core box), a ~1 ms step (``mid``: 256-256-256-10,
   batch 64) and the MLP of ``bench_mlp.py`` (``mlp``: 784-512-512-10, batch 64, 4-8 ms),
   one cell each. Blocks of ~2 s (several flush intervals each, steady ones included)
   alternate panel streaming on (``hvdnb.log`` every step, the allreduce listener, the
   messages, the notebook's store and a headless panel redrawing from the cell's wait
   hook; the block ends with its own last flush) and off (the loop does not call
   ``hvdnb.log`` and ``hvdnb.metrics.set_enabled(False)`` unregisters the allreduce
   listener: a loop that never logs); the block time is the max over ranks, the overhead
   the median of the ratios of adjacent on/off blocks, with a 95 % bootstrap interval.
   Then ``--fine-pairs`` pairs of short blocks (~0.25 s, on and off alternating, no
   flush at a block's end): this box's speed drifts by ±20 % over seconds, and blocks
   this close see the same speed; the estimate is total time on / total time off - 1 (a
   mean, so each message's cost counts in the block where it falls), with a bootstrap
   interval over pairs. Then 4 more steady blocks time, inside the loop, each
   ``hvdnb.log`` call and each collective's report (``in loop us/step``: the ranks'
   direct cost, free of the machine's noise). CPU accounting for the rest: each rank's
   threads other than the training thread (side channel, flusher, MPI) and the
   notebook process, on vs off blocks: CPU they take on a 2-core box delays a rank.
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
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: the step sizes measured: the MLP of bench_mlp.py, a ~1 ms step and the teaching
#: notebooks' size; steps per block make blocks of ~2 s on the 2-core box
MODELS = {
    "mlp": {"layers": [784, 512, 512, 10], "batch": 64, "steps": 500},
    "mid": {"layers": [256, 256, 256, 10], "batch": 64, "steps": 2000},
    "small": {"layers": [64, 32, 10], "batch": 32, "steps": 8000},
}

CELL = r"""
import time, torch, hvdnb
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
rec = hvdnb.metrics.get_recorder()  # registers the allreduce listener (hvdnb.torch is loaded)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
step = 0
warm = rec.warm
def run(n, mode, flush=True):
    global step
    on = mode != "off"
    hvdnb.metrics.set_enabled(on)
    # "steady": messages every flush_interval_steady, as in a loop past its first seconds;
    # "warm": every flush_interval, as in a loop's first flush_warm seconds
    rec.warm = 0.0 if mode == "steady" else float("inf")
    comm.Barrier()
    w0, c0, th0 = time.time(), time.process_time(), time.thread_time()
    t0 = time.perf_counter()
    if on:
        for _ in range(n):
            opt.zero_grad()
            loss = loss_fn(model(X), Y)
            loss.backward()
            opt.step()
            hvdnb.log(step, loss, samples=__BATCH__)
            step += 1
    else:  # a loop that never logs
        for _ in range(n):
            opt.zero_grad()
            loss = loss_fn(model(X), Y)
            loss.backward()
            opt.step()
            step += 1
    if on and flush:  # what is still unsent is this block's cost (a cell's end flushes too)
        rec.flush()
    wall = time.perf_counter() - t0
    # CPU accounting: the training thread's own CPU, and the process's other threads
    # (side channel, flusher, MPI), per step; the notebook's is read over [w0, w1]
    th = time.thread_time() - th0
    if flush:  # the long blocks only
        cpu_log.append((mode, w0, time.time(), th / n, (time.process_time() - c0 - th) / n))
    return comm.allreduce(wall, op=MPI.MAX) / n
cpu_log = []
MODES = ("steady", "warm", "off")
for m in MODES:
    run(__STEPS__ // 4, m)
cpu_log.clear()  # the warm-up blocks are not measured
res = {m: [] for m in MODES}
for b in range(__BLOCKS__):  # every order of the three modes, in turn
    for m in ([MODES[(b + k) % 3] for k in range(3)] if b % 2 else
              [MODES[(b - k) % 3] for k in range(3)]):
        res[m].append(run(__STEPS__, m))
# short blocks (~0.25 s), on and off alternating: the machine's speed drifts over
# seconds, and neighbours this close see the same speed; no flush at a block's end (the
# rows go out with a later block's message, as in a loop), so the mean counts each
# message's cost where it falls
fine = {"on": [], "off": []}
for b in range(__FINE__):
    for m in (("steady", "off") if b % 2 == 0 else ("off", "steady")):
        fine["on" if m == "steady" else "off"].append(run(max(1, __STEPS__ // 14), m, False))
res["fine"] = fine
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
rec.warm = 0.0
probe = []
for b in range(4):
    rounds.Handle.report = timed_report
    acc[:] = [0.0, 0.0]
    comm.Barrier()
    for _ in range(__STEPS__):
        opt.zero_grad()
        loss = loss_fn(model(X), Y)
        loss.backward()
        opt.step()
        t = pc()
        hvdnb.log(step, loss, samples=__BATCH__)
        acc[0] += pc() - t
        step += 1
    rounds.Handle.report = report
    probe.append([a / __STEPS__ for a in acc])
res["in_loop"] = probe
res["cpu"] = cpu_log
rec.warm = warm
rec.flush()
res
"""


def paired_overhead(samples: dict, on: str = "on") -> dict:
    """Median of the ratios of adjacent on/off blocks and its 95 % bootstrap interval:
    adjacent blocks see the same machine load, so this is the estimate least disturbed
    by other work on a shared machine."""
    import random

    samples = {"on": samples[on], "off": samples["off"]}
    ratios = [a / b for a, b in zip(samples["on"], samples["off"])]
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    on = statistics.median(samples["on"]) * 1e3
    off = statistics.median(samples["off"]) * 1e3
    return {
        "step_ms_on": on, "step_ms_off": off,
        "overhead_pct": 100 * (statistics.median(ratios) - 1),
        "overhead_pct_of_medians": 100 * (on / off - 1),
        "overhead_pct_ci95": (100 * (boot[50] - 1), 100 * (boot[1949] - 1)),
        "blocks": len(ratios),
        "samples_ms": {k: [x * 1e3 for x in v] for k, v in samples.items()},
    }


def cell_code(model: str, blocks: int, steps: int | None = None, fine: int = 200) -> str:
    m = MODELS[model]
    return (CELL.replace("__LAYERS__", repr(m["layers"])).replace("__BATCH__", str(m["batch"]))
            .replace("__STEPS__", str(steps or m["steps"])).replace("__BLOCKS__", str(blocks))
            .replace("__FINE__", str(fine)))


def fine_overhead(fine: dict) -> dict:
    """Short alternating blocks: total time on / total time off - 1 (a mean: a message
    and its cost fall in one block of several), with a 95 % bootstrap interval over the
    on/off pairs."""
    import random

    pairs = list(zip(fine["on"], fine["off"]))
    rng = random.Random(0)

    def est(ps: list) -> float:
        return 100 * (sum(a for a, _ in ps) / sum(b for _, b in ps) - 1)

    boot = sorted(est(rng.choices(pairs, k=len(pairs))) for _ in range(2000))
    return {"overhead_pct": est(pairs), "overhead_pct_ci95": (boot[50], boot[1949]),
            "pairs": len(pairs), "step_ms_on": 1e3 * statistics.mean(fine["on"]),
            "step_ms_off": 1e3 * statistics.mean(fine["off"])}


def overhead_and_latency(blocks: int, models: list[str], steps: dict[str, int],
                         fine: int = 200) -> dict:
    import hvdnb
    from hvdnb import cells
    from hvdnb.metrics.store import MetricsStore
    from hvdnb.widgets.panel import Panel

    store = MetricsStore()
    out: dict = {}
    with hvdnb.Cluster(n=2) as cluster:
        store.attach(cluster)
        panel = Panel(store)
        panel.measure_latency = True
        cells.add_wait_hook(panel.tick)
        nb_cpu: list[tuple[float, float]] = []  # (wall, notebook CPU so far), ~20 per s

        def sample_cpu(final: bool) -> None:
            t = os.times()
            nb_cpu.append((time.time(), t.user + t.system))

        cells.add_wait_hook(sample_cpu)
        cpu0, t0 = os.times(), time.perf_counter()
        try:
            for model in models:
                res = cells.run_cell(cluster, cell_code(model, blocks, steps.get(model), fine),
                                     quiet=True, stream=False)
                r = paired_overhead(res.values[0], "steady")
                r["warm"] = paired_overhead(res.values[0], "warm")
                r["fine"] = fine_overhead(res.values[0]["fine"])
                per_rank = [v["in_loop"] for v in res.values.values()]
                r["in_loop_us"] = {  # median over blocks, max over ranks
                    "log": 1e6 * max(statistics.median(b[0] for b in p) for p in per_rank),
                    "comm_report": 1e6 * max(statistics.median(b[1] for b in p)
                                             for p in per_rank)}
                r["steps_per_block"] = steps.get(model) or MODELS[model]["steps"]
                r["layers"], r["batch"] = MODELS[model]["layers"], MODELS[model]["batch"]
                r["hot_path_us_per_step"] = hot_path_cost()
                r["cpu_us_per_step"] = cpu_accounting(res.values, nb_cpu)
                out[model] = r
        finally:
            cells.remove_wait_hook(panel.tick)
            cells.remove_wait_hook(sample_cpu)
        wall = time.perf_counter() - t0
        cpu1 = os.times()
        panel.close()
    lat = sorted(panel.latencies)
    out.update({
        "latency_ms_p50": 1e3 * lat[len(lat) // 2] if lat else None,
        "latency_ms_p95": 1e3 * lat[int(0.95 * (len(lat) - 1))] if lat else None,
        "latency_points": len(lat),
        "panel_renders": panel.renders,
        "panel_render_ms_mean": 1e3 * panel.render_seconds / max(1, panel.renders),
        "notebook_cpu_pct": 100 * ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / wall,
        "points": store.points, "lost_messages": store.lost_messages,
    })
    return out


def cpu_accounting(values: dict, nb_cpu: list[tuple[float, float]]) -> dict:
    """CPU by mode (median over blocks): each rank's training thread (``thread_time``;
    it includes MPI's busy wait for a late peer, so it moves with the machine's noise),
    each rank's other threads (``process_time`` minus it: side channel, flusher, MPI's
    own), and the notebook process (its ``os.times`` sampled by the cell's wait hook,
    read over each block's wall-clock span on rank 0), as a share of one core. On a
    2-core box where 2 ranks in lockstep keep both cores busy, CPU that the notebook or a
    side thread takes delays one rank and its peer waits for it: the extra CPU "on"
    beside the training threads is the part of the overhead the in-loop figure omits."""
    import bisect

    walls = [w for w, _ in nb_cpu]

    def nb_at(t: float) -> float:
        i = min(max(bisect.bisect_left(walls, t), 1), len(walls) - 1)
        (wa, ca), (wb, cb) = nb_cpu[i - 1], nb_cpu[i]
        return ca + (cb - ca) * ((t - wa) / (wb - wa) if wb > wa else 0.0)

    rank0 = values[min(values)]["cpu"]
    out: dict = {}
    for mode in dict.fromkeys(b[0] for b in rank0):
        def per_rank(col: int, mode: str = mode) -> float:  # mean over ranks of medians
            meds = [statistics.median(b[col] for b in v["cpu"] if b[0] == mode)
                    for v in values.values()]
            return sum(meds) / len(meds)

        nb = [(nb_at(w1) - nb_at(w0)) / (w1 - w0) for m, w0, w1, _, _ in rank0
              if m == mode and len(nb_cpu) > 1 and walls[0] <= w0 and w1 <= walls[-1]]
        out[mode] = {
            "train_thread_us": 1e6 * per_rank(3),
            "other_threads_us": 1e6 * per_rank(4),
            "notebook_core_pct": 100 * statistics.median(nb) if nb else None,
        }
    return out


def hot_path_cost() -> dict:
    """What streaming adds to one MLP step on a rank, measured without machine noise:
    ``log`` + one bucket's allreduce record, and the pack of 20 steps with its encoding
    for the wire (``hvdnb.channel.encode``: JSON, binary columns, signature)."""
    import timeit

    from hvdnb.channel import encode
    from hvdnb.metrics.recorder import Recorder

    class Sink:
        def send(self, kind: str, **payload: object) -> None:
            encode(b"k" * 32, {"kind": kind, "rank": 0, **payload})

    rec = Recorder(0, Sink(), flush_interval=100.0)
    rec._ensure_flusher = lambda: None  # type: ignore[method-assign]
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
    return {"log_and_comm_us": 1e6 * per_step, "flush_20_steps_us": 1e6 * flush,
            "total_us": 1e6 * (per_step + flush / 20)}


SENDER = r"""
import json, os, sys, time
sys.path.insert(0, os.environ["HVDNB_ROOT"])
from kernels_ext.channel import EngineChannel
from hvdnb.metrics.recorder import Recorder
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
sent_rows = sum(rec._w for rec in recs)
msgs = sum(rec.seq for rec in recs)
for rec in recs:
    rec.channel.close()
print(json.dumps({"rows": sent_rows, "messages": msgs, "steps": step,
                  "seconds": time.perf_counter() - t0}))
"""


def scale(nranks: int, seconds: float) -> dict:
    from hvdnb.channel import ClientChannel
    from hvdnb.metrics.store import MetricsStore
    from hvdnb.widgets.panel import Panel

    key = secrets.token_hex(16).encode()
    ch = ClientChannel(key=key)
    store = MetricsStore()
    store._channel = ch
    ch.on("metrics", store.ingest)
    panel = Panel(store)
    env = dict(os.environ, HVDNB_ROOT=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", SENDER, ch.endpoint, key.decode(),
                             str(nranks), str(seconds)], env=env, stdout=subprocess.PIPE,
                            text=True)
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
        "ranks": nranks, "seconds": sent["seconds"], "rate_hz": 10,
        "rows_sent": sent["rows"], "rows_stored": logged, "messages_sent": sent["messages"],
        "messages_stored": store.messages, "lost_messages": store.lost_messages,
        "lost_rows": store.lost_rows, "bad_signatures": ch.dropped,
        "client_cpu_pct": 100 * ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / wall,
        "panel_renders": panel.renders,
        "panel_render_ms_mean": 1e3 * panel.render_seconds / max(1, panel.renders),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale-seconds", type=float, default=60.0,
                    help="length of the 64-rank run (default 60 s)")
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=16, help="on/off block pairs per model")
    ap.add_argument("--models", default="small,mid,mlp",
                    help="step sizes to measure: small (~0.25 ms), mid (~1 ms), mlp (~4-8 ms)")
    ap.add_argument("--steps-small", type=int, default=MODELS["small"]["steps"],
                    help="steps per block, small model")
    ap.add_argument("--steps-mid", type=int, default=MODELS["mid"]["steps"],
                    help="steps per block, ~1 ms model")
    ap.add_argument("--steps-mlp", type=int, default=MODELS["mlp"]["steps"],
                    help="steps per block, MLP")
    ap.add_argument("--fine-pairs", type=int, default=200,
                    help="short (~0.25 s) on/off block pairs per model")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "panel.json"))
    args = ap.parse_args()
    out: dict = {"machine": f"{os.cpu_count()} cores, shared with other engineers' work",
                 "command": " ".join(["python"] + sys.argv),
                 "load_avg_start": os.getloadavg()}
    models = [m for m in args.models.split(",") if m]
    if not args.skip_overhead:
        out["overhead"] = overhead_and_latency(
            args.blocks, models,
            {"small": args.steps_small, "mid": args.steps_mid, "mlp": args.steps_mlp},
            args.fine_pairs)
    if not args.skip_scale:
        out["scale"] = scale(args.ranks, args.scale_seconds)
    out["load_avg_end"] = os.getloadavg()
    o, s = out.get("overhead"), out.get("scale")
    print("live panel benchmark (2 cores shared with other work; load avg "
          f"{out['load_avg_start'][0]:.2f} -> {out['load_avg_end'][0]:.2f})")
    if o:
        print("overhead = median over blocks of (block time on / adjacent block off) - 1; "
              "steady: a loop past its first flush_warm s, warm: its first seconds")
        print(f"{'step size':<10} | {'blocks x steps':>14} | {'off ms':>7} | {'on ms':>7} | "
              f"{'steady':>7} | {'95% CI':>13} | {'warm':>7} | {'95% CI':>13} | "
              f"{'in loop us/step':>15} | target (steady)")
        for m in models:
            r, wr = o[m], o[m]["warm"]
            lo, hi = r["overhead_pct_ci95"]
            wlo, whi = wr["overhead_pct_ci95"]
            il = r["in_loop_us"]
            hp = il["log"] + il["comm_report"]
            print(f"{m:<10} | {r['blocks']:>5} x {r['steps_per_block']:<6} | "
                  f"{r['step_ms_off']:7.3f} | {r['step_ms_on']:7.3f} | {r['overhead_pct']:6.2f}% | "
                  f"{lo:+5.1f}..{hi:+5.1f}% | {wr['overhead_pct']:6.2f}% | {wlo:+5.1f}..{whi:+5.1f}% | "
                  f"{hp:9.1f} {100 * hp / (1e3 * r['step_ms_off']):4.1f}% | <= 2 %")
        print("short blocks: ~0.25 s on and off alternating; overhead = total time on / "
              "total time off - 1 (messages counted where they fall)")
        for m in models:
            f = o[m]["fine"]
            flo, fhi = f["overhead_pct_ci95"]
            print(f"{m:<10} | {f['pairs']:>5} pairs | off {f['step_ms_off']:7.3f} ms | "
                  f"on {f['step_ms_on']:7.3f} ms | {f['overhead_pct']:+6.2f}% | "
                  f"95% CI {flo:+5.2f}..{fhi:+5.2f}% | target <= 2 %")
        print("CPU beside the training thread, on / off (median over blocks; other threads: "
              "side channel, flusher, MPI, per step, mean over ranks)")
        for m in models:
            c = o[m]["cpu_us_per_step"]
            on, off = c["steady"], c["off"]
            nb = ("n/a" if on["notebook_core_pct"] is None or off["notebook_core_pct"] is None
                  else f"{on['notebook_core_pct']:.2f} / {off['notebook_core_pct']:.2f} % of a core")
            print(f"{m:<10} | rank's other threads {on['other_threads_us']:5.1f} / "
                  f"{off['other_threads_us']:5.1f} us | notebook {nb}")
        print(f"{'measure':<44} | {'value':>12} | target")
        print(f"{'log() -> widget model latency p50 (ms)':<44} | {o['latency_ms_p50']:12.0f} |")
        print(f"{'log() -> widget model latency p95 (ms)':<44} | {o['latency_ms_p95']:12.0f} | <= 1.5 x steady interval")
        print(f"{'notebook CPU during training (% of a core)':<44} | {o['notebook_cpu_pct']:12.1f} |")
    if s:
        label = f"{s['ranks']} ranks x 10 Hz, seconds"
        print(f"{label:<44} | {s['seconds']:12.1f} |")
        print(f"{'rows sent / stored':<44} | {s['rows_sent']:>6}/{s['rows_stored']:<6}| equal")
        print(f"{'messages sent / stored / seq gaps':<44} | {s['messages_sent']}/{s['messages_stored']}/{s['lost_messages']} | no gap")
        print(f"{'client CPU (% of a core)':<44} | {s['client_cpu_pct']:12.1f} |")
        print(f"{'panel render at 64 ranks (mean ms)':<44} | {s['panel_render_ms_mean']:12.1f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
