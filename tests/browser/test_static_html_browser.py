"""The saved notebook tells the story without a kernel: a notebook shaped like lesson 04
(``%dist start``, two training cells that log every step through Horovod's optimizer, a
line printed by each rank, ``%dist stop``) executed by ``hvdnb run``'s runner on 2 CPU
ranks, turned into nbconvert's HTML and read in headless Chromium with every request off
the file refused (no CDN: ipywidgets' html-manager cannot load, as offline):

- the ``%dist start`` cell shows the panel's picture (every run, with the runs chart: a
  taller picture than a training cell's), not an empty widget view;
- each training cell has its final live line (``run N done · step ...``) and its run's
  picture, and adds at most 150 KB to the ``.ipynb``;
- the ranks' lines are tagged by rank.

``bench/walk_static.py`` runs the same checks on lessons 04 and 10. Screenshot:
``test-artifacts/static-html-test.png``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser._lab import ARTIFACTS, CHROMIUM, write_notebook
from tests.browser._static import DONE_LINE, RANK_TAG, cell_bytes, execute, look, verdicts

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.mpi, pytest.mark.timeout(300)]

TRAIN = """%%distributed
import torch, torch.nn as nn, torch.nn.functional as F
import hvdnb, hvdnb.torch as hvd
hvd.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr={lr}),
                               named_parameters=model.named_parameters())
g = torch.Generator().manual_seed(hvd.rank())
for step in range(150):
    x = torch.randn(32, 16, generator=g)
    loss = F.cross_entropy(model(x), (x[:, 0] > 0).long())
    opt.zero_grad()
    loss.backward()
    opt.step()
    hvdnb.log(step, loss, samples=32, total_steps=150)
print(f"rank {{hvd.rank()}}: final loss {{loss.item():.3f}}")
"""


def test_the_executed_copy_shows_each_run_and_the_start_cells_picture(tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not found: apt-get install chromium to run the browser tests")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    pytest.importorskip("nbconvert")
    src = tmp_path / "src" / "shaped-like-04.ipynb"
    src.parent.mkdir()
    write_notebook(
        src,
        [
            ("code", "%load_ext hvdnb\n%dist start -n 2"),
            ("markdown", "Two runs, as lesson 04 trains."),
            ("code", TRAIN.format(lr=0.1)),
            ("code", TRAIN.format(lr=0.5)),
            ("code", "%dist stop"),
        ],
    )
    done = execute(src, tmp_path)
    cells = look(done["html"], ARTIFACTS / "static-html-test.png")
    sizes = cell_bytes(done["ipynb"])
    v = verdicts(cells, sizes, training=2)
    start, first, second = cells[0], cells[1], cells[2]
    # the start cell: its picture, no widget view left for a script that never loads
    assert start["widget_views"] == 0, start
    assert v["start_picture_shown"], (v, start["images"], first["images"])
    assert "beside the notebook" not in start["text"], start["text"]
    # each training cell: its run's last line and picture, small enough
    assert v["training_cells"] == 2, [c["livelines"] for c in cells]
    for n, cell in enumerate((first, second), 1):
        assert DONE_LINE.match(cell["livelines"][-1]), cell["livelines"]
        assert f"run {n} done · step 150/150" in cell["livelines"][-1], cell["livelines"]
        assert any("hvdnb-run-picture" in cls and w > 300 for cls, w, _ in cell["images"]), cell
        # tagged by rank: each rank's own line, or the ranks that printed it
        assert len(RANK_TAG.findall(cell["text"])) >= 2, cell["text"][-400:]
    assert v["at_most_150_kb"], v["kb_per_training_cell"]
