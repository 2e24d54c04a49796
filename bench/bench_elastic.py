"""What a rank's death costs an elastic cluster: ``python bench/bench_elastic.py``.

An elastic cluster (``hvdnb.Cluster(n, min_np=1)``, real engines, gloo) trains the MLP of
``bench_mlp.py`` (784-512-512-10, batch 64 per rank, SGD) under ``hvd.elastic.run`` with ``hvd.DistributedOptimizer`` and a ``TorchState``
committed every ``--commit-every`` steps; one rank kills itself (SIGKILL) at a chosen step.
Every time is ``time.time()`` on this host, read by the process it concerns:

- **death**: the victim, just before it kills itself (written to a file first);
- **seen**: each survivor, when its failed collective reached the elastic loop and its
  state's restore began (the reset has begun); the table shows the slowest survivor;
- **first allreduce at N-1**: each survivor, when the first gradient allreduce of the new
  generation returned (the optimizer's step after the reset); the slowest survivor;
- **work lost**: steps the survivors redo (the step at the failure minus the restored one);
- **commit / step**: one ``state.commit()`` (in-memory copy + the membership check, whose
  broadcast only some commits start) over the median step without a commit, in the same
  run before the death: the median commit, and (``mean``) the mean of all of them;
- **checksums equal**: every survivor's parameter sum after the run, compared.

``--cycles K`` then kills and re-adds a rank K times between cells (``scale``) and reports
what this process (the notebook's side) and the cluster hold before and after: processes,
listening TCP ports, this process's open file descriptors and its RSS. Both are read once
the standby that a start refills in the background is whole (its processes ready, the spare
controller's schedulers forked, the next store serving), and the table says how much of it
is the standby's.

Prints a table and writes ``bench/results/elastic.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hvdnb
from hvdnb.notebook.cellout.cells import run_cell

OUT = ROOT / "bench" / "results" / "elastic.json"

CELL = """
import os, signal, time, json, torch, hvdnb.torch as hvd
hvd.init()
slot = int(os.environ["HVDNB_SLOT"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                            torch.nn.ReLU(), torch.nn.Linear(512, 10))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, opt, step=0)
marks, steps, commits = {{}}, [], []
_restore = state.restore
def restore():
    marks.setdefault("seen", time.time())
    marks.setdefault("failed_step", state.step)
    _restore()
    marks.setdefault("restored_step", state.step)
state.restore = restore
state.register_reset_callbacks([lambda: marks.setdefault("reset", time.time())])
x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))

