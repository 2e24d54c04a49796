"""Lesson 04 in a JupyterLab started from a second environment that has no sidecar: the
panel must be in the ``%dist start`` cell at once, and live while the cells train.

Many people start JupyterLab from one environment (a conda base, a course's image) and
pick the "Python 3 (hvdnb)" kernel of another. That server has jupyterlab_widgets but
neither jupyterlab-sidecar nor anywidget, so no side area can open and no page can report
one (``hvdnb.notebook.panel.beacon``). The walk:

1. makes the second environment if ``--env2`` (default ``/tmp/env2``) has no ``jupyter``:
   ``python -m venv`` and ``pip install`` of jupyterlab, ipywidgets and jupyterlab_widgets
   only, each at the version this Python has (the widget protocol must match), never
   sidecar, anywidget or hvdnb; it refuses an ``--env2`` that has sidecar or anywidget;
2. copies ``notebooks/`` to a temporary folder and starts ``jupyter lab`` from the second
   environment on it, with the "Python 3 (hvdnb)" kernelspec of this Python in a folder of
   its own on ``JUPYTER_PATH`` (``get_kernel_dict``: this Python, this ``bin/`` on PATH);
3. opens lesson 04 in headless Chromium and runs its code cells one by one (Shift+Enter),
   waiting for each to end. While the ``%dist start`` cell runs and after it, it reads the
   page every 0.1 s: when the panel is visible in that cell's output, and every line the
   cell's stand-in shows (``hvdnb-stub-*``); a line saying the panel is open beside the
   notebook, or no panel in the cell within 10 s of the cluster's start, fails the walk.
   While each training cell runs it reads the panel's header every 0.5 s (the panel is
   live when it changes) and takes a screenshot with the panel in view;
4. saves the notebook (Ctrl+S) and reads the file: its error outputs fail the walk.

It prints a table (check, value, verdict) and writes ``bench/results/walk_nosidecar.json``;
screenshots go to ``test-artifacts/walk-nosidecar/``. Needs Debian's chromium and
playwright (``make test`` installs it). It exits 1 when a check fails.
Usage: ``.venv/bin/python bench/walk_nosidecar.py [--env2 /tmp/env2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from walkkit import shut_down_kernel

from hvdnb.notebook.headless.kernelspec import KERNEL_NAME, get_kernel_dict
from tests.browser._lab import ARGS, CHROMIUM

SHOTS = ROOT / "test-artifacts" / "walk-nosidecar"
OUT = ROOT / "bench" / "results" / "walk_nosidecar.json"
LESSON = "04-lr-at-scale.ipynb"
#: what the second environment installs: the front end's widget pieces, at this Python's versions
PACKAGES = ("jupyterlab", "ipywidgets", "jupyterlab_widgets")
#: a line of the stand-in that says the panel is beside the notebook
BESIDE = "is open beside the notebook"
CELLS = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell"

#: what the page shows of the start cell, read in one go
LOOK = (
    """(i) => {
  const cell = document.querySelectorAll(%r)[i];
  const seen = (el) => !!el && el.getClientRects().length > 0;
  const panel = cell.querySelector('.hvdnb-panel');
  return {
    panel_in_cell: seen(panel),
    panels_on_page: document.querySelectorAll('.hvdnb-panel').length,
    stub: [...cell.querySelectorAll('.hvdnb-stub')].map(e => e.className + ': ' + e.innerText),
    prompt: cell.querySelector('.jp-InputPrompt').innerText,
  };
}"""
    % CELLS
)


def ensure_env2(env2: Path) -> dict[str, str]:
    """The second environment's versions of ``PACKAGES``, made with pip if missing."""
    if not (env2 / "bin" / "jupyter").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(env2)], check=True)
        pins = [f"{p}=={version(p)}" for p in PACKAGES]
        print(f"making {env2}: pip install {' '.join(pins)}", flush=True)
        subprocess.run([str(env2 / "bin" / "pip"), "install", "-q", *pins], check=True)
    code = (
        "import importlib.util as u, json, importlib.metadata as m;"
        f"print(json.dumps({{p: m.version(p) for p in {PACKAGES!r}}}));"
        "assert not (u.find_spec('sidecar') or u.find_spec('anywidget') or u.find_spec('hvdnb'))"
    )
    got = subprocess.run(
        [str(env2 / "bin" / "python"), "-I", "-c", code], capture_output=True, text=True
    )
    if got.returncode:
        sys.exit(f"{env2} has sidecar, anywidget or hvdnb: use another --env2\n{got.stderr}")
    return dict(json.loads(got.stdout))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(env2: Path, tmp: Path) -> tuple[Any, str, str, Path]:
    """``jupyter lab`` from ``env2`` on a copy of ``notebooks/``, the hvdnb kernel of this
    Python on its ``JUPYTER_PATH``: (the process, its address, its token, its folder)."""
    work = tmp / "notebooks"
    shutil.copytree(ROOT / "notebooks", work)
    spec = tmp / "jupyter-data" / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps(get_kernel_dict(sys.executable), indent=1))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(
        PATH=f"{env2 / 'bin'}{os.pathsep}{env['PATH']}",
        JUPYTER_PATH=str(tmp / "jupyter-data"),
        JUPYTER_DATA_DIR=str(tmp / "jupyter-user-data"),
        JUPYTER_CONFIG_DIR=str(tmp / "jupyter-config"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
        HVDNB_HOME=str(tmp / "hvdnb-home"),
    )
    token, port = secrets.token_hex(16), _free_port()
    log = (tmp / "lab.log").open("w")
    proc = subprocess.Popen(
        [str(env2 / "bin" / "jupyter"), "lab", "--no-browser", f"--port={port}"]
        + ["--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}"]
        + [f"--ServerApp.root_dir={work}", "--LabApp.news_url=None", "--allow-root"],
        env=env,
        cwd=tmp,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            return proc, url, token, work
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                sys.exit(f"jupyter lab did not start:\n{(tmp / 'lab.log').read_text()[-3000:]}")
            time.sleep(0.3)


def _top(page: Any, i: int, inner: str = "") -> None:
    """Scroll cell ``i`` (or its ``inner`` element) to the top of the notebook, and give
    the page a moment to draw it (a cell out of view is not laid out)."""
    page.evaluate(
        "([i, inner]) => { const c = document.querySelectorAll(%r)[i];"
        " (inner ? c.querySelector(inner) : c).scrollIntoView({block: 'start'}); }" % CELLS,
        [i, inner],
    )
    time.sleep(0.7)


def _shot(page: Any, name: str, shots: list[str]) -> None:
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path))
    shots.append(str(path))


