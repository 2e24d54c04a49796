"""Lessons 04 and 10 as a reader sees them with no kernel: ``hvdnb run``'s executed copy,
turned into nbconvert's HTML and opened in headless Chromium with the network refused.

For each lesson (``notebooks/04-lr-at-scale.ipynb``, ``notebooks/10-frameworks.ipynb``):

1. executes it on 2 CPU ranks with ``hvdnb run``'s runner into a temporary folder;
2. converts the executed copy with nbconvert (``HTMLExporter``, the lab template);
3. opens the HTML in headless Chromium, every request off the file refused (a reader
   offline, or a site that loads no scripts from a CDN), reads each code cell and takes a
   full-page screenshot;
4. checks what issue 56 asks of the saved file (``tests/browser/_static.py``,
   ``verdicts``): the ``%dist start`` cell shows its picture, with the runs chart (taller
   than a training cell's); each training cell has its final live line (``run N done ·
   step ...``) and its run's picture (loss per rank, allreduce, step-time split, memory),
   and adds at most 150 KB to the ``.ipynb``; the ranks' lines are tagged by rank.

It prints a table (lesson, seconds to run and convert, the start picture's height, the
training cells' KB, verdicts) and writes ``bench/results/walk_static.json``; screenshots go
to ``test-artifacts/static-html/``, the executed copies and their HTML too. Exits 1 when a
check fails. ``tests/browser/test_static_html_browser.py`` is the suite's short version (a
small notebook of the same shape). Usage: ``.venv/bin/python bench/walk_static.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from tests.browser._static import all_good, cell_bytes, execute, look, verdicts

SHOTS = ROOT / "test-artifacts" / "static-html"
OUT = ROOT / "bench" / "results" / "walk_static.json"
#: the lessons and their training cells (each one run, with its live line)
LESSONS = {"04-lr-at-scale": 4, "10-frameworks": 4}


def main() -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hvdnb-static-") as tmp:
        # a run store of its own: the start cell's picture shows this session's runs
        os.environ["HVDNB_HOME"] = str(Path(tmp) / "hvdnb-home")
        for stem, training in LESSONS.items():
            done = execute(ROOT / "notebooks" / f"{stem}.ipynb", Path(tmp))
            shot = SHOTS / f"{stem}.png"
            cells = look(done["html"], shot)
            v = verdicts(cells, cell_bytes(done["ipynb"]), training)
            for key in ("ipynb", "html"):
                shutil.copy(done[key], SHOTS / done[key].name)
            row = {
                "lesson": stem,
                "run_s": done["run_s"],
                "convert_s": done["convert_s"],
                "ipynb_kb": round(done["ipynb"].stat().st_size / 1024, 1),
                "html_kb": round(done["html"].stat().st_size / 1024, 1),
                **v,
                "ok": all_good(v),
                "screenshot": str(shot),
            }
            rows.append(row)
    print(
        "| lesson | run s | convert s | .ipynb KB | start picture px | training cells "
        "| KB per training cell | rank-tagged lines | ok |\n|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['lesson']} | {r['run_s']} | {r['convert_s']} | {r['ipynb_kb']} | "
            f"{r['start_picture_px']} | {r['training_cells']}/{r['training_cells_expected']} | "
            f"{', '.join(map(str, r['kb_per_training_cell']))} | {r['rank_tagged_lines']} | "
            f"{'yes' if r['ok'] else 'NO'} |"
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"wrote {OUT}; screenshots in {SHOTS}")
    if not all(r["ok"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
