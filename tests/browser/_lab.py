"""One real JupyterLab server per browser-test module, started from this Python with the
"Python 3 (hvdnb)" kernelspec, and what the tests share to drive it in Debian's Chromium
(never a downloaded browser build)."""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from hvdnb.notebook.metrics.ranklabels import parse_ranks

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_notebook(path: Path, cells: list[tuple[str, str]]) -> None:
    """A notebook of ``(kind, source)`` cells on the hvdnb kernel."""
    nb = {
        "cells": [
            {
                "cell_type": kind,
                "id": f"c{i}",
                "metadata": {},
                "source": src,
                **({"execution_count": None, "outputs": []} if kind == "code" else {}),
            }
            for i, (kind, src) in enumerate(cells)
        ],
        "metadata": {
            "kernelspec": {
                "name": "hvdnb",
                "display_name": "Python 3 (hvdnb)",
                "language": "python",
            }
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb))


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    """A JupyterLab server on a free port: ``url``, ``token``, ``root`` and ``work`` (its
    notebook directory). Its kernels are shut down through the server at the end, so their
    clusters stop."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not found: apt-get install chromium to run the browser tests")
    pytest.importorskip(
        "playwright.sync_api",
        reason="pip install playwright (never "
        "`playwright install`: the tests use Debian's chromium)",
    )
    from kernels_ext.kernelspec import get_kernel_dict

    root = tmp_path_factory.mktemp("lab")
    data = root / "jupyter-data"
    (data / "kernels" / "hvdnb").mkdir(parents=True)
    (data / "kernels" / "hvdnb" / "kernel.json").write_text(json.dumps(get_kernel_dict()))
    work = root / "work"
    work.mkdir()
    token = secrets.token_hex(16)
    port = _free_port()
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env.update(
        PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}",
        JUPYTER_PATH=str(data),
        JUPYTER_RUNTIME_DIR=str(root / "runtime"),
        JUPYTERLAB_WORKSPACES_DIR=str(root / "workspaces"),
        PYTHONPATH=str(Path(__file__).resolve().parents[2]),
        # jupyter-collaboration's file ids and document history: this server's own, so no
        # earlier server's notebook of the same name is taken for this one's
        JUPYTER_DATA_DIR=str(root / "jupyter-user-data"),
    )
    log = (root / "lab.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            f"--port={port}",
            "--ServerApp.ip=127.0.0.1",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={work}",
            "--LabApp.news_url=None",
            "--allow-root",
        ],
        env=env,
        cwd=root,  # the document history file (.jupyter_ystore.db) goes where it starts
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"jupyter lab did not start:\n{(root / 'lab.log').read_text()[-3000:]}")
            time.sleep(0.3)
    yield {"url": url, "token": token, "root": root, "work": work}
    # shut the kernels down through the server so their clusters are stopped
    try:
        req = urllib.request.Request(f"{url}/api/kernels?token={token}")
        for k in json.loads(urllib.request.urlopen(req, timeout=5).read()):
            urllib.request.urlopen(
                urllib.request.Request(
                    f"{url}/api/kernels/{k['id']}?token={token}", method="DELETE"
                ),
                timeout=10,
            )
    except Exception:
        pass
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@contextmanager
def lab_page(
    lab: dict[str, Any],
    notebook: str,
    last: Callable[[Any], None] | None = None,
    front_end: str = "lab/tree",
    ready: str = "text=/\\| Idle/",
) -> Iterator[Any]:
    """A Chromium page on ``notebook`` in the lab server, once its kernel is idle (the
    status bar's "| Idle": the toolbar can say idle before the kernel is) and JupyterLab's
    news question is answered, so it covers nothing; ``last(page)`` runs at the end, passed
    or failed (a last screenshot), then the browser is closed. ``front_end``: the page's
    path (``notebooks`` for Jupyter Notebook 7), ``ready``: what it shows once usable."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        try:
            page.goto(f"{lab['url']}/{front_end}/{notebook}?token={lab['token']}")
            page.wait_for_selector(ready, timeout=90_000)
            try:
                page.locator(".jp-toast-button:has-text('No')").click(timeout=3000)
            except Exception:
                pass
            yield page
        finally:
            if last is not None:
                last(page)
            browser.close()


#: a training cell held until the file ``release`` exists: it logs a step every ~10 ms and
#: prints ``step N`` every 200 steps, then ``released at step N`` (the reload and
#: closed-browser tests, bench/walk_reload.py)
HELD = """%%distributed
import os, time, hvdnb
step = 0
while not os.path.exists({release!r}):
    hvdnb.log(step, 1.0 / (step + 1))
    if step % 200 == 0:
        print("step", step, flush=True)
    step += 1
    time.sleep(0.01)
print("released at step", step)
"""


def printed_steps(text: str) -> dict[int, list[int]]:
    """Each rank's printed ``step N`` lines in ``text``, in order (hvdnb tags a line with
    its ranks: ``[0]``, ``[0,1]``, ``[0-2]`` when they printed the same)."""

    steps: dict[int, list[int]] = {}
    for tag, step in re.findall(r"\[([\d,-]+)\] step (\d+)", text):
        for r in parse_ranks(tag):
            steps.setdefault(r, []).append(int(step))
    return steps
