"""The saved notebook tells the whole story without a kernel: each training cell ends with
its final live line and a picture of its run, and the ``%dist start`` cell's picture has the
runs chart. Run with ``hvdnb run`` (nbclient, as CI and course builds execute notebooks),
at 1, 2 and 3 ranks; the saved copy is read back, and the pictures are decoded, not only
found. The pictures are drawn off the cells' path (a background thread when a cell ends)
and put in by display id (``hvdnb.notebook.panel.layout.Panel.cell_ended``).
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]

TRAIN = """%%distributed
import time, torch, hvdnb
torch.manual_seed({seed})
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range({steps}):
    x = torch.randn(16, 8)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    hvdnb.log(step, loss, samples=16)
    time.sleep(0.005)
print("trained", {steps})
"""


def _png_size(b64: str) -> tuple[int, int]:
    from matplotlib import image

    arr = image.imread(io.BytesIO(base64.b64decode(b64)), format="png")
    return int(arr.shape[1]), int(arr.shape[0])


@pytest.mark.parametrize("n", [1, 2, 3])
def test_hvdnb_run_saves_each_training_cell_with_its_line_and_picture(tmp_path, n):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "hvdnb", "display_name": "Python 3 (hvdnb)"}
    nb.cells = [
        nbformat.v4.new_code_cell(f"%load_ext hvdnb\n%dist start -n {n}"),
        nbformat.v4.new_code_cell(TRAIN.format(seed=0, steps=120)),
        nbformat.v4.new_code_cell(TRAIN.format(seed=1, steps=80)),  # straight after: no idle
    ]
    src = tmp_path / "story.ipynb"
    nbformat.write(nb, src)
    out = tmp_path / "story.out.ipynb"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    args = ["--oversubscribe"] if n > 2 else []
    proc = subprocess.run(
        [sys.executable, "-m", "hvdnb.notebook.headless.cli", "run", str(src), "-o", str(out)]
        + args,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = nbformat.read(out, as_version=4)
    assert len(saved.cells) == 3, [c.source[:30] for c in saved.cells]  # no helper cell left
    for i, (run, steps) in enumerate([(1, 120), (2, 80)], start=1):
        cell = saved.cells[i]
        pictures = [o for o in cell.outputs if "image/png" in o.get("data", {})]
        assert len(pictures) == 1, [list(o.get("data", {})) for o in cell.outputs]
        data = pictures[0]["data"]
        line = data["text/plain"]
        # the final live line, of this cell's run (not the next one's): steps done
        assert line.startswith(f"run {run} done") and f"step {steps} " in line, line
        w, h = _png_size(data["image/png"])
        assert w >= 600 and h >= 400, (w, h)
        assert "hvdnb-run-picture" in data["text/html"]
        size = len(json.dumps(cell.outputs))
        assert size <= 150_000, size
        text = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
        assert f"trained {steps}" in text, text
    # the start cell's picture: with the runs chart below the four (three rows, not two)
    start = [o for o in saved.cells[0].outputs if "image/png" in o.get("data", {})]
    assert start, [list(o.get("data", {})) for o in saved.cells[0].outputs]
    w, h = _png_size(start[-1]["data"]["image/png"])
    assert h > w * 0.8, (w, h)  # 10 x 9.3 in: the runs row is there
