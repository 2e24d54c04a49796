"""Each lesson's peak memory at 2 ranks, all of its processes together: does it fit Binder?

Binder gives a session about 2 GB. A lesson's memory is that of every process it runs: the
notebook kernel, ipyparallel's controller, mpiexec and the ranks (engines). The bench runs
each notebook headless (``hvdnb run NOTEBOOK -n 2``) and samples the whole process tree
every 0.25 s:

- ``PSS``: proportional set size summed over the tree (``/proc/PID/smaps_rollup``): pages
  shared between processes (torch's and TensorFlow's libraries, mapped by every rank) are
  split among them, so the sum counts each page once. This is the figure to hold against
  a container's limit.
- ``anon``: anonymous memory summed over the tree, shared pages split as for PSS
  (``Pss_Anon:`` in smaps_rollup; a forked process shares its parent's pages): the
  heap, tensors, Python objects. Unlike library code and other file-backed pages (which the
  kernel can drop and read again under a container's limit), it cannot be reclaimed without
  swap: it is what runs a container out of memory.
- ``RSS``: resident set size summed over the tree: shared pages counted once per process, an
  upper bound.

Peaks are the largest sum seen in one sample. Usage: ``python bench/bench_lesson_memory.py
[--ranks 2] [--limit-mib 2048] [NOTEBOOK ...]`` (default: every lesson); writes
``bench/results/lesson_memory.json``. It exits 1 when a lesson's peak PSS is over the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "lesson_memory.json"


def _tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _rollup(pid: int) -> dict[str, int]:
    """``/proc/PID/smaps_rollup`` in bytes (Rss, Pss, Anonymous, ...)."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0]) * 1024
    return out


def _sample(procs: list[psutil.Process]) -> tuple[int, int, int, int]:
    pss = rss = anon = n = 0
    for p in procs:
        try:
            r = _rollup(p.pid)
        except OSError:
            continue
        pss += r.get("Pss", 0)
        rss += r.get("Rss", 0)
        anon += r.get("Pss_Anon", r.get("Anonymous", 0))
        n += 1
    return pss, rss, anon, n


def measure(notebook: Path, ranks: int) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_WAIT_POLICY="PASSIVE")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "hvdnb.notebook.headless.cli",
            "run",
            str(notebook),
            "-n",
            str(ranks),
        ]
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [*cmd, "-o", str(Path(tmp) / notebook.name)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        root = psutil.Process(proc.pid)
        peak = {"pss": 0, "rss": 0, "anon": 0, "procs": 0}
        stop = threading.Event()

        def sampler() -> None:
            while not stop.is_set():
                pss, rss, anon, n = _sample(_tree(root))
                if pss > peak["pss"]:
                    peak.update(pss=pss, procs=n)
                peak["rss"] = max(peak["rss"], rss)
                peak["anon"] = max(peak["anon"], anon)
                stop.wait(0.25)

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        _, err = proc.communicate(timeout=900)
        stop.set()
        th.join()
    return {
        "notebook": notebook.stem,
        "ranks": ranks,
        "ok": proc.returncode == 0,
        "seconds": round(time.perf_counter() - t0, 1),
        "peak_pss_mib": round(peak["pss"] / 2**20),
        "peak_rss_mib": round(peak["rss"] / 2**20),
        "peak_anon_mib": round(peak["anon"] / 2**20),
        "processes": peak["procs"],
        "stderr": "" if proc.returncode == 0 else err[-1500:],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("notebooks", nargs="*", type=Path)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--limit-mib", type=int, default=2048)
    args = ap.parse_args()
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb"))
    rows = []
    print(
        "| lesson | ranks | ran | time | peak PSS (all processes) | peak anonymous | "
        "peak RSS sum | processes |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for p in paths:
        r = measure(p.resolve(), args.ranks)
        rows.append(r)
        print(
            f"| {r['notebook']} | {r['ranks']} | {'yes' if r['ok'] else 'FAILED'} | "
            f"{r['seconds']} s | {r['peak_pss_mib']:,} MiB | {r['peak_anon_mib']:,} MiB | "
            f"{r['peak_rss_mib']:,} MiB | "
            f"{r['processes']} |",
            flush=True,
        )
        if not r["ok"]:
            print(r["stderr"], file=sys.stderr)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"limit_mib": args.limit_mib, "rows": rows}, indent=1) + "\n")
    print(f"wrote {OUT}")
    over = [r["notebook"] for r in rows if r["peak_pss_mib"] > args.limit_mib or not r["ok"]]
    if over:
        print(f"over {args.limit_mib} MiB or failed: {', '.join(over)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
