"""The panel where the person looks, in real front ends driven by headless Chromium: the
page, not the kernel, says where it drew the panel, and a page reloaded mid-training
gets the panel back while the cell still trains.

- JupyterLab (with jupyterlab-sidecar): ``%dist start`` opens the panel beside the
  notebook; once the page drew it there, the cell's stand-in says so. The training cell,
  below the fold, is held until the test releases it; the page is reloaded while it
  trains, and the panel is back beside the notebook before the cell is released (a page
  that loads asks the kernel for its widgets, and hvdnb answers on its subshell:
  ``hvdnb.notebook.panel.kernel.serve_page_loads``).
- Jupyter Notebook 7 (the same server's ``/notebooks/`` page): no side area, so no
  report; the ``%dist start`` cell says so and shows the panel itself.

Screenshots: ``test-artifacts/page-*.png``.
"""

from __future__ import annotations

import time

import pytest

from tests.browser._lab import ARTIFACTS, lab_page, write_notebook

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(400)]

START = "%load_ext hvdnb\n%dist start -n 2"

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

FILLER = "\n\n".join(
    f"Paragraph {i}: what a lesson says between the start and the training cell, enough "
    "to push that cell below the fold."
    for i in range(14)
)


@pytest.fixture(scope="module")
def lab(lab_server):
    return lab_server


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"page-{name}.png"))


SIDE = "document.querySelectorAll('.hvdnb-panel').length > document.querySelectorAll('.jp-Notebook .hvdnb-panel').length"


def test_jupyterlab_says_the_panel_is_beside_and_a_reload_mid_cell_brings_it_back(lab, capsys):
    release = lab["work"] / "release-lab"
    write_notebook(
        lab["work"] / "reload.ipynb",
        [("code", START), ("markdown", FILLER), ("code", HELD.format(release=str(release)))],
    )
    with lab_page(lab, "reload.ipynb", last=lambda pg: _shot(pg, "lab-last")) as page:
        try:
            cells = page.locator(".jp-Notebook .jp-Cell")
            cells.nth(0).click()
            page.keyboard.press("Shift+Enter")
            page.wait_for_function(SIDE, timeout=120_000)  # drawn beside the notebook
            # the stand-in follows the page's report, never a guess
            page.wait_for_selector(".jp-Notebook .hvdnb-stub-shown", timeout=30_000)
            assert page.locator(".jp-Notebook .hvdnb-panel").count() == 0
            _shot(page, "lab-1-started")
            page.keyboard.press("Shift+Enter")  # the markdown
            cells.nth(2).scroll_into_view_if_needed()
            cells.nth(2).click()
            page.keyboard.press("Shift+Enter")
            page.wait_for_selector(".jp-Notebook .hvdnb-liveline", timeout=90_000)
            _shot(page, "lab-2-training")
            page.reload()
            t0 = time.monotonic()
            page.wait_for_load_state("domcontentloaded")
            page.wait_for_function(SIDE, timeout=90_000)
            back = time.monotonic() - t0
            # the cell is held until the test releases it: the panel came back while it ran
            assert not release.exists()
            # and the page settles on saying the kernel is busy: each of the page's own
            # requests answered on the subshell ends with an idle (the page waits for it)
            # and then the running cell's busy again, so "Idle" may show for a moment, but
            # two looks a second apart, after the page's requests, both read "Busy"
            deadline = time.monotonic() + 30
            looks: list[str] = []
            while time.monotonic() < deadline and looks[-2:] != ["Busy", "Busy"]:
                bar = page.locator(".jp-StatusBar-Widget").all_inner_texts()
                looks.append("Busy" if any("| Busy" in t for t in bar) else "not busy")
                time.sleep(1.0)
            assert looks[-2:] == ["Busy", "Busy"], looks
            _shot(page, "lab-3-after-reload")
        finally:
            release.touch()
    with capsys.disabled():
        print(
            f"\n    reload mid-cell: panel back beside the notebook {back:.1f} s after the reload"
        )


def test_notebook_7_shows_the_panel_in_the_start_cell(lab):
    write_notebook(lab["work"] / "nb7.ipynb", [("code", START), ("code", "1 + 1")])
    # Notebook 7's kernel indicator is an icon: its name is shown once the page is up, and a
    # cell run before the kernel is ready waits for it, as in JupyterLab
    with lab_page(
        lab,
        "nb7.ipynb",
        last=lambda pg: _shot(pg, "nb7-last"),
        front_end="notebooks",
        ready="text=Python 3 (hvdnb)",
    ) as page:
        assert page.locator(".jp-LabShell").count() == 0  # Notebook 7's own shell
        page.locator(".jp-Notebook .jp-Cell").nth(0).click()
        page.keyboard.press("Shift+Enter")
        # shown where the person looks: in the cell, with the line saying why
        page.wait_for_selector(".jp-Notebook .hvdnb-panel", state="visible", timeout=120_000)
        note = page.locator(".jp-Notebook .hvdnb-stub-missing")
        note.wait_for(timeout=30_000)
        assert "no side area" in note.inner_text()
        assert page.locator(".jp-Notebook .hvdnb-stub-shown").count() == 0
        page.wait_for_selector(".jp-Notebook .hvdnb-view", state="visible", timeout=30_000)
        _shot(page, "nb7-panel-in-cell")
