"""The live-tuning journey in a real JupyterLab, driven by headless Chromium (Debian's,
via Playwright).

One server fixture per module. The notebook has ``%dist start`` at the top, then enough
text to push the training cell below the fold, as a real notebook does. The test starts
2 ranks (the panel opens beside the notebook), runs the training cell, and while it is
still running checks that the panel and the running cell are on screen together, that
the panel redraws at least 3 times and the live line under the cell updates; that the
three knob sliders (``batch_size``, ``warmup_steps``, ``lr``) each have a usable track and
a whole label at JupyterLab's default split; drags each to a value (aimed from the
track's box and the slider's bounds) and sees both ranks apply it at one step (the
status line, and each rank's ``knobs.history`` printed when the cell ends); that the
loss chart's ticks are round; and that hovering the loss chart shows the step and each
rank's loss. A second, shorter run then appears overlaid on the runs chart with its knob
values in the legend, and a saved notebook keeps the panel's picture. Screenshots go to
``test-artifacts/`` (``panel-hover.png``, ``panel-hover-chart.png``: the readout).
"""

from __future__ import annotations

import ast
import json
import math
import re
import time
from pathlib import Path

import pytest

from tests.browser._lab import ARTIFACTS, lab_page, write_notebook

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]


TRAIN = """%%distributed
import time, torch, hvdnb
import hvdnb.torch as hvd
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
knobs = hvdnb.knobs(batch_size=32, warmup_steps=20, lr=0.1)
seen = []
step = 0
# until the test has moved the three sliders, and 150 steps more (at most 6,000 steps):
# a condition both ranks reach at the same step (a clock could part them at a collective)
while step < 50 or (step < 6000 and not (
        len(knobs.history) >= 3 and step > knobs.history[-1][0] + 150)):
    knobs.step(step)
    seen.append(knobs.warmup_steps)
    x = torch.randn(knobs.batch_size, 64)
    y = (x[:, :4]).argmax(1)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    hvdnb.log(step, loss, samples=knobs.batch_size)
    time.sleep(0.02)
    step += 1
hvdnb.metrics.get_recorder().flush()
print("applied", [(h[0], h[1], h[2]) for h in knobs.history])
print("rank", hvd.rank(), "history", [(h[0], h[1]) for h in knobs.history])
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


START = 'import os\nos.environ["HVDNB_COLLAPSE_WINDOW"] = "60"\n%load_ext hvdnb\n%dist start -n 2'

#: the panel is in no cell of the notebook (it is beside it)
NOT_IN_CELL = "() => document.querySelectorAll('.jp-Notebook .hvdnb-panel').length === 0"


def _notebook(path: Path) -> None:
    filler = "\n\n".join(
        f"Paragraph {i}: text a real lesson has between the start and the "
        "training cell, long enough to push that cell below the fold."
        for i in range(14)
    )
    write_notebook(
        path,
        [
            # a merge window (read by the kernel at each cell) far longer than any rank
            # lags on a loaded box: the line both ranks print is "[0,1] applied ...",
            # shown as soon as the second prints it
            ("code", START),
            ("markdown", filler),
            ("code", TRAIN),
            ("code", "print('after the training cell')"),
            ("code", RUN2),
        ],
    )


@pytest.fixture(scope="module")
def lab(lab_server):
    _notebook(lab_server["work"] / "panel.ipynb")
    return lab_server


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


#: the knobs the training cell makes, and where the test drags each slider
KNOBS = {"warmup_steps": 50, "batch_size": 48, "lr": 0.01}
#: their sliders' bounds (controls.py: an int to max(4 x value, 100), lr two decades
#: either side of 0.1, in exponents)
SLIDER_BOUNDS = {"warmup_steps": (0, 100), "batch_size": (1, 128), "lr": (-3, 1)}


def _slider_geometry(page) -> dict:
    """Per knob slider: its track's width, its label's text and whether it is cut."""
    return page.evaluate(
        """(names) => Object.fromEntries(names.map(n => {
            const w = document.querySelector(`.hvdnb-panel .hvdnb-knob-${n}`);
            const track = w.querySelector('.noUi-target').getBoundingClientRect();
            const label = w.querySelector('.widget-label');
            return [n, {track: track.width, label: label.innerText.trim(),
                        labelScroll: label.scrollWidth, labelClient: label.clientWidth}];
        }))""",
        list(KNOBS),
    )


def _scroll_to(page, sel: str) -> None:
    """Scroll the element of ``sel`` into the middle of the view, found by selector at the
    moment of the scroll: the panel redraws several times a second and a located element
    is replaced meanwhile (CI: "Element is not attached to the DOM" after a redraw)."""
    page.wait_for_selector(sel, state="attached", timeout=30_000)
    page.evaluate("(sel) => document.querySelector(sel).scrollIntoView({block: 'center'})", sel)


def _drag_to(page, name: str, target: float) -> float:
    """Drag the knob's slider handle to ``target`` (log position for a float knob: the
    slider's bounds are exponents) and return the value its readout shows after."""
    sel = f".hvdnb-panel .hvdnb-knob-{name}"
    _scroll_to(page, sel)
    info = page.evaluate(
        """(sel) => { const w = document.querySelector(sel);
            const b = w.querySelector('.noUi-base').getBoundingClientRect();
            const h = w.querySelector('.noUi-handle').getBoundingClientRect();
            const s = w.querySelector('.noUi-target').noUiSlider;
            const r = s ? s.options.range : null;
            const v = (x) => (r ? [].concat(x)[0] : null);
            return {left: b.left, width: b.width, hx: h.left + h.width / 2,
                    hy: h.top + h.height / 2, lo: r && v(r.min), hi: r && v(r.max)}; }""",
        sel,
    )
    if info["lo"] is None:  # no noUiSlider API on the element: the bounds controls.py sets
        info["lo"], info["hi"] = SLIDER_BOUNDS[name]
    pos = math.log10(target) if name == "lr" else target
    frac = (pos - info["lo"]) / (info["hi"] - info["lo"])
    x = info["left"] + frac * info["width"]
    page.mouse.move(info["hx"], info["hy"])
    page.mouse.down()
    page.mouse.move(x, info["hy"], steps=10)
    page.mouse.up()
    text = page.locator(f"{sel} .widget-readout").first.inner_text().strip()
    shown = float(text.replace(",", ""))
    tolerance = 0.1 if name == "lr" else 0.03  # a pixel's worth (of the decades: 10 %)
    span = 1.0 if name == "lr" else info["hi"] - info["lo"]
    off = abs(math.log10(shown) - pos) if name == "lr" else abs(shown - target) / span
    assert off <= tolerance, f"{name}: aimed at {target}, the readout says {text}"
    return shown