def _run_cell(page: Any, i: int) -> float:
    """Click code cell ``i``'s editor and press Ctrl+Enter; the monotonic time of it."""
    cell = page.locator(CELLS).nth(i)
    cell.scroll_into_view_if_needed()
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Control+Enter")  # run it and stay: no new cell after the last
    return time.monotonic()


def _prompt(page: Any, i: int) -> str:
    return str(page.locator(CELLS).nth(i).locator(".jp-InputPrompt").inner_text())


def _wait_done(page: Any, i: int, timeout: float, each: Any = None) -> None:
    """Until code cell ``i`` has run (its prompt a number), calling ``each()`` meanwhile."""
    deadline = time.monotonic() + timeout
    time.sleep(0.5)
    while time.monotonic() < deadline:
        p = _prompt(page, i)
        if "*" not in p and any(c.isdigit() for c in p):
            return
        if each is not None:
            each()
        time.sleep(0.5)
    raise TimeoutError(f"cell {i} still running after {timeout} s: prompt {_prompt(page, i)!r}")


def watch_start(page: Any, i: int, shots: list[str]) -> dict[str, Any]:
    """Run the ``%dist start`` cell ``i`` and read what it shows every 0.1 s until 10 s
    after it ended: when the panel showed in it, every stand-in line, in order."""
    t0 = _run_cell(page, i)
    lines: list[tuple[float, str]] = []
    panel_at = ended_at = None
    while True:
        now = time.monotonic() - t0
        look = page.evaluate(LOOK, i)
        for line in look["stub"]:
            if not lines or lines[-1][1] != line:
                lines.append((round(now, 2), line))
        if look["panel_in_cell"] and panel_at is None:
            panel_at = now
            _shot(page, "1-start-panel-in-cell", shots)
        done = "*" not in look["prompt"] and any(c.isdigit() for c in look["prompt"])
        if done and ended_at is None:
            ended_at = now
        if ended_at is not None and now - ended_at > 10:
            break
        if now > 180:
            break
        time.sleep(0.1)
    _shot(page, "2-start-settled", shots)
    return {
        "start_cell_s": None if ended_at is None else round(ended_at, 2),
        "panel_in_cell_s": None if panel_at is None else round(panel_at, 2),
        "panel_after_cell_end_s": None
        if panel_at is None or ended_at is None
        else round(panel_at - ended_at, 2),
        "stub_lines": lines,
        "panels_on_page": look["panels_on_page"],
        "claims_beside": any(BESIDE in text for _, text in lines),
    }


