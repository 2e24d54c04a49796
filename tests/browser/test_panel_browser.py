"""The live-tuning journey in a real JupyterLab, driven by headless Chromium (Debian's,
via Playwright).

One server fixture per module. The notebook has ``%dist start`` at the top, then enough
text to push the training cell below the fold, as a real notebook does. The test starts
2 ranks (the panel opens beside the notebook), runs the training cell, and while it is
still running checks that the panel and the running cell are on screen together, that
the panel redraws at least 3 times and the live line under the cell updates, drags the
``warmup_steps`` slider and sees both ranks apply it at one step. A second, shorter run
then appears overlaid on the runs chart with its knob values in the legend, and a
saved notebook keeps the panel's picture. Screenshots go to ``test-artifacts/``.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

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

TRAIN = """%%distributed
import time, torch, hvdnb
import hvdnb.torch as hvd
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
knobs = hvdnb.knobs(batch_size=32, warmup_steps=20, lr=0.1)
seen, t_end = [], time.time() + 40
step = 0
while time.time() < t_end or step < 50:
    knobs.step(step)
    seen.append(knobs.warmup_steps)
    x = torch.randn(knobs.batch_size, 64)
    y = (x[:, :4]).argmax(1)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    hvdnb.log(step, loss, samples=knobs.batch_size)
    time.sleep(0.02)
    step += 1
    if step > 50 and len(knobs.history) and step > knobs.history[-1][0] + 40:
        break
hvdnb.metrics.get_recorder().flush()
print("applied", [(h[0], h[1], h[2]) for h in knobs.history])
"""


RUN2 = """%%distributed
knobs = hvdnb.knobs(batch_size=64, warmup_steps=5, lr=0.1)
for step in range(60):
    knobs.step(step)
    x = torch.randn(knobs.batch_size, 64)
    loss = torch.nn.functional.cross_entropy(model(x), x[:, :4].argmax(1))
    opt.zero_grad(); loss.backward(); opt.step()
    hvdnb.log(step, loss, samples=knobs.batch_size)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _notebook(path: Path) -> None:
    filler = "\n\n".join(
        f"Paragraph {i}: text a real lesson has between the start and the "
        "training cell, long enough to push that cell below the fold."
        for i in range(14)
    )
    cells = [
        ("code", "%load_ext hvdnb\n%dist start -n 2"),
        ("markdown", filler),
        ("code", TRAIN),
        ("code", "print('after the training cell')"),
        ("code", RUN2),
    ]
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
def lab(tmp_path_factory):
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
    _notebook(work / "panel.ipynb")
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
    yield {"url": url, "token": token, "root": root}
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


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"panel-{name}.png"))


def _loss_svg(page) -> str:
    return page.evaluate(
        "() => { const s = document.querySelector('.hvdnb-view svg.hvdnb-chart');"
        " return s ? s.outerHTML : ''; }"
    )


def _cell_busy(page, index: int) -> bool:
    prompt = page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-InputPrompt")
    return "[*]" in (prompt.inner_text() or "")


def _on_screen(page, selector: str) -> bool:
    """Whether the element is laid out inside the window (not scrolled away, not hidden)."""
    return bool(
        page.evaluate(
            "(sel) => { const e = document.querySelector(sel); if (!e) return false;"
            " const r = e.getBoundingClientRect();"
            " return r.width > 0 && r.height > 0 && r.top < window.innerHeight && r.bottom > 0"
            " && r.left < window.innerWidth && r.right > 0; }",
            selector,
        )
    )