def _wait_applied(page, name: str, shown: float) -> tuple[int, float]:
    """Wait until the status says both ranks applied ``name`` (at its new value) at one
    step; returns (step, value)."""
    fn = """([name, shown]) => {
        const t = (document.querySelector('.hvdnb-knob-status') || {}).innerText || '';
        const m = t.match(new RegExp(name + '=([0-9.e+-]+)'));
        return t.includes('applied on ranks 0,1 at step') && m
            && Math.abs(parseFloat(m[1]) - shown) <= 0.01 * Math.abs(shown) ? t : null; }"""
    try:
        handle = page.wait_for_function(fn, arg=[name, shown], timeout=30_000)
    except Exception:
        _shot(page, "knob-timeout")
        status = page.locator(".hvdnb-knob-status").inner_text()
        raise AssertionError(f"{name}={shown} not applied; status: {status!r}") from None
    text = handle.json_value()
    assert " at step " in text and "late" not in text, text
    step = int(text.split("applied on ranks 0,1 at step ")[1].split()[0].strip(",;"))
    value = float(re.search(name + r"=([0-9.e+-]+)", text).group(1))
    return step, value


def _tick_value(text: str) -> float:
    """An axis label as a number: ``1,500``, ``20k``, ``2.5e-4``."""
    t = text.replace(",", "").strip()
    scale = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}.get(t[-1:], 1.0)
    return float(t[:-1] if scale != 1.0 else t) * scale