#: the page itself samples the start cell's panel header every 0.1 s (its textContent: a
#: cell scrolled out of view is not laid out, so its innerText reads empty)
SAMPLE = (
    """(i) => {
  window.__hvdnb_headers = [];
  const cell = document.querySelectorAll(%r)[i];
  window.__hvdnb_sampler = setInterval(() => {
    const v = cell.querySelector('.hvdnb-view .hvdnb-header');
    const text = v ? v.textContent.slice(0, 200) : '';
    const h = window.__hvdnb_headers;
    if (!h.length || h[h.length - 1] !== text) h.push(text);
  }, 100);
}"""
    % CELLS
)
STOP = "() => { clearInterval(window.__hvdnb_sampler); return window.__hvdnb_headers; }"


def watch_training(page: Any, start: int, i: int, n: int, shots: list[str]) -> dict[str, Any]:
    """Run training cell ``i`` while the page samples the panel's header (in cell
    ``start``); once the header says it trains, scroll the panel into view and take a
    screenshot, then one of the cell at its end."""
    page.evaluate(SAMPLE, start)
    t0 = _run_cell(page, i)
    shot = ""
    try:
        page.wait_for_function(
            "(i) => /· training/.test(document.querySelectorAll(%r)[i]"
            "  .querySelector('.hvdnb-view .hvdnb-header')?.textContent || '')" % CELLS,
            arg=start,
            timeout=60_000,
        )
        _top(page, start, ".hvdnb-panel")
        shot = f"3-train-{n}-panel-live"
        _shot(page, shot, shots)
    except Exception:
        pass  # the cell ended first: its screenshot below says so
    _wait_done(page, i, 420)
    seconds = time.monotonic() - t0
    headers = page.evaluate(STOP)
    time.sleep(1.0)  # the run's picture is drawn off the cell's path, put in after it
    _top(page, i)
    _shot(page, f"3-train-{n}-cell-end", shots)
    training = [h for h in headers if "training" in h]
    return {
        "cell": i,
        "seconds": round(seconds, 1),
        "panel_headers_seen": len(headers),
        "training_headers": len(training),
        "panel_shot_while_training": bool(shot),
        "first": training[0] if training else "",
        "last": training[-1] if training else "",
    }


