"""What ``%dist restart`` costs a person, cold and warm, side by side in one real kernel.

The "Python 3 (hvdnb)" kernel is started from its kernelspec and driven over jupyter_client
(``hvdnb.notebook.headless.runner.Kernel``), as JupyterLab drives it. Each pair, in alternating
order:

- **cold**: ``HVDNB_STANDBY=0`` in the kernel and a restart that takes the standby away (not
  timed), then ``%dist restart``: fresh interpreters import torch, a fresh controller starts;
- **warm**: the standby is back (a restart with ``HVDNB_STANDBY=auto`` spawns it, not
  timed), ready (``hvdnb.current().standby.ready()``, its spare controller's connection file
  written, and an elastic cluster's next store serving: ``store_host.spare_ready()``), then
  ``%dist restart``: the ranks
  are handed to standby processes and the spare controller serves the start.

A restart's time is the time from sending the ``%dist restart`` execute request to the
kernel's ``idle`` for it (stop, start and the standby's refill all included: the person
waits for all of it). The anchor is the cell that follows, ``%%px`` on the new engines
(ipyparallel's own): the time to its idle, so that a fast restart whose engines are not
really ready would show here. Each warm restart's ranks are checked to be the standby's
(``HVDNB_STARTED=warm``) and every cold one's cold.

Then **back to back**: ``--burst`` restarts, each right after the last one's ``%%px`` (the
standby refilling, its processes still importing torch or not), timed the same way; the
ranks go to whatever standby there is. Target: their median <= the cold median.

Usage: ``python bench/bench_restart.py [--pairs 5] [-n 2] [--min-np M] [--burst 5] [--json PATH]``
(default ``bench/results/restart.json``; ``--min-np``: an elastic cluster, one engine set
per rank and no mpiexec)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hvdnb.notebook.headless.runner import Kernel

PX = "%%px\nimport os\nprint(os.environ.get('HVDNB_STARTED', 'cold'))"
SETUP_PX = "import hvdnb\nv = hvdnb.current().client[:]\nv.block = True\nv.activate()"


def _restart(k: Kernel, mode: str, n: int) -> dict[str, Any]:
    r = k.run("%dist restart", timeout=300)
    assert r.error is None, r
    said = re.search(r"ready in ([0-9.]+) s", r.text)
    assert said, r.text
    k.run(SETUP_PX)  # %%px follows the new engines
    px = k.run(PX)
    assert px.error is None, px
    shown = "".join(px.displayed.values())  # %%px draws each engine's stdout as a display
    starts = [line for line in shown.splitlines() if "warm" in line or "cold" in line]
    warm = sum("warm" in s for s in starts)
    assert len(starts) == n, shown
    if mode != "burst":  # back to back: the ranks go to whatever standby there is
        want = n if mode == "warm" else 0
        assert warm == want, f"{mode} restart: {warm} warm of {n}: {shown}"
    return {
        "restart_s": r.seconds,
        "said_s": float(said.group(1)),
        "px_after_s": px.seconds,
        "warm_ranks": warm,
    }


def wait_ready(k: Kernel, n: int) -> None:
    code = (
        "import time, hvdnb\nc = hvdnb.current()\nt = time.monotonic()\n"
        f"while c.standby.ready() < {n} and time.monotonic() - t < 180: time.sleep(0.05)\n"
        f"assert c.standby.ready() >= {n}, c.standby.line()\n"
        # and the spare controller, and an elastic cluster's next store (a process that
        # imports torch): a restart that takes either sooner waits for it
        "def spares(): return c.standby.spare_ready() and (not c.elastic or c.store_host.spare_ready())\n"
        "while not spares() and time.monotonic() - t < 180: time.sleep(0.05)\n"
        "assert spares(), (c.standby.spare_ready(), c.store_host.spare_ready())"
    )
    r = k.run(code)
    assert r.error is None, r


def alternate(k: Kernel, pairs: int, n: int, out: dict[str, Any]) -> None:
    """``pairs`` cold and warm restarts of ``k``'s cluster of ``n`` ranks, in alternating
    order, appended to ``out["cold"]`` and ``out["warm"]``."""
    for i in range(pairs):
        order = ["cold", "warm"] if i % 2 == 0 else ["warm", "cold"]
        for mode in order:
            setting = "0" if mode == "cold" else "auto"
            k.run(f"import os\nos.environ['HVDNB_STANDBY'] = '{setting}'")
            k.run("%dist restart", timeout=300)  # takes the standby away, or brings it back
            if mode == "warm":
                wait_ready(k, n)
            out[mode].append(_restart(k, mode, n))


def run(pairs: int = 5, n: int = 2, min_np: int = 0, burst: int = 5) -> dict[str, Any]:
    k = Kernel({"HVDNB_STANDBY": "auto", "HVDNB_RANKS": str(n)})
    out: dict[str, Any] = {"pairs": pairs, "n": n, "min_np": min_np, "cold": [], "warm": []}
    elastic = f" --min-np {min_np}" if min_np else ""
    try:
        r = k.run(f"%dist start -n {n}{elastic}")
        assert r.error is None, r
        out["start_s"] = r.seconds
        alternate(k, pairs, n, out)
        # back to back, at a script's pace: each restart right after the last one's %%px,
        # its standby still refilling (importing torch) or not
        k.run("import os\nos.environ['HVDNB_STANDBY'] = 'auto'")
        k.run("%dist restart")
        wait_ready(k, n)
        out["burst"] = [_restart(k, "burst", n) for _ in range(burst)]
        wait_ready(k, n)
        mem = k.run("import json\nprint(json.dumps(hvdnb.current().standby.rows()))")
        out["standby"] = json.loads(mem.text.strip().splitlines()[-1])
        k.run("%dist stop")
    finally:
        k.close()
    med = statistics.median
    for mode in ("cold", "warm"):
        out[f"{mode}_median_s"] = med(x["restart_s"] for x in out[mode])
        out[f"{mode}_px_median_s"] = med(x["px_after_s"] for x in out[mode])
    out["ratio"] = out["warm_median_s"] / out["cold_median_s"]
    if out["burst"]:
        out["burst_median_s"] = med(x["restart_s"] for x in out["burst"])
        out["burst_ratio"] = out["burst_median_s"] / out["cold_median_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("-n", type=int, default=2)
    ap.add_argument("--min-np", type=int, default=0, help="an elastic cluster (0: fixed size)")
    ap.add_argument("--burst", type=int, default=5, help="back-to-back restarts after the pairs")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "restart.json"))
    a = ap.parse_args()
    out = run(a.pairs, a.n, a.min_np, a.burst)
    kind = f"an elastic cluster (--min-np {a.min_np})" if a.min_np else "a fixed-size cluster"
    print(f"%dist restart of {kind} at {a.n} ranks, {a.pairs} pairs in one kernel (median)")
    print(f"{'':>6} {'restart s':>10} {'%%px after s':>13}")
    for mode in ("cold", "warm"):
        print(f"{mode:>6} {out[mode + '_median_s']:>10.3f} {out[mode + '_px_median_s']:>13.3f}")
    print(f"warm / cold: {out['ratio']:.2f}")
    if out["burst"]:
        times = ", ".join(f"{x['restart_s']:.2f}" for x in out["burst"])
        warm = ", ".join(str(x["warm_ranks"]) for x in out["burst"])
        print(
            f"{len(out['burst'])} back to back: median {out['burst_median_s']:.3f} s "
            f"({times}; warm ranks {warm}); back to back / cold: {out['burst_ratio']:.2f}"
        )
    for r in out["standby"]:
        print(
            f"standby pid {r['pid']}: {r['rss_mib']} MiB resident, {r['uss_mib']} MiB its "
            f"own ({', '.join(r['modules'])})"
        )
    Path(a.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
