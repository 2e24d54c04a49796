"""This tree against another commit, side by side in one run: what a change costs.

Each round runs, for this tree and for ``REF`` (a ``git worktree`` of that commit), in fresh
processes and alternating which goes first (noise hits both alike):

- ``mlp``: ``bench/bench_mlp.py --quick`` under ``mpiexec -n 2`` (its hvdnb variant: the
  MLP 784-512-512-10 step with ``hvdnb.torch.DistributedOptimizer``, batch 64 per rank);
- ``kernel``: the real kernel from the kernelspec over jupyter_client, the panel shown,
  2 ranks: the median of ``--cells`` no-op ``%%distributed`` cells and of as many ``%%px``
  cells on the same engines, interleaved; then ``--floods`` floods of ``--lines`` printed
  lines per rank each way; then ``--steps`` steps of the same MLP trained in a
  ``%%distributed`` cell that logs every step (``hvdnb.log``, the panel live), its median
  step time read on each rank with ``perf_counter`` around the step.

The same measuring code (this tree's) runs against both; only ``PYTHONPATH`` differs, and
each round checks which hvdnb the kernel and the ranks imported. The table shows each
side's median over rounds and the median of per-round ratios this / REF (for the kernel
rows, each side is first taken as a ratio to its own ``%%px``).

Prints a table and writes ``bench/results/ab-<name>.json``.
Usage: ``python bench/bench_ab.py --ref db0b912 [--rounds 3] [--cells 20] [--floods 2]
[--lines 20000] [--steps 300] [--name issue56]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_log import _worktree as worktree

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

# one kernel sitting, in a child whose PYTHONPATH names the tree: prints one JSON line
KERNEL_CHILD = r"""
import json, re, statistics, sys
from hvdnb.notebook.headless.runner import Kernel
cells, floods, lines, steps = map(int, sys.argv[1:5])
med = statistics.median
k = Kernel({"HVDNB_PANEL": "inline", "HVDNB_RANKS": "2"})
out = {}
try:
    r = k.run("%dist start -n 2")
    assert r.error is None, r
    r = k.run("import hvdnb\nprint(hvdnb.__file__)")
    out["kernel_hvdnb"] = r.text.strip()
    r = k.run("%%distributed -q -o f\nimport hvdnb\nhvdnb.__file__")
    r = k.run("print(sorted(set(f.values())))")
    out["ranks_hvdnb"] = r.text.strip()
    k.run("v = hvdnb.current().client[:]\nv.block = True\nv.activate()")
    k.run("%%px\npass")
    k.run("%%distributed\npass")
    ours, px = [], []
    pair = [(ours, "%%distributed\npass"), (px, "%%px\npass")]
    for i in range(cells):
        for acc, code in pair if i % 2 == 0 else pair[::-1]:
            r = k.run(code)
            assert r.error is None, r
            acc.append(r.seconds)
    out["noop_ms"] = 1e3 * med(ours)
    out["noop_px_ms"] = 1e3 * med(px)
    loop = f"for i in range({lines}):\n    print('step', i, 'loss', 0.5)\n"
    fo, fp = [], []
    pair = [(fo, "%%distributed\n" + loop), (fp, "%%px\n" + loop)]
    for i in range(floods):
        for acc, code in pair if i % 2 == 0 else pair[::-1]:
            r = k.run(code)
            assert r.error is None, r
            acc.append(r.seconds)
    out["flood_s"] = med(fo)
    out["flood_px_s"] = med(fp)
    mlp = (
        "%%distributed -q -o got\n"
        "import time, statistics, torch, hvdnb, hvdnb.torch as hvd\n"
        "from torch import nn\n"
        "hvd.init(); torch.set_num_threads(1); torch.manual_seed(0)\n"
        "m = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),"
        " nn.Linear(512, 10))\n"
        "opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01),"
        " named_parameters=m.named_parameters())\n"
        "X, Y = torch.randn(64, 784), torch.randint(0, 10, (64,))\n"
        "loss_fn = nn.CrossEntropyLoss()\n"
        "ts = []\n"
        f"for s in range({steps}):\n"
        "    t0 = time.perf_counter()\n"
        "    opt.zero_grad(); loss = loss_fn(m(X), Y); loss.backward(); opt.step()\n"
        "    hvdnb.log(s, loss)\n"
        "    ts.append(time.perf_counter() - t0)\n"
        "1e3 * statistics.median(ts[20:])"
    )
    r = k.run(mlp)
    assert r.error is None, r
    r = k.run("import json\nprint(json.dumps(got))")
    got = json.loads(r.text.strip())
    out["cell_mlp_step_ms"] = med(got.values())
