"""What ranks draw, in a real JupyterLab (headless Chromium): below the fold of a notebook
that started 2 ranks, a plain ``tqdm`` loop, a Lightning ``Trainer()`` with its default
(Rich) bar, an HF ``Trainer`` with its default notebook bar and a Keras ``fit(verbose=1)``
run one after another. Each is caught mid-run (a bar short of its end on screen) and at
its end (the final state on screen); no terminal control code is ever visible. Screenshots:
``test-artifacts/drawing-*.png``."""

from __future__ import annotations

import re
import time

import pytest

from tests.browser._lab import ARTIFACTS, lab_page, write_notebook

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(420)]

pytest.importorskip("lightning")
pytest.importorskip("transformers")

TQDM = """%%distributed
import time
from tqdm import tqdm
for i in tqdm(range(300)):
    time.sleep(0.01)
print("tqdm done")
"""

LIGHTNING = """%%distributed
import time, torch, lightning as L
class M(L.LightningModule):
    def __init__(s):
        super().__init__(); s.l = torch.nn.Linear(8, 1)
    def training_step(s, b, i):
        time.sleep(0.02)
        x, y = b; loss = torch.nn.functional.mse_loss(s.l(x), y)
        s.log("train_loss", loss, prog_bar=True); return loss
    def configure_optimizers(s):
        return torch.optim.SGD(s.parameters(), lr=0.1)
ds = torch.utils.data.TensorDataset(torch.randn(640, 8), torch.randn(640, 1))
trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False)
trainer.fit(M(), torch.utils.data.DataLoader(ds, batch_size=4))
print("lightning world size", trainer.world_size)
"""

HF = """%%distributed
import time, torch
from transformers import Trainer, TrainingArguments
class M(torch.nn.Module):
    def __init__(s):
        super().__init__(); s.l = torch.nn.Linear(8, 2)
    def forward(s, x, labels=None):
        time.sleep(0.02)
        out = s.l(x)
        return {"loss": torch.nn.functional.cross_entropy(out, labels), "logits": out}
class D(torch.utils.data.Dataset):
    def __len__(s): return 640
    def __getitem__(s, i): return {"x": torch.randn(8), "labels": torch.tensor(i % 2)}
args = TrainingArguments("/tmp/hvdnb-hf-browser", per_device_train_batch_size=4,
                         num_train_epochs=1, logging_steps=20, report_to=[],
                         save_strategy="no", use_cpu=True)
_ = Trainer(model=M(), args=args, train_dataset=D()).train()
print("hf done")
"""

KERAS = """%%distributed
import os, time
os.environ["TF_USE_LEGACY_KERAS"] = "1"
import numpy as np, tensorflow as tf
class Slow(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.01)
x = np.random.rand(2048, 8).astype("float32"); y = (x.sum(1) > 4).astype("float32")
m = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu"), tf.keras.layers.Dense(1)])
m.compile("sgd", "mse")
_ = m.fit(x, y, batch_size=8, epochs=1, verbose=1, callbacks=[Slow()])
print("keras done")
"""

#: the live-print habit on rank 0: a local kernel leaves only ``tick 4``
TICKS = """%%distributed
import time
from IPython.display import clear_output
import torch.distributed as d
for i in range(5):
    if d.get_rank() == 0:
        clear_output(wait=True)
        print(f"tick {i}")
    time.sleep(0.3)
"""

#: what each cell shows at its end (a bar's final state), and a bar short of it
CASES = [
    ("tqdm", TQDM, r"100%\|.*300/300", r"\b(\d{1,2})%\|.*\b\d{1,3}/300"),
    ("lightning", LIGHTNING, r"Epoch 0/0 .* 80/80", r"Epoch 0/0 .* ([0-7]?\d)/80"),
    ("hf-trainer", HF, r"\[80/80 ", r"\[([1-7]?\d)/80 "),
    ("keras", KERAS, r"256/256 \[=+\]", r"\b(\d{1,3})/256 \["),
]
CONTROL = re.compile(r"\x1b\[|\[\?25[lh]|\[2K|\[1A")


@pytest.fixture(scope="module")
def lab(lab_server):
    filler = "\n\n".join(f"Paragraph {i}: text above the training cells." for i in range(14))
    cells = [("code", "%load_ext hvdnb\n%dist start -n 2"), ("markdown", filler)]
    cells += [("code", code) for _, code, _, _ in CASES]
    cells += [("code", TICKS)]
    write_notebook(lab_server["work"] / "drawing.ipynb", cells)
    return lab_server


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"drawing-{name}.png"))


def test_bars_draw_in_place_mid_run_and_end_at_their_final_state(lab):
    pytest.importorskip("tf_keras", reason="Keras' progbar needs tf-keras")
    with lab_page(lab, "drawing.ipynb", last=lambda p: _shot(p, "last")) as page:
        cells = page.locator(".jp-Notebook .jp-Cell")
        cells.nth(0).click()
        page.keyboard.press("Shift+Enter")
        page.wait_for_selector(".hvdnb-panel", timeout=120_000)
        page.wait_for_function(
            "() => ![...document.querySelectorAll('.jp-InputPrompt')][0].innerText.includes('*')",
            timeout=120_000,
        )
        for i, (name, _, final, partial) in enumerate(CASES, start=2):
            cell = cells.nth(i)
            cell.scroll_into_view_if_needed()
            cell.click()
            page.keyboard.press("Shift+Enter")
            seen_partial = False
            deadline = time.monotonic() + 180
            text = ""
            while time.monotonic() < deadline:
                cell.scroll_into_view_if_needed()
                text = cell.inner_text()
                assert not CONTROL.search(text), f"{name}: a control code on screen: {text!r}"
                if not seen_partial and re.search(partial, text) and not re.search(final, text):
                    seen_partial = True
                    _shot(page, f"{name}-mid-run")
                busy = page.evaluate(
                    "(i) => [...document.querySelectorAll('.jp-InputPrompt')][i]"
                    ".innerText.includes('*')",
                    i,
                )
                if not busy and re.search(final, text):
                    break
                time.sleep(0.2)
            assert re.search(final, text), f"{name} did not end at its final state: {text[-1500:]}"
            assert seen_partial, f"{name}: no state short of the end was seen on screen"
            _shot(page, f"{name}-end")
        # clear_output(wait=True) then print, on rank 0: only its last text is on screen
        cell = cells.nth(len(CASES) + 2)
        cell.scroll_into_view_if_needed()
        cell.click()
        page.keyboard.press("Shift+Enter")
        page.wait_for_function(
            "(i) => { const p = [...document.querySelectorAll('.jp-InputPrompt')][i];"
            " return p && /\\[\\d+\\]/.test(p.innerText); }",
            arg=len(CASES) + 2,
            timeout=120_000,
        )
        cell.scroll_into_view_if_needed()
        text = cell.locator(".jp-OutputArea").inner_text()
        _shot(page, "clear-then-print")
        assert "[0] tick 4" in text, text
        assert not re.search(r"tick [0-3]\b", text), text
