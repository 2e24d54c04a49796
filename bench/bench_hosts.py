"""Figures across hosts: the namespace hosts of ``tests/multihost/hosts.py`` (a login node
and two hosts, each with its own address, hostname and sshd, on one veth bridge), 2 ranks
on each host through ``%dist start --hosts`` (hydra over ssh), the notebook kernel on the
login node, started from its kernelspec and driven over jupyter_client.

Measured, side by side in one run (medians):

- ``%dist start`` (cold) and ``%dist restart`` across the hosts, each ``--starts`` times;
  then ``--pairs`` cold (``HVDNB_STANDBY=0``) and warm restarts (each host's standby ready)
  in alternating order, as ``bench/bench_restart.py`` does on one host;
- per-call time of ``hvdnb.torch``'s ``allreduce`` at 4 KB, 1 MB and 64 MB (``--allreduce-only``:
  also 4, 8, 16 and 32 MB, nothing else) against mpi4py's ``Allreduce`` and torch.distributed's
  gloo ``all_reduce`` on the same 4 ranks, interleaved call by call behind a barrier (rank 0's
  median; the barrier is outside the timed call). Two hvdnb forms: ``hvd.allreduce(t)``, unnamed
  and out of place (a new tensor each call, and the general path: an unnamed call's name
  changes every call, so no plan), and ``hvd.allreduce_(t, name=...)``, in place and named, as
  ``DistributedOptimizer`` reduces its buckets and as the mpi4py (preallocated output) and gloo
  (in place) calls are made;
- the bench MLP's DDP step (784-512-512-10, batch 64 per rank, one torch thread, SGD; as
  ``bench/bench_mlp.py``) in a ``%%distributed`` cell against the same script under
  ``torchrun --nnodes 2 --nproc-per-node 2`` started on each host over ssh, blocks of
  ``--steps`` steps alternating between the two (rank 0's median step of all blocks).

Root only (namespaces); the machine's 2 cores run all 4 ranks, so the link is a veth pair,
not a wire: the figures compare paths, they do not say what a real network costs. Prints a
table and writes ``bench/results/hosts.json``. Usage: ``sudo .venv/bin/python
bench/bench_hosts.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from bench_restart import SETUP_PX, alternate, wait_ready

from hvdnb.notebook.headless.runner import Kernel
from tests.multihost.hosts import HOSTS, MACHINES, Hosts, why_not

OUT = ROOT / "bench" / "results" / "hosts.json"
LOGIN = MACHINES["login"]

PERCALL = r"""%%distributed -q -o percall
import statistics, time, numpy as np, torch, torch.distributed as dist
import hvdnb.torch as hvd
from mpi4py import MPI
hvd.init()
comm = MPI.COMM_WORLD
percall = {}
for nbytes, reps in SIZES:
    t = torch.ones(nbytes // 4); g = t.clone(); a = t.numpy().copy(); b = np.empty_like(a)
    h = t.clone()
    calls = {"hvdnb.torch": lambda: hvd.allreduce(t, op=hvd.Sum),
             "hvdnb.torch in place": lambda: hvd.allreduce_(h, op=hvd.Sum, name="h"),
             "mpi4py": lambda: comm.Allreduce(a, b, op=MPI.SUM),
             "gloo": lambda: dist.all_reduce(g)}  # in place, as gloo is
    times = {k: [] for k in calls}
    for r in range(reps + 2):
        n = len(calls)
        names = list(calls)[r % n:] + list(calls)[:r % n]  # each goes first in turn
        for name in names:
            comm.Barrier()
            t0 = time.perf_counter()
            calls[name]()
            if r >= 2:  # two warm-up rounds
                times[name].append(time.perf_counter() - t0)
    percall[nbytes] = {k: statistics.median(v) for k, v in times.items()}
percall
"""

#: the bench MLP's DDP step, the same source in the cell and under torchrun
MLP = r"""
import os, statistics, time, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
if not dist.is_initialized():
    dist.init_process_group("gloo")
torch.set_num_threads(1)
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
torch.manual_seed(1 + dist.get_rank())
X, Y = torch.randn(64, 784), torch.randint(0, 10, (64,))
loss_fn = nn.CrossEntropyLoss()
steps = []
for i in range(N_STEPS + 10):
    dist.barrier()
    t0 = time.perf_counter()
    opt.zero_grad(); loss_fn(model(X), Y).backward(); opt.step()
    if i >= 10:
        steps.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    print("STEPS", ",".join(f"{s:.6f}" for s in steps), flush=True)
"""


def torchrun_block(hosts: Hosts, script: Path, port: int) -> list[float]:
    """One block under torchrun: 2 processes on each host, started over ssh."""
    torchrun = Path(sys.executable).with_name("torchrun")
    procs = []
    for i, host in enumerate(HOSTS):
        cmd = (
            f"GLOO_SOCKET_IFNAME=eth0 {torchrun} --nnodes 2 --nproc-per-node 2 --node-rank {i} "
            f"--master-addr {MACHINES[HOSTS[0]]} --master-port {port} {script}"
        )
        procs.append(
            subprocess.Popen(
                hosts.on("login", [str(hosts.ssh), host, cmd]),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    out = [p.communicate(timeout=300)[0] for p in procs]
    for line in out[0].splitlines():
        if line.startswith("STEPS "):
            return [float(x) for x in line[6:].split(",")]
    raise RuntimeError(f"torchrun gave no steps:\n{out[0][-2000:]}\n{out[1][-2000:]}")


COLUMNS = ("hvdnb.torch", "hvdnb.torch in place", "mpi4py", "gloo")


def _start(k: Kernel, hostfile: Path) -> None:
    got = k.run(f"%dist start --hosts {hostfile} --ip {LOGIN}", timeout=300)
    assert "4 ranks ready" in got.text, got.text


def _percall(k: Kernel, sizes: list[tuple[int, int]]) -> dict:
    k.run(f"%%distributed -q\nSIZES = {sizes!r}")
    got = k.run(PERCALL, timeout=600)
    assert got.error is None, got.traceback[-2000:]
    return dict(json.loads(k.run("import json; print(json.dumps(percall[0]))").text))


def allreduce_only(sizes: list[tuple[int, int]]) -> None:
    """The per-call figures at every size, on one cluster across the hosts."""
    hosts = Hosts()
    hosts.up()
    try:
        hostfile = hosts.dir / "hostfile"
        hostfile.write_text("".join(f"{h}:2\n" for h in HOSTS))
        env = {"HYDRA_LAUNCHER_EXEC": str(hosts.ssh), "HVDNB_PANEL": "off", "HVDNB_STANDBY": "0"}
        with Kernel(env, prefix=hosts.on("login", []), reach=LOGIN) as k:
            _start(k, hostfile)
            percall = _percall(k, sizes)
    finally:
        hosts.teardown()
    print(
        f"{'size':>8} {'hvdnb.torch':>12} {'in place':>10} {'mpi4py':>10} {'gloo':>10}"
        "  faster-of-two / hvdnb, / in place"
    )
    for nbytes, t in percall.items():
        best = min(t["mpi4py"], t["gloo"])
        ms = [t[k] * 1e3 for k in COLUMNS]
        size = f"{int(nbytes) >> 10} KB"
        ratios = f"{best / t['hvdnb.torch']:.2f}, {best / t['hvdnb.torch in place']:.2f}"
        print(
            f"{size:>8} {ms[0]:>12.3f} " + " ".join(f"{m:>10.3f}" for m in ms[1:]) + f"  {ratios}"
        )
    out = OUT.with_name("hosts-allreduce.json")
    setup = "2 namespace hosts x 2 ranks, veth bridge, 2-core box; seconds per call (median)"
    out.write_text(json.dumps({"setup": setup, "percall_s": percall}, indent=1) + "\n")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer calls and steps (smoke test)")
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=5, help="cold and warm restarts, alternating")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument(
        "--allreduce-only",
        action="store_true",
        help="only the per-call allreduce figures, at more sizes (where gloo and MPI cross); "
        "writes bench/results/hosts-allreduce.json",
    )
    args = ap.parse_args()
    reason = why_not()
    if reason:
        sys.exit(f"bench_hosts: {reason}")
    if args.quick:
        args.starts, args.steps, args.blocks, args.pairs = 2, 20, 1, 1
    sizes = [(4096, 20 if args.quick else 300), (1 << 20, 5 if args.quick else 50)]
    if args.allreduce_only:
        sizes += [(mb << 20, 3 if args.quick else 15) for mb in (4, 8, 16, 32)]
    sizes.append((64 << 20, 2 if args.quick else 7))
    if args.allreduce_only:
        allreduce_only(sizes)
        return
    hosts = Hosts()
    hosts.up()
    result: dict = {"setup": "2 namespace hosts x 2 ranks, veth bridge, 2-core box"}
    try:
        hostfile = hosts.dir / "hostfile"
        hostfile.write_text("".join(f"{h}:2\n" for h in HOSTS))
        script = hosts.dir / "mlp.py"
        script.write_text(MLP.replace("N_STEPS", str(args.steps)))
        env = {"HYDRA_LAUNCHER_EXEC": str(hosts.ssh), "HVDNB_PANEL": "off"}
        with Kernel(env, prefix=hosts.on("login", []), reach=LOGIN) as k:
            starts, restarts = [], []
            for i in range(args.starts):
                t0 = time.perf_counter()
                got = k.run(f"%dist start --hosts {hostfile} --ip {LOGIN}", timeout=300)
                starts.append(time.perf_counter() - t0)
                assert "4 ranks ready" in got.text, got.text
                t0 = time.perf_counter()
                got = k.run("%dist restart", timeout=300)
                restarts.append(time.perf_counter() - t0)
                assert "ranks ready" in got.text, got.text
                if i < args.starts - 1:
                    k.run("%dist stop", timeout=120)
            result["start_s"] = statistics.median(starts)
            result["restart_s"] = statistics.median(restarts)
            result["starts"], result["restarts"] = starts, restarts
            k.run(SETUP_PX)
            pairs: dict = {"cold": [], "warm": []}
            alternate(k, args.pairs, 4, pairs)
            # the last warm restart's standby refills (4 processes importing torch): the
            # allreduce and DDP figures below wait for it, not to share the cores with it
            k.run("import os\nos.environ['HVDNB_STANDBY'] = 'auto'")
            if args.pairs % 2:  # the last restart was warm (an even count ends cold)
                wait_ready(k, 4)
            for mode in ("cold", "warm"):
                result[f"restart_{mode}_s"] = statistics.median(x["restart_s"] for x in pairs[mode])
            result["restart_pairs"] = pairs
            result["percall_s"] = _percall(k, sizes)
            hv, tr = [], []
            for b in range(args.blocks):
                got = k.run("%%distributed -q\n" + MLP.replace("N_STEPS", str(args.steps)), 600)
                assert got.error is None, got.traceback[-2000:]
                line = next((ln for ln in got.text.splitlines() if "STEPS " in ln), None)
                assert line, got.text[-3000:]
                hv += [float(x) for x in line.split("STEPS ", 1)[1].split(",")]
                tr += torchrun_block(hosts, script, 29400 + b)
            result["ddp_step_s"] = {
                "hvdnb": statistics.median(hv),
                "torchrun": statistics.median(tr),
            }
            result["ddp_steps"] = {"hvdnb": len(hv), "torchrun": len(tr)}
    finally:
        hosts.teardown()
    rows = [
        ("start, cold (s)", result["start_s"], ""),
        ("restart (s)", result["restart_s"], "the standby ready or not"),
        ("restart, cold: HVDNB_STANDBY=0 (s)", result["restart_cold_s"], ""),
        (
            "restart, warm: each host's standby (s)",
            result["restart_warm_s"],
            f"warm / cold = {result['restart_warm_s'] / result['restart_cold_s']:.2f}",
        ),
    ]
    for nbytes, t in result["percall_s"].items():
        best = min(t["mpi4py"], t["gloo"])
        rows.append(
            (
                f"allreduce {int(nbytes) // 1024} KB: hvdnb / in place / mpi4py / gloo (ms)",
                " / ".join(f"{t[k] * 1e3:.3f}" for k in COLUMNS),
                f"faster-of-two / hvdnb = {best / t['hvdnb.torch']:.2f}, "
                f"/ in place = {best / t['hvdnb.torch in place']:.2f}",
            )
        )
    d = result["ddp_step_s"]
    rows.append(
        (
            "DDP MLP step: hvdnb / torchrun (ms)",
            f"{d['hvdnb'] * 1e3:.2f} / {d['torchrun'] * 1e3:.2f}",
            f"ratio {d['hvdnb'] / d['torchrun']:.3f}",
        )
    )
    for name, value, note in rows:
        shown = f"{value:.2f}" if isinstance(value, float) else value
        print(f"{name:<52} {shown:<28} {note}")
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