finally:
    k.close()
print("RESULT " + json.dumps(out))
"""


def _worktree(ref: str) -> tuple[Path, str]:
    path = worktree(ref)  # bench_log's: a detached git worktree of ``ref``
    rev = subprocess.run(
        ["git", "-C", str(path), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return path, rev


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "HVDNB_STANDBY": "0"}


def _mlp(tree: Path, scratch: Path) -> float:
    """The hvdnb variant's median step (ms) of this tree's bench_mlp, run on ``tree``."""
    script = scratch / "bench_mlp.py"  # outside any tree: its directory adds no hvdnb
    shutil.copy(ROOT / "bench" / "bench_mlp.py", script)
    out = scratch / f"mlp-{tree.name}.json"
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"
    subprocess.run(
        [mpiexec, "-n", "2", sys.executable, str(script), "--quick", "--out", str(out)],
        env=_env(tree),
        cwd=scratch,
        check=True,
        capture_output=True,
        timeout=600,
    )
    return float(json.loads(out.read_text())["median_ms"]["hvdnb"])


def _kernel(tree: Path, scratch: Path, args: argparse.Namespace) -> dict[str, Any]:
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            KERNEL_CHILD,
            str(args.cells),
            str(args.floods),
            str(args.lines),
            str(args.steps),
        ],
        env=_env(tree),
        cwd=scratch,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode or not lines:
        raise RuntimeError(
            f"kernel sitting on {tree} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        )
    got: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    for key in ("kernel_hvdnb", "ranks_hvdnb"):  # the tree's hvdnb, not another's
        if str(tree) not in got[key]:
            raise RuntimeError(f"{key} came from {got[key]}, not from {tree}")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", required=True, help="the commit to compare with, e.g. HEAD~1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cells", type=int, default=20)
    ap.add_argument("--floods", type=int, default=2)
    ap.add_argument("--lines", type=int, default=20000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--name", default="latest")
    args = ap.parse_args()
    other, rev = _worktree(args.ref)
    here_tree = Path(tempfile.mkdtemp(prefix="hvdnb-ab-")) / "this"
    for part in ("hvdnb", "kernels_ext"):  # this tree as it is, under a path of its own
        shutil.copytree(ROOT / part, here_tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    scratch = Path(tempfile.mkdtemp(prefix="hvdnb-ab-scratch-"))
    sides: dict[str, list[dict[str, Any]]] = {"this": [], "ref": []}
    try:
        for i in range(args.rounds):
            pair = [("this", here_tree), ("ref", other)]
            for name, tree in pair if i % 2 == 0 else pair[::-1]:
                row = {"mlp_step_ms": _mlp(tree, scratch), **_kernel(tree, scratch, args)}
                sides[name].append(row)
                print(f"round {i + 1} {name}: {json.dumps(row)}", flush=True)
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)],
            capture_output=True,
        )
        shutil.rmtree(here_tree.parent, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)

    def ratio_rows(key: str, anchor: str | None = None) -> dict[str, float]:
        def val(row: dict[str, Any]) -> float:
            return float(row[key]) / (float(row[anchor]) if anchor else 1.0)

        per_round = [val(h) / val(t) for h, t in zip(sides["this"], sides["ref"])]
        return {
            "this": statistics.median(val(r) for r in sides["this"]),
            "ref": statistics.median(val(r) for r in sides["ref"]),
            "ratio": statistics.median(per_round),
            "ratios": per_round,
        }

    table = {
        "MLP step, bench_mlp under mpiexec (ms)": ratio_rows("mlp_step_ms"),
        "MLP step in a %%distributed cell, logged (ms)": ratio_rows("cell_mlp_step_ms"),
        "no-op %%distributed cell / %%px": ratio_rows("noop_ms", "noop_px_ms"),
        f"{args.lines}-line flood / %%px's": ratio_rows("flood_s", "flood_px_s"),
    }
    print(f"\nthis tree against {args.ref} ({rev}), {args.rounds} rounds, 2 ranks")
    print(f"{'measure':48} {'this':>9} {'ref':>9} {'this/ref':>9}")
    for name, row in table.items():
        print(f"{name:48} {row['this']:9.3f} {row['ref']:9.3f} {row['ratio']:9.3f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"ab-{args.name}.json"
    path.write_text(
        json.dumps(
            {"ref": args.ref, "ref_commit": rev, "args": vars(args), "table": table, **sides},
            indent=1,
        )
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
