"""What a person feels in the real kernel: hvdnb's cells against ``%%px`` on the same engines.

The "Python 3 (hvdnb)" kernel is started from its kernelspec and driven over jupyter_client
as JupyterLab drives it (execute requests on the shell channel, everything on IOPub read).
The panel is displayed in the first cell (``HVDNB_PANEL=inline``: a real display, as the
side panel is). The anchor is ipyparallel's own ``%%px`` on the same engines, in the same
kernel (``hvdnb.current().client[:].activate()``), interleaved with hvdnb's cells.

A cell's latency is the time from sending its execute request to the kernel's ``idle``
status for that request on IOPub (what a person waits for before the next cell runs).

Rows:
- ``no-op``: ``pass``; with the panel empty, then again after a logged run of ``--steps``
  steps (``hvdnb.log`` on both ranks);
- ``flood``: both ranks print ``--lines`` lines in a tight loop, ``--floods`` times each,
  interleaved with ``%%px``'s (one sample was noise: 0.40 to 0.58 s between sittings); the
  median time to idle, the time to the first stream message, and the lines that arrived
  (checked complete and in order; every sample is kept in the JSON).

Usage: ``python bench/bench_core.py --kernel [--cells 40] [--steps 20000] [--lines 20000]``
(called by bench_core; prints a table, returns a dict for the JSON).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hvdnb.notebook.cellout.output import per_rank_lines
from hvdnb.notebook.headless.runner import Kernel


def _noop(k: Kernel, n: int) -> tuple[list[float], list[float]]:
    ours, px = [], []
    for i in range(n):  # interleaved, order alternating
        pair = [("ours", "%%distributed\npass"), ("px", "%%px\npass")]
        for name, code in pair if i % 2 == 0 else pair[::-1]:
            r = k.run(code)
            assert r.error is None, r
            (ours if name == "ours" else px).append(r.seconds)
    return ours, px


def _check_flood(text: str, lines: int, merged: bool) -> int:
    """Lines of the flood that arrived, checked: every rank's lines once, in order."""
    if merged:
        got = per_rank_lines(text, r"step (\d+) loss 0\.5")
        for r in (0, 1):
            assert got.get(r) == list(range(lines)), f"rank {r}: {len(got.get(r, []))} lines"
        return sum(len(v) for v in got.values())
    # %%px: a display per engine, its text under a [stdout:N] header
    nums = [int(g) for g in re.findall(r"^(?:\[stdout:\d+\] )?step (\d+) loss 0\.5$", text, re.M)]
    assert len(nums) == 2 * lines, f"%%px flood: {len(nums)} of {2 * lines} lines"
    return len(nums)


def run(cells: int = 40, steps: int = 20000, lines: int = 20000, floods: int = 5) -> dict[str, Any]:
    med = statistics.median
    env = {"HVDNB_PANEL": "inline", "HVDNB_RANKS": "2"}
    k = Kernel(env)
    out: dict[str, Any] = {"cells": cells, "steps": steps, "lines": lines, "floods": floods}
    try:
        r = k.run("%dist start -n 2")
        assert r.error is None, r
        out["start_cell_s"] = r.seconds
        first = k.run("%%distributed\npass")
        out["first_cell_after_start_ms"] = 1e3 * first.seconds
        k.run("import hvdnb\nv = hvdnb.current().client[:]\nv.block = True\nv.activate()")
        k.run("%%px\npass")
        ours, px = _noop(k, cells)
        out["noop_empty"] = {"hvdnb_ms": 1e3 * med(ours), "px_ms": 1e3 * med(px)}
        r = k.run(
            "%%distributed\nimport hvdnb\n"
            f"for s in range({steps}):\n    hvdnb.log(s, 1.0 / (s + 1))\n"
        )
        assert r.error is None, r
        ours, px = _noop(k, cells)
        out["noop_after_steps"] = {"hvdnb_ms": 1e3 * med(ours), "px_ms": 1e3 * med(px)}
        loop = f"for i in range({lines}):\n    print('step', i, 'loss', 0.5)\n"
        runs: dict[str, list[dict[str, Any]]] = {"px": [], "hvdnb": []}
        pair = [("px", "%%px\n" + loop), ("hvdnb", "%%distributed\n" + loop)]
        for i in range(floods):  # interleaved, order alternating, like the no-op rows
            for name, code in pair if i % 2 == 0 else pair[::-1]:
                r = k.run(code)
                assert r.error is None, r
                runs[name].append(
                    {
                        "seconds": r.seconds,
                        "first_stream_s": r.first_stream,
                        "lines": _check_flood(
                            r.text if name == "hvdnb" else "".join(r.displayed.values()),
                            lines,
                            merged=name == "hvdnb",
                        ),
                    }
                )
        flood: dict[str, Any] = {
            name: {
                "seconds": med([x["seconds"] for x in xs]),
                "first_stream_s": med([x["first_stream_s"] or 0.0 for x in xs]),
                "lines": min(x["lines"] for x in xs),
                "each_s": [x["seconds"] for x in xs],
            }
            for name, xs in runs.items()
        }
        out["flood"] = flood
    finally:
        k.close()
    rows = [
        ("no-op cell, empty panel (ms)", out["noop_empty"]),
        (f"no-op cell after {steps} logged steps (ms)", out["noop_after_steps"]),
    ]
    print(f"\nreal kernel (jupyter_client, kernelspec, panel shown), medians of {cells}")
    print(f"{'measure':44} {'%%px':>9} {'hvdnb':>9} {'ratio':>7}")
    for name, row in rows:
        print(
            f"{name:44} {row['px_ms']:9.1f} {row['hvdnb_ms']:9.1f} "
            f"{row['hvdnb_ms'] / row['px_ms']:7.2f}"
        )
    fl = out["flood"]
    print(
        f"{f'{lines} lines x 2 ranks, to idle (s, median of {floods})':44} {fl['px']['seconds']:9.2f} "
        f"{fl['hvdnb']['seconds']:9.2f} {fl['hvdnb']['seconds'] / fl['px']['seconds']:7.2f}"
    )
    fs = [fl[n]["first_stream_s"] for n in ("px", "hvdnb")]
    print(f"{'  first stream message (s)':44} {fs[0] or 0:9.2f} {fs[1] or 0:9.2f}")
    print(f"first %%distributed cell after %dist start: {out['first_cell_after_start_ms']:.0f} ms")
    return out


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    print(json.dumps(run(cells=int(sys.argv[1]) if len(sys.argv) > 1 else 20), indent=1))
