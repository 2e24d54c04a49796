"""A notebook executed by ``hvdnb run`` and turned into nbconvert's HTML, read as a person
reads it in a browser with no kernel and no network (headless Chromium on the file): what
each code cell shows, and what each adds to the ``.ipynb``. Shared by
``test_static_html_browser.py`` and ``bench/walk_static.py``."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from tests.browser._lab import ARGS, CHROMIUM

#: a line of a rank's output as hvdnb tags it: ``[0] ...``, ``[0,1] ...``, ``[0-2] ...``
RANK_TAG = re.compile(r"^\[\d+(?:[,-]\d+)*\] ", re.M)
#: a training cell's last live line, once its run ended
DONE_LINE = re.compile(r"^run \d+ done · step \d+")

#: what the page shows of each code cell: its source's first lines, the text of its
#: outputs, its images (class, natural size), its live lines, and its widget views left
#: for ipywidgets' html-manager to draw (a script from a CDN: nothing, offline)
LOOK = """() => [...document.querySelectorAll('.jp-Cell.jp-CodeCell')].map(c => {
  const outs = [...c.querySelectorAll('.jp-OutputArea-output')];
  return {
    source: (c.querySelector('.jp-InputArea-editor')?.textContent || '').trim().slice(0, 120),
    text: outs.map(o => o.innerText).join('\\n'),
    last: outs.length ? outs[outs.length - 1].innerText.trim().split('\\n').pop() : '',
    images: [...c.querySelectorAll('.jp-OutputArea img')].map(
      i => [i.className, i.naturalWidth, i.naturalHeight]),
    livelines: [...c.querySelectorAll('.hvdnb-liveline')].map(l => l.innerText),
    widget_views: c.querySelectorAll(
      'script[type="application/vnd.jupyter.widget-view+json"]').length,
  };
})"""


def execute(src: Path, out_dir: Path, n: int = 2) -> dict[str, Any]:
    """Run ``src`` with ``hvdnb run``'s runner on ``n`` ranks and convert the executed copy
    to HTML (nbconvert's default, the lab template): the paths and the seconds each took."""
    from nbconvert import HTMLExporter

    from hvdnb.notebook.headless.runner import run_notebook

    ipynb = out_dir / src.name
    t0 = time.perf_counter()
    run_notebook(src, n=n, output=ipynb, timeout=600)
    run_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    body, _ = HTMLExporter().from_filename(str(ipynb))
    html = ipynb.with_suffix(".html")
    html.write_text(body)
    return {
        "ipynb": ipynb,
        "html": html,
        "run_s": round(run_s, 1),
        "convert_s": round(time.perf_counter() - t0, 1),
    }


def cell_bytes(ipynb: Path) -> list[int]:
    """What each code cell's outputs add to the ``.ipynb`` (its JSON as nbformat writes it,
    one space indent), in the order of the code cells."""
    nb = json.loads(ipynb.read_text())
    return [
        len(json.dumps(c.get("outputs", []), indent=1, ensure_ascii=False).encode())
        for c in nb["cells"]
        if c["cell_type"] == "code"
    ]


def look(html: Path, shot: Path | None = None) -> list[dict[str, Any]]:
    """Open ``html`` in headless Chromium with every request off the file refused (a
    reader offline, or a page that may not load scripts from a CDN); each code cell as
    ``LOOK`` reads it; a full-page screenshot to ``shot``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        page.route(
            "**/*",
            lambda r: r.continue_() if r.request.url.startswith(("file:", "data:")) else r.abort(),
        )
        page.goto(html.resolve().as_uri())
        page.wait_for_load_state("load")
        page.wait_for_function("() => [...document.images].every(i => i.complete)")
        cells: list[dict[str, Any]] = page.evaluate(LOOK)
        if shot is not None:
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)
        browser.close()
    return cells


def verdicts(cells: list[dict[str, Any]], sizes: list[int], training: int) -> dict[str, Any]:
    """What the issue asks of the saved file, from ``look`` and ``cell_bytes``: the
    ``%dist start`` cell shows its picture (taller than a training cell's: it has the runs
    chart); each of the ``training`` cells ends with its last live line and its run's
    picture and adds at most 150 KB; rank output is tagged."""
    start = next(c for c in cells if "%dist start" in c["source"])
    trained = [(c, b) for c, b in zip(cells, sizes) if c["livelines"]]
    pics = [
        max((h for cls, w, h in c["images"] if "hvdnb-run-picture" in cls and w > 300), default=0)
        for c, _ in trained
    ]
    start_pic = max((h for _, w, h in start["images"] if w > 300), default=0)
    return {
        "start_picture_px": start_pic,
        "start_picture_shown": start_pic > max(pics, default=0) > 0,
        "training_cells": len(trained),
        "training_cells_expected": training,
        "each_ends_with_done_line": all(DONE_LINE.match(c["livelines"][-1]) for c, _ in trained),
        "each_has_its_picture": bool(pics) and all(pics),
        "kb_per_training_cell": [round(b / 1024, 1) for _, b in trained],
        "at_most_150_kb": all(b <= 150 * 1024 for _, b in trained),
        "rank_tagged_lines": sum(len(RANK_TAG.findall(c["text"])) for c in cells),
    }


def all_good(v: dict[str, Any]) -> bool:
    return bool(
        v["start_picture_shown"]
        and v["training_cells"] == v["training_cells_expected"]
        and v["each_ends_with_done_line"]
        and v["each_has_its_picture"]
        and v["at_most_150_kb"]
        and v["rank_tagged_lines"] > 0
    )
