"""Adasum against Average on Horovod's MNIST example: the test accuracy each reaches.

Runs ``examples/pytorch_mnist_adasum.py`` (Horovod's ``pytorch_mnist.py`` on scikit-learn's
digits, offline) under ``mpiexec -n N`` twice, with ``hvd.Average`` (the default) and with
``--use-adasum`` (``DistributedOptimizer(op=hvd.Adasum)``), ``--epochs`` epochs each, and
reads the test accuracy the script prints after its last epoch (rank 0, averaged over the
ranks by ``hvd.allreduce``). Adasum needs a power-of-two number of ranks.

Usage: ``python bench/bench_adasum.py [--ranks 2] [--epochs 30]``; prints a table and writes
``bench/results/adasum.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pytorch_mnist_adasum.py"
ACCURACY = re.compile(r"Test set: Average loss: ([\d.]+), Accuracy: ([\d.]+)%")


def one(ranks: int, epochs: int, adasum: bool) -> dict[str, Any]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec), "-n", str(ranks), sys.executable, str(EXAMPLE), "--epochs", str(epochs)]
    if adasum:
        cmd.append("--use-adasum")
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1200)
    seconds = time.perf_counter() - t0
    found = ACCURACY.findall(res.stdout)
    if not found:
        raise SystemExit(f"no accuracy line in the example's output:\n{res.stdout}\n{res.stderr}")
    loss, acc = found[-1]
    return {
        "op": "Adasum" if adasum else "Average",
        "ranks": ranks,
        "epochs": epochs,
        "test_accuracy_pct": float(acc),
        "test_loss": float(loss),
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "adasum.json"))
    args = ap.parse_args(argv)
    rows = [one(args.ranks, args.epochs, adasum) for adasum in (False, True)]
    print(f"{EXAMPLE.name}, {args.ranks} CPU ranks, {args.epochs} epochs")
    print(f"{'op':>8} | {'test accuracy':>13} | {'test loss':>9} | wall")
    for r in rows:
        print(
            f"{r['op']:>8} | {r['test_accuracy_pct']:>12.2f}% | {r['test_loss']:>9.4f} | "
            f"{r['seconds']:.0f} s"
        )
    res = {
        "rows": rows,
        "machine": f"{os.cpu_count()} cores, shared with other work",
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