def test_live_tuning_journey(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        try:
            page.goto(f"{lab['url']}/lab/tree/panel.ipynb?token={lab['token']}")
            # the toolbar can say idle before the kernel is: wait for the status bar
            page.wait_for_selector("text=/\\| Idle/", timeout=90_000)
            try:  # JupyterLab asks about news once: answer, so it covers nothing
                page.locator(".jp-toast-button:has-text('No')").click(timeout=3000)
            except Exception:
                pass
            cells = page.locator(".jp-Notebook .jp-Cell")
            cells.nth(0).click()
            page.keyboard.press("Shift+Enter")  # %dist start: the panel opens beside
            page.wait_for_selector(".hvdnb-panel", timeout=120_000)
            page.wait_for_function(
                "() => ![...document.querySelectorAll('.jp-InputPrompt')][0]"
                ".innerText.includes('*')",
                timeout=120_000,
            )
            # in the side area, not in the notebook's cell output
            assert page.locator(".jp-Notebook .hvdnb-panel").count() == 0
            assert page.locator(".jp-Notebook .hvdnb-show-panel").count() == 1
            _shot(page, "1-started")
            page.keyboard.press("Shift+Enter")  # the markdown cell
            # the training cell, below the fold, then one queued behind it
            cells.nth(2).scroll_into_view_if_needed()
            cells.nth(2).click()
            page.keyboard.press("Shift+Enter")
            page.keyboard.press("Shift+Enter")  # queued behind it: a print ...
            page.keyboard.press("Shift+Enter")  # ... and a second, short run
            train = ".jp-Notebook .jp-Cell:nth-child(3)"
            page.wait_for_selector(f"{train} .hvdnb-liveline", timeout=60_000)
            # while it runs: the panel redraws, the line under the cell updates, and
            # both are on screen together
            seen: list[str] = []
            lines: list[str] = []
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (len(set(seen)) < 4 or len(set(lines)) < 3):
                svg = _loss_svg(page)
                if svg and "polyline" in svg and (not seen or svg != seen[-1]):
                    seen.append(svg)
                line = page.locator(f"{train} .hvdnb-liveline").first.inner_text()
                if not lines or line != lines[-1]:
                    lines.append(line)
                time.sleep(0.3)
            assert _cell_busy(page, 2), "the training cell ended before the checks"
            assert len(set(seen)) >= 3, f"panel redrew {len(set(seen))} times while running"
            assert len(set(lines)) >= 3, f"live line: {lines}"
            assert lines[-1].startswith("run 1") and "loss r0" in lines[-1], lines[-1]
            page.evaluate(
                "(sel) => document.querySelector(sel).scrollIntoView({block: 'center'})",
                f"{train} .hvdnb-liveline",
            )  # updates replace the element: no locator
            assert _on_screen(page, f"{train} .hvdnb-liveline"), "running cell off-screen"
            assert _on_screen(page, ".hvdnb-panel .hvdnb-view"), "panel off-screen"
            _shot(page, "2-live-beside-running-cell")
            # drag the warmup slider while the cell still runs
            page.wait_for_selector(".hvdnb-knob-warmup_steps .noUi-handle", timeout=30_000)
            handle = page.locator(".hvdnb-knob-warmup_steps .noUi-handle").first
            handle.scroll_into_view_if_needed()
            box = handle.bounding_box()
            assert box is not None
            page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            page.mouse.down()
            page.mouse.move(box["x"] + 60, box["y"] + box["height"] / 2, steps=8)
            page.mouse.up()
            status = page.locator(".hvdnb-knob-status")
            try:
                page.wait_for_function(
                    "() => (document.querySelector('.hvdnb-knob-status')||{}).innerText"
                    "?.includes('applied on ranks 0,1 at step')",
                    timeout=30_000,
                )
            except Exception:
                _shot(page, "knob-timeout")
                raise AssertionError(f"knob not applied; status: {status.inner_text()!r}")
            assert _cell_busy(page, 2), "the change was applied only after the cell ended"
            text = status.inner_text()
            _shot(page, "3-knob-applied")
            assert " at step " in text and "late" not in text, text
            applied_step = int(
                text.split("applied on ranks 0,1 at step ")[1].split()[0].strip(",;")
            )
            # the plot marks the step
            page.wait_for_selector(".hvdnb-view .hvdnb-mark", state="attached", timeout=10_000)
            # the cell ends, then the queued one runs (no message was lost)
            page.wait_for_selector(
                ".jp-OutputArea-output:has-text('after the training cell')",
                state="attached",
                timeout=120_000,
            )
            page.wait_for_selector("text=/applied \\[\\(/", state="attached", timeout=30_000)
            out = cells.nth(2).locator(".jp-OutputArea").inner_text()
            assert f"[0,1] applied [({applied_step}," in out, out
            # a second run: overlaid on the runs chart, its knob values in the legend
            page.wait_for_function(
                "() => [...document.querySelectorAll('.hvdnb-runs .hvdnb-legend')]"
                ".some(e => e.innerText.includes('run 2: batch_size=64'))",
                timeout=120_000,
            )
            legend = page.locator(".hvdnb-runs").first.inner_text()
            assert "run 1: batch_size=32 warmup_steps=20" in legend, legend
            assert f"@ {applied_step}" in legend, legend  # run 1's change, in its label
            runs_svg = page.evaluate("() => document.querySelector('.hvdnb-runs svg').outerHTML")
            assert runs_svg.count("<polyline") >= 2, "the two runs are not both drawn"
            page.locator(".hvdnb-runs").first.scroll_into_view_if_needed()
            _shot(page, "4-runs-compared")
            # one click closes the side panel (its tab), one click brings it back
            page.locator(
                ".lm-TabBar-tab:has-text('hvdnb panel') .lm-TabBar-tabCloseIcon"
            ).first.click()
            page.wait_for_selector(".hvdnb-panel", state="detached", timeout=10_000)
            # click() scrolls it into view itself and re-finds the button when the cell's
            # output is redrawn meanwhile (a separate scroll call fails if it is replaced)
            cells.nth(0).locator(".hvdnb-show-panel").click()
            page.wait_for_selector(".hvdnb-panel .hvdnb-view", timeout=15_000)
            assert page.locator(".jp-Notebook .hvdnb-panel").count() == 0  # beside, again
            assert _on_screen(page, ".hvdnb-panel .hvdnb-view")
            _shot(page, "5-brought-back")
            # a saved notebook keeps a picture of the panel in the %dist start cell
            # the last click was in the side panel: make the notebook current, then save
            page.locator(".lm-TabBar-tab:has-text('panel.ipynb')").first.click()
            page.keyboard.press("Control+s")
            nb_path = lab["root"] / "work" / "panel.ipynb"
            deadline = time.monotonic() + 20
            bundles: list[dict] = []
            while time.monotonic() < deadline:
                nb = json.loads(nb_path.read_text())
                bundles = [o.get("data", {}) for o in nb["cells"][0].get("outputs", [])]
                if any("image/png" in b for b in bundles):
                    break
                time.sleep(0.5)
            assert any("image/png" in b for b in bundles), [list(b) for b in bundles]
        finally:
            _shot(page, "last")
            browser.close()