def _is_125(values: list[float]) -> bool:
    """Two or more ticks evenly 1, 2 or 5 x 10^k apart (or whole decades, log axis)."""
    if len(values) < 2:
        return False
    diffs = [b - a for a, b in zip(values, values[1:])]
    ratios = [b / a for a, b in zip(values, values[1:]) if a > 0]
    even = all(math.isclose(d, diffs[0], rel_tol=1e-6) for d in diffs)
    mant = diffs[0] / 10 ** math.floor(math.log10(diffs[0])) if diffs[0] > 0 else 0
    decades = len(ratios) == len(diffs) and all(math.isclose(r, 10) for r in ratios)
    return (even and any(math.isclose(mant, m) for m in (1, 2, 5))) or decades


_LOSS_SVG = "svg.hvdnb-chart[data-title^='loss']"


def _hover_loss(page) -> str:
    """Point at the middle of the loss chart's plot and return the readout the chart
    shows (its text), waiting for it (the panel redraws the chart while a cell runs)."""
    page.evaluate("(s) => document.querySelector(s).scrollIntoView({block: 'center'})", _LOSS_SVG)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        box = page.evaluate(
            "(s) => { const r = document.querySelector(s).getBoundingClientRect();"
            " return {x: r.left, y: r.top}; }",
            _LOSS_SVG,
        )
        for dx in (0, 3):  # a move over the plot: the column under it is :hover
            page.mouse.move(box["x"] + 52 + 0.55 * 398 + dx, box["y"] + 22 + 110)
        text = page.evaluate(
            "(s) => { const v = [...document.querySelectorAll(s + ' .readout')]"
            ".filter(e => getComputedStyle(e).visibility === 'visible');"
            " return v.length === 1 ? [...v[0].querySelectorAll('text')]"
            ".map(t => t.textContent).join(' | ') : ''; }",
            _LOSS_SVG,
        )
        if text:
            return text
        time.sleep(0.2)
    raise AssertionError("no readout shown while hovering the loss chart")


def _shot_loss_chart(page, name: str) -> None:
    """A picture of the loss chart alone, readout included (the mouse stays over it)."""
    ARTIFACTS.mkdir(exist_ok=True)
    box = page.evaluate(
        "(s) => { const r = document.querySelector(s).getBoundingClientRect();"
        " return {x: r.left, y: r.top, width: r.width, height: r.height}; }",
        _LOSS_SVG,
    )
    page.screenshot(path=str(ARTIFACTS / f"panel-{name}.png"), clip=box)