def walk(page: Any, url: str, token: str, work: Path) -> dict[str, Any]:
    shots: list[str] = []
    page.goto(f"{url}/lab/tree/{LESSON}?token={token}")
    page.wait_for_selector("text=/\\| Idle/", timeout=120_000)
    try:
        page.locator(".jp-toast-button:has-text('No')").click(timeout=2000)
    except Exception:
        pass
    nb = json.loads((work / LESSON).read_text())
    code = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    src = ["".join(nb["cells"][i]["source"]) for i in code]
    start = next(i for i, s in zip(code, src) if "%dist start" in s)
    row: dict[str, Any] = {"start": watch_start(page, start, shots), "training": []}
    for i, s in zip(code, src):
        if i == start:
            continue
        if s.startswith("%%distributed") and s.split("\n")[1].startswith("train("):
            row["training"].append(watch_training(page, start, i, len(row["training"]) + 1, shots))
        else:
            _run_cell(page, i)
            _wait_done(page, i, 300)
    _top(page, start)
    _shot(page, "4-end-start-cell", shots)
    _top(page, code[-3])
    _shot(page, "5-end", shots)
    page.keyboard.press("Control+s")
    time.sleep(2)
    saved = json.loads((work / LESSON).read_text())
    row["errors"] = [
        f"cell {k}: {o.get('ename')}: {o.get('evalue')}"[:300]
        for k, c in enumerate(saved["cells"])
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    row["cells_run"] = sum(1 for c in saved["cells"] if c.get("execution_count"))
    row["code_cells"] = len(code)
    row["screenshots"] = shots
    return row


def _short(line: str) -> str:
    """A stand-in line as the table shows it: its state (``hvdnb-stub-missing``) and words."""
    cls, _, text = line.partition(": ")
    return f"{cls.split()[-1].removeprefix('hvdnb-stub-')}: {text[:60]}"


def checks(row: dict[str, Any]) -> list[tuple[str, Any, bool]]:
    st = row["start"]
    after = st["panel_after_cell_end_s"]
    rows = [
        (
            "panel in the %dist start cell: s after its Ctrl+Enter (after the cell ended)",
            f"{st['panel_in_cell_s']} ({after})",
            after is not None and after < 10,
        ),
        (
            "a line saying the panel is beside the notebook",
            st["claims_beside"],
            not st["claims_beside"],
        ),
        ("stand-in lines seen, in order", " | ".join(_short(t) for _, t in st["stub_lines"]), True),
    ]
    for t in row["training"]:
        rows.append(
            (
                f"cell {t['cell']}: {t['seconds']} s, panel headers while training",
                t["training_headers"],
                t["training_headers"] >= 3 and t["panel_shot_while_training"],
            )
        )
    rows.append(
        (
            "cells run",
            f"{row['cells_run']}/{row['code_cells']}",
            row["cells_run"] == row["code_cells"],
        )
    )
    rows.append(("error outputs", len(row["errors"]), not row["errors"]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--env2", type=Path, default=Path("/tmp/env2"))
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    env2_versions = ensure_env2(args.env2)
    SHOTS.mkdir(parents=True, exist_ok=True)
    for old in SHOTS.glob("*.png"):
        old.unlink()
    console: list[str] = []
    with tempfile.TemporaryDirectory(prefix="hvdnb-nosidecar-") as tmp:
        proc, url, token, work = start_server(args.env2, Path(tmp))
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
                page = browser.new_page(viewport={"width": 1500, "height": 950})
                page.on(
                    "console", lambda m: console.append(m.text[:300]) if m.type == "error" else None
                )
                t0 = time.perf_counter()
                try:
                    row = walk(page, url, token, work)
                except Exception as exc:
                    page.screenshot(path=str(SHOTS / "failed.png"))
                    raise SystemExit(f"walk failed: {exc}") from exc
                finally:
                    shut_down_kernel(page)
                    browser.close()
                row["seconds"] = round(time.perf_counter() - t0, 1)
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(20)
    row["env2"] = {"path": str(args.env2), **env2_versions}
    row["console_errors"] = console
    row["checks"] = [{"check": c, "value": v, "ok": ok} for c, v, ok in checks(row)]
    print("| check | value | ok |\n|---|---|---|")
    for c in row["checks"]:
        print(f"| {c['check']} | {c['value']} | {'yes' if c['ok'] else 'NO'} |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(row, indent=1) + "\n")
    print(f"walk {row['seconds']} s; wrote {OUT}; screenshots in {SHOTS}")
    if not all(c["ok"] for c in row["checks"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
