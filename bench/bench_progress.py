"""A progress bar's cost in the real kernel: plain ``tqdm`` at ``mininterval=0`` on every rank.

Each rank runs a loop paced at 10,000 iterations a second with a plain ``tqdm`` bar that
redraws at every iteration (``mininterval=0, miniters=1``: 10,000 ``\\r`` updates a second on
stderr). The cell runs in the real kernel (the hvdnb kernelspec over jupyter_client, as
JupyterLab drives it) once as ``%%distributed`` (each rank's bar on its own display, updated
in place) and once as ipyparallel's ``%%px`` on the same engines (the anchor), interleaved,
the order swapped every pair. The figure is the cell's wall time, request to idle; the
ratio is hvdnb's over ``%%px``'s, median over the pairs. Target: <= 1.1.

Usage: ``python bench/bench_progress.py [--updates 20000] [--pairs 5]``; writes
``bench/results/progress.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hvdnb.notebook.headless.runner import Kernel

OUT = ROOT / "bench" / "results" / "progress.json"

LOOP = """
import time
from tqdm import tqdm
t0 = time.perf_counter()
for i in tqdm(range({n}), mininterval=0, miniters=1):
    while time.perf_counter() - t0 < i / 10000:
        pass
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--updates", type=int, default=20000, help="iterations per rank")
    ap.add_argument("--pairs", type=int, default=5)
    args = ap.parse_args()
    loop = LOOP.format(n=args.updates)
    times: dict[str, list[float]] = {"hvdnb": [], "px": []}
    with Kernel({"HVDNB_PANEL": "inline"}) as k:
        r = k.run("%dist start -n 2 --timeout 120", timeout=240)
        assert r.error is None, r
        k.run("import hvdnb\nv = hvdnb.current().client[:]\nv.block = True\nv.activate()")
        k.run("%%px\nimport tqdm")
        k.run("%%distributed\nimport tqdm")
        for i in range(args.pairs):
            pair = [("hvdnb", "%%distributed\n" + loop), ("px", "%%px\n" + loop)]
            for name, code in pair if i % 2 == 0 else pair[::-1]:
                r = k.run(code, timeout=600)
                assert r.error is None, (name, r.error)
                times[name].append(r.seconds)
                if name == "hvdnb":  # each rank's bar ended at its last state
                    done = [
                        t for t in r.displayed.values() if f"{args.updates}/{args.updates}" in t
                    ]
                    assert len(done) == 2, r.displayed
    ratios = [h / p for h, p in zip(times["hvdnb"], times["px"])]
    res = {
        "updates_per_rank": args.updates,
        "rate_per_rank": 10000,
        "hvdnb_s": times["hvdnb"],
        "px_s": times["px"],
        "median_hvdnb_s": statistics.median(times["hvdnb"]),
        "median_px_s": statistics.median(times["px"]),
        "median_ratio": statistics.median(ratios),
        "target": 1.1,
    }
    print("| cell | median wall time | all |\n|---|---|---|")
    for name in ("hvdnb", "px"):
        print(
            f"| {name} | {statistics.median(times[name]):.2f} s | "
            f"{', '.join(f'{t:.2f}' for t in times[name])} |"
        )
    print(
        f"ratio hvdnb / %%px, median of {args.pairs} pairs: {res['median_ratio']:.3f} (target <= 1.1)"
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