@hvd.elastic.run
def train(state):
    while state.step < {steps}:
        if slot == {victim} and state.step == {kill_at}:
            with open({death_file!r}, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        if "reset" in marks and "first_allreduce" not in marks:
            marks["first_allreduce"] = time.time()
        if "seen" not in marks:
            steps.append(time.perf_counter() - t0)
        state.step += 1
        if state.step % {commit_every} == 0:
            tc = time.perf_counter(); state.commit()
            if "seen" not in marks:
                commits.append(time.perf_counter() - tc)
train(state)
dict(marks, size=hvd.size(), steps=steps, commits=commits,
     checksum=round(float(sum(p.detach().double().sum() for p in model.parameters())), 9))
"""


def one_death(n: int, commit_every: int, steps: int, kill_at: int) -> dict:
    """Start an ``n``-rank elastic cluster, kill one rank mid-training, measure."""
    death_file = tempfile.mktemp(prefix="hvdnb-bench-death-")
    with hvdnb.Cluster(n=n, min_np=1, oversubscribe=True) as c:
        victim = c.membership.slot_of(n - 1 if n > 1 else 0)
        code = CELL.format(
            steps=steps,
            victim=victim,
            kill_at=kill_at,
            death_file=death_file,
            commit_every=commit_every,
        )
        r = run_cell(c, code, quiet=True)
        death = float(Path(death_file).read_text())
        os.unlink(death_file)
        outs = list(r.values.values())
        event = c.membership.events[-1]
    step = statistics.median(s for o in outs for s in o["steps"])
    commit = statistics.median(s for o in outs for s in o["commits"])
    commit_mean = statistics.fmean(s for o in outs for s in o["commits"])
    return {
        "ranks": n,
        "survivors": len(outs),
        "sizes": sorted({o["size"] for o in outs}),
        "notebook_decided_s": event.t - death,
        "seen_by_every_survivor_s": max(o["seen"] - death for o in outs),
        "first_allreduce_at_n_minus_1_s": max(o["first_allreduce"] - death for o in outs),
        "work_lost_steps": max(o["failed_step"] - o["restored_step"] for o in outs),
        "commit_interval": commit_every,
        "step_ms": step * 1e3,
        "commit_ms": commit * 1e3,
        "commit_over_step": commit / step,
        "commit_mean_ms": commit_mean * 1e3,
        "commit_mean_over_step": commit_mean / step,
        "checksums_equal": len({o["checksum"] for o in outs}) == 1,
    }


def _listening(procs: list[psutil.Process]) -> int:
    """Listening TCP ports of ``procs``, together."""
    ports = 0
    for p in procs:
        try:
            ports += sum(1 for s in p.net_connections("tcp") if s.status == psutil.CONN_LISTEN)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return ports


def _holdings(c: hvdnb.Cluster, me: psutil.Process) -> dict:
    procs = [me, *me.children(recursive=True)]
    return {
        "processes": len(procs) - 1,
        "listening_ports": _listening(procs),
        "fds": me.num_fds(),
        "rss_mb": me.memory_info().rss / 2**20,
    }


def _tree_holdings(pids: list[int]) -> tuple[int, int]:
    """Processes and listening TCP ports of ``pids`` and all their descendants."""
    procs: list[psutil.Process] = []
    for pid in pids:
        try:
            top = psutil.Process(pid)
            procs += [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return len(procs), _listening(procs)


def _settle(c: hvdnb.Cluster, me: psutil.Process) -> dict:
    """Wait until the standby a start refills is whole, and say what it holds.

    A start returns while its refill is still coming up: the standby processes importing
    torch, the spare controller (which writes its connection file, then forks its
    schedulers) and the next store. Holdings read before then grow by those alone, once."""
    t = time.monotonic()

    def whole() -> bool:
        sb = c.standby
        return (
            sb.ready() >= sb.count
            and sb.spare_ready()
            and (not c.elastic or c.store_host.spare_ready())
        )

    while not whole() and time.monotonic() - t < 120:
        time.sleep(0.05)
    # the spare controller forks its schedulers after its connection file: until the
    # tree reads the same for a second
    last = None
    while time.monotonic() - t < 120:
        now = _holdings(c, me)
        if now == last:
            break
        last = now
        time.sleep(1.0)
    spare = [p for p in [c.store_host.spare_pid] if p]
    procs, ports = _tree_holdings(c.standby.pids() + spare)
    return {"count": c.standby.count, "processes": procs, "listening_ports": ports}


def cycles(n: int, k: int) -> dict:
    """Kill a rank and add one back ``k`` times between cells; what is held before/after."""
    me = psutil.Process()
    with hvdnb.Cluster(n=n, min_np=1, oversubscribe=True) as c:
        run_cell(c, "import torch.distributed as d; d.get_world_size()", quiet=True)
        standby = _settle(c, me)
        before = _holdings(c, me)
        t0 = time.perf_counter()
        for _ in range(k):
            victim = c.slot_processes()[c.membership.slot_of(n - 1)]
            victim.kill()
            victim.wait(10)  # gone before the next cell is sent (else it dies in that cell)
            r = run_cell(c, "import torch.distributed as d; d.get_world_size()", quiet=True)
            assert set(r.values.values()) == {n - 1}, r.values
            c.scale(n)
            r = run_cell(c, "import torch.distributed as d; d.get_world_size()", quiet=True)
            assert set(r.values.values()) == {n}, r.values
        took = time.perf_counter() - t0
        _settle(c, me)
        after = _holdings(c, me)
    return {
        "ranks": n,
        "cycles": k,
        "seconds": took,
        "before": before,
        "after": after,
        "standby": standby,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ranks", default="2,3,8", help="cluster sizes (default 2,3,8)")
    ap.add_argument("--commit-every", type=int, default=10)
    # 20 commits per survivor before the death: with 5 (a kill at step 57) the commit's
    # median moved by half between runs on this box
    ap.add_argument("--steps", type=int, default=270)
    ap.add_argument("--kill-at", type=int, default=207, help="the victim's step (not a commit)")
    ap.add_argument("--cycles", type=int, default=100, help="kill/rejoin cycles (0: none)")
    ap.add_argument("--cycle-ranks", type=int, default=2)
    args = ap.parse_args()
    rows = [
        one_death(int(n), args.commit_every, args.steps, args.kill_at)
        for n in args.ranks.split(",")
    ]
    hdr = (
        f"{'ranks':>5} {'decided':>8} {'seen':>7} {'1st AR':>7} {'lost':>5} "
        f"{'step ms':>8} {'commit ms':>9} {'commit/step':>11} {'mean':>6} {'sums =':>6}"
    )
    print(hdr)
    for r in rows:
        print(
            f"{r['ranks']:>5} {r['notebook_decided_s']:>7.3f}s {r['seen_by_every_survivor_s']:>6.3f}s "
            f"{r['first_allreduce_at_n_minus_1_s']:>6.3f}s {r['work_lost_steps']:>5} "
            f"{r['step_ms']:>8.2f} {r['commit_ms']:>9.2f} {r['commit_over_step']:>10.1%} "
            f"{r['commit_mean_over_step']:>6.1%} "
            f"{r['checksums_equal']!s:>6}"
        )
    res: dict = {"deaths": rows}
    if args.cycles:
        cyc = cycles(args.cycle_ranks, args.cycles)
        res["cycles"] = cyc
        b, a = cyc["before"], cyc["after"]
        print(
            f"\n{cyc['cycles']} kill/rejoin cycles at {cyc['ranks']} ranks in {cyc['seconds']:.0f} s:"
        )
        for key in ("processes", "listening_ports", "fds"):
            print(f"  {key:<16} {b[key]:>6} -> {a[key]:>6}")
        print(f"  {'rss_mb':<16} {b['rss_mb']:>6.1f} -> {a['rss_mb']:>6.1f}")
        sb = cyc["standby"]
        print(
            f"  of these, the standby ({sb['count']} processes, a spare controller, the next "
            f"store): {sb['processes']} processes, {sb['listening_ports']} ports"
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1) + "\n")
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()
