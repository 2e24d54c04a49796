"""Several sittings of a per-call or step bench, each a fresh ``mpiexec``, summarised.

Run: ``python bench/sittings.py tf [-n 5] [--ranks 2]`` or ``python bench/sittings.py
percall [-n 5] [--ranks 2]``. One sitting of ``bench_tf.py`` or ``bench_percall.py`` already
interleaves its variants block by block; a verdict that flips between sittings on a noisy
box is not a verdict. This runs ``-n`` sittings one after another (a fresh process group
each: TensorFlow's MultiWorkerMirroredStrategy cannot be made twice in one process), keeps
every sitting's JSON (``bench/results/<bench>-sitting-<k>.json``) and prints, for each ratio
and per-call time, the median over sittings and the range (min-max). Writes
``bench/results/<bench>-sittings-<ranks>.json``.

Ratios (all "lower is better" for the TF step, "higher is better" for percall, as each
bench defines them):

- ``tf``: each variant's step time / MultiWorkerMirroredStrategy's in the same sitting
  (``hvdnb``: Keras DistributedOptimizer, ``hvdnb_tape``: DistributedGradientTape,
  ``hand_mpi``, ``no_comm``: the same step with no communication, which shows how much of
  the step is compute on this box), and the per-call ``hvd.allreduce`` of 4 KB in us;
- ``percall``: mpi4py's time / hvdnb.torch's time per size and mode (1.0: as fast).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else "mpiexec"


def _sitting(bench: str, ranks: int, k: int) -> dict[str, Any]:
    out = RESULTS / f"{bench}-sitting-{k}.json"
    script = HERE / ("bench_tf.py" if bench == "tf" else "bench_percall.py")
    cmd = [_mpiexec(), "-n", str(ranks), sys.executable, str(script), "--out", str(out)]
    print(f"sitting {k}: {' '.join(cmd[3:])}", flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if res.returncode != 0:  # TensorFlow's start-up chatter is kept out unless it failed
        sys.exit(f"sitting {k} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return json.loads(out.read_text())


def _metrics(bench: str, d: dict[str, Any]) -> dict[str, float]:
    """The numbers summarised over sittings, from one sitting's JSON."""
    if bench == "tf":
        step = d["step_ms"]
        base = step.get("mwms")
        m: dict[str, float] = {f"step ms {k}": v for k, v in step.items()}
        if base:
            m.update({f"{k} / mwms": v / base for k, v in step.items() if k != "mwms"})
        for k, v in d["allreduce_us"]["1024"].items():
            m[f"4 KB us {k}"] = v
        return m
    return {
        f"{r['bytes'] // 1024} KB {r['mode']} mpi4py/hvdnb": r["ratio_median"] for r in d["rows"]
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", choices=["tf", "percall"])
    ap.add_argument("-n", type=int, default=5, help="sittings (default 5)")
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    per: list[dict[str, float]] = []
    for k in range(1, args.n + 1):
        per.append(_metrics(args.bench, _sitting(args.bench, args.ranks, k)))
    keys = list(per[0])
    summary = {}
    print(f"\n{args.bench}: {args.n} sittings, {args.ranks} ranks, {os.cpu_count()} cores")
    print(f"{'':<44} {'median':>9} {'min':>9} {'max':>9}")
    for key in keys:
        vals = [p[key] for p in per if key in p]
        summary[key] = {
            "median": statistics.median(vals),
            "min": min(vals),
            "max": max(vals),
            "sittings": vals,
        }
        s = summary[key]
        print(f"{key:<44} {s['median']:>9.2f} {s['min']:>9.2f} {s['max']:>9.2f}")
    out = RESULTS / f"{args.bench}-sittings-{args.ranks}.json"
    out.write_text(
        json.dumps({"ranks": args.ranks, "cores": os.cpu_count(), "summary": summary}, indent=1)
    )
    print("wrote", out)


if __name__ == "__main__":
    main()
