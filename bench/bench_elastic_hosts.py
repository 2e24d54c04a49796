"""Figures of an elastic cluster across hosts: ``tests/multihost/hosts.py``'s namespace hosts,
2 slots on each of h1 and h2 (``%dist start --hosts FILE --min-np 2``: each slot's engine
over ssh, no MPI), the notebook kernel on the login node, started from its kernelspec and
driven over jupyter_client.

Measured in one run (medians of ``--trials``):

- ``%dist start`` (cold), then ``--pairs`` cold (``HVDNB_STANDBY=0``) and warm restarts
  (each host's standby ready), alternating (``bench_restart.alternate``);
- a host lost while a DDP cell trains inside ``hvdnb.elastic.run``, from the loss to rank
  0's first step in the generation of 2: every h2 rank killed (SIGKILL from outside), and
  h2's link cut (its veth down; its processes live on). Each trial then mends the link and
  ``%dist scale 4`` brings h2 back, also timed.

Root only (namespaces). Prints a table and writes ``bench/results/elastic_hosts.json``.
Usage: ``sudo .venv/bin/python bench/bench_elastic_hosts.py [--trials 3] [--pairs 5]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from bench_restart import SETUP_PX, alternate

from hvdnb.notebook.headless.runner import Kernel
from tests.multihost.hosts import HOSTS, MACHINES, Hosts, why_not
from tests.multihost.test_elastic_hosts import _engines_on, _train_and_lose_h2

OUT = ROOT / "bench" / "results" / "elastic_hosts.json"
LOGIN = MACHINES["login"]


def _timed(k: Kernel, code: str, want: str, timeout: float = 300) -> float:
    t0 = time.perf_counter()
    got = k.run(code, timeout=timeout)
    took = time.perf_counter() - t0
    assert got.error is None and want in got.text, got.text[-2000:]
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=5, help="cold and warm restarts, alternating")
    args = ap.parse_args()
    reason = why_not()
    if reason:
        sys.exit(f"bench_elastic_hosts: {reason}")
    hosts = Hosts()
    hosts.up()
    res: dict = {"setup": "2 namespace hosts x 2 slots, veth bridge, 2-core box", "trials": {}}
    t = res["trials"]
    try:
        hostfile = hosts.dir / "hostfile"
        hostfile.write_text("".join(f"{h}:2\n" for h in HOSTS))
        env = {"HYDRA_LAUNCHER_EXEC": str(hosts.ssh), "HVDNB_PANEL": "off"}
        start = f"%dist start --hosts {hostfile} --ip {LOGIN} -n 4 --min-np 2"
        with Kernel(env, prefix=hosts.on("login", []), reach=LOGIN) as k:
            t["start_s"] = [_timed(k, start, "4 ranks ready")]
            k.run(SETUP_PX)
            pairs: dict = {"cold": [], "warm": []}
            alternate(k, args.pairs, 4, pairs)
            res["restart_pairs"] = pairs
            for mode in ("cold", "warm"):
                t[f"restart_{mode}_s"] = [x["restart_s"] for x in pairs[mode]]
            k.run("import os\nos.environ['HVDNB_STANDBY'] = '0'")  # the losses: no standby
            k.run("%dist restart", timeout=300)
            t["kill_to_step_s"], t["cut_to_step_s"], t["scale_back_s"] = [], [], []
            for _ in range(args.trials):
                victims = _engines_on(k, "h2")
                with tempfile.TemporaryDirectory() as d:
                    text, s = _train_and_lose_h2(
                        k, Path(d), lambda v=victims: [p.kill() for p in v]
                    )
                assert "host h2 (ranks 2,3)" in text, text
                t["kill_to_step_s"].append(s)
                t["scale_back_s"].append(_timed(k, "%dist scale 4", "now has 4 ranks"))
                with tempfile.TemporaryDirectory() as d:
                    text, s = _train_and_lose_h2(k, Path(d), lambda: hosts.cut("h2"))
                hosts.mend("h2")
                hosts.wait_ssh("h2")
                assert "host h2 (ranks 2,3)" in text, text
                t["cut_to_step_s"].append(s)
                t["scale_back_s"].append(_timed(k, "%dist scale 4", "now has 4 ranks"))
            k.run("%dist stop", timeout=120)
    finally:
        hosts.teardown()
    res.update({k: statistics.median(v) for k, v in t.items()})
    rows = [
        ("start, cold (s)", "start_s"),
        ("restart, cold (s)", "restart_cold_s"),
        ("restart, warm (s)", "restart_warm_s"),
        ("host killed -> next step (s)", "kill_to_step_s"),
        ("link cut -> next step (s)", "cut_to_step_s"),
        ("%dist scale 4, host back (s)", "scale_back_s"),
    ]
    for name, key in rows:
        each = ", ".join(f"{x:.2f}" for x in t[key])
        print(f"{name:<34} {res[key]:>7.2f}   ({each})")
    res["warm_over_cold"] = res["restart_warm_s"] / res["restart_cold_s"]
    print(f"warm / cold restart (medians): {res['warm_over_cold']:.2f}")
    OUT.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