def test_live_tuning_journey(lab):
    with lab_page(lab, "panel.ipynb", last=lambda pg: _shot(pg, "last")) as page:
        cells = page.locator(".jp-Notebook .jp-Cell")
        cells.nth(0).click()
        page.keyboard.press("Shift+Enter")  # %dist start: the panel opens beside
        page.wait_for_selector(".hvdnb-panel", timeout=120_000)
        page.wait_for_function(
            "() => ![...document.querySelectorAll('.jp-InputPrompt')][0].innerText.includes('*')",
            timeout=120_000,
        )
        # in the side area, not in the notebook's cell output
        # the panel leaves the cell once the page reports its view beside the notebook
        page.wait_for_function(NOT_IN_CELL, timeout=30_000)
        assert page.locator(".jp-Notebook .hvdnb-show-panel").count() == 1
        _shot(page, "1-started")
        page.keyboard.press("Shift+Enter")  # the markdown cell
        # the training cell, below the fold, then one queued behind it
        _scroll_to(page, ".jp-Notebook .jp-Cell:nth-child(3)")
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
        # three knob sliders, one per row: each track wide enough to aim at a value
        # and each label whole (side by side at JupyterLab's default split, the
        # tracks were 0 px wide and the labels cut to "warmup_s...")
        for name in KNOBS:
            page.wait_for_selector(f".hvdnb-knob-{name} .noUi-handle", timeout=30_000)
        geometry = _slider_geometry(page)
        for name in KNOBS:
            g = geometry[name]
            assert g["track"] > 80, f"{name}'s track is {g['track']:.0f} px wide: {geometry}"
            assert g["label"] == name, geometry
            assert g["labelScroll"] <= g["labelClient"], f"{name}'s label is cut: {g}"
        # the panel redraws several times a second: scroll by selector, not by a located
        # element that a redraw may replace meanwhile ("not attached to the DOM", once in CI)
        page.evaluate(
            "(sel) => document.querySelector(sel).scrollIntoView({block: 'center'})",
            ".hvdnb-panel .hvdnb-knob-lr",
        )
        _shot(page, "3-knobs")
        # drag each slider to a value while the cell still runs; both ranks apply it
        # at one step (rank 0 picks the step)
        applied: dict[str, tuple[int, float]] = {}
        for name, target in KNOBS.items():
            shown = _drag_to(page, name, target)
            step, value = _wait_applied(page, name, shown)
            applied[name] = (step, value)
            assert _cell_busy(page, 2), "the change was applied only after the cell ended"
            if name == "warmup_steps":
                _shot(page, "3-knob-applied")
                # the plot marks the step
                page.wait_for_selector(".hvdnb-view .hvdnb-mark", state="attached", timeout=60_000)
        applied_step = applied["warmup_steps"][0]
        # the loss chart's ticks are round (1, 2 or 5 x 10^k apart), on both axes
        ticks = page.evaluate(
            "(sel) => { const s = document.querySelector(sel);"
            " const t = (c) => [...s.querySelectorAll(c + ' text')].map(e => e.textContent);"
            " return {x: t('.hvdnb-ticks-x'), y: t('.hvdnb-ticks-y')}; }",
            _LOSS_SVG,
        )
        for axis in ("x", "y"):
            values = [_tick_value(v) for v in ticks[axis]]
            assert _is_125(values), f"{axis} ticks not round: {ticks[axis]}"
        # hovering the loss chart shows the step and each rank's loss there
        readout = _hover_loss(page)
        assert readout.startswith("step ") and "rank 0" in readout and "rank 1" in readout
        _shot(page, "hover")
        _shot_loss_chart(page, "hover-chart")
        # the cell ends, then the queued one runs (no message was lost)
        page.wait_for_selector(
            ".jp-OutputArea-output:has-text('after the training cell')",
            state="attached",
            timeout=180_000,
        )
        page.wait_for_selector("text=/applied \\[\\(/", state="attached", timeout=30_000)
        out = cells.nth(2).locator(".jp-OutputArea").inner_text()
        assert f"[0,1] applied [({applied_step}," in out, out
        # each rank's own history: the three changes, each at the step the status
        # said, with the value the slider showed
        histories = {
            int(m.group(1)): ast.literal_eval(m.group(2))
            for m in re.finditer(r"rank (\d) history (\[.*\])", out)
        }
        assert set(histories) == {0, 1} and histories[0] == histories[1], out
        got = {name: (st, v) for st, vals in histories[0] for name, v in vals.items()}
        assert set(got) == set(KNOBS), got
        for name, (st, v) in applied.items():
            assert got[name][0] == st, (name, got[name], st)
            assert math.isclose(got[name][1], v, rel_tol=1e-2), (name, got[name], v)
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
        _scroll_to(page, ".hvdnb-runs")
        _shot(page, "4-runs-compared")
        # one click closes the side panel (its tab), one click brings it back
        page.locator(".lm-TabBar-tab:has-text('hvdnb panel') .lm-TabBar-tabCloseIcon").first.click()
        page.wait_for_selector(".hvdnb-panel", state="detached", timeout=60_000)
        # click() scrolls it into view itself and re-finds the button when the cell's
        # output is redrawn meanwhile (a separate scroll call fails if it is replaced)
        cells.nth(0).locator(".hvdnb-show-panel").click()
        page.wait_for_selector(".hvdnb-panel .hvdnb-view", timeout=60_000)
        page.wait_for_function(NOT_IN_CELL, timeout=30_000)  # beside, again
        assert _on_screen(page, ".hvdnb-panel .hvdnb-view")
        _shot(page, "5-brought-back")
        # a saved notebook keeps a picture of the panel in the %dist start cell
        # the last click was in the side panel: make the notebook current, then save
        page.locator(".lm-TabBar-tab:has-text('panel.ipynb')").first.click()
        page.keyboard.press("Control+s")
        nb_path = lab["root"] / "work" / "panel.ipynb"
        deadline = time.monotonic() + 60  # read again until the picture is there
        bundles: list[dict] = []
        while time.monotonic() < deadline:
            nb = json.loads(nb_path.read_text())
            bundles = [o.get("data", {}) for o in nb["cells"][0].get("outputs", [])]
            if any("image/png" in b for b in bundles):
                break
            time.sleep(0.5)
        assert any("image/png" in b for b in bundles), [list(b) for b in bundles]
