"""The live line speaks only of training: on a real 2-rank cluster, a cell that builds and
uses a DDP model without logging a step (its collectives and memory still reach the store)
gets no run line; a cell that logs steps gets one."""

from __future__ import annotations

import pytest

import hvdnb
from hvdnb.notebook.metrics.store import get_store
from hvdnb.notebook.panel.liveline import LiveLine

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]

NO_STEPS = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(torch.nn.Linear(8, 2))
model(torch.randn(4, 8)).sum().backward()
t = torch.ones(2); dist.all_reduce(t)
torch.save(model.state_dict(), f"/tmp/hvdnb-liveline-{dist.get_rank()}.pt")
print("saved")
"""

STEPS = """
import hvdnb
for s in range(5):
    hvdnb.log(s, 1.0 / (s + 1), samples=4, total_steps=5)
"""


def test_a_cell_that_trains_nothing_gets_no_run_line(dist2):
    line = LiveLine(get_store(), interval=0.0)
    hvdnb.run_cell(dist2, NO_STEPS, stream=False, quiet=True)
    line(final=True)
    assert line.updates == 0
    hvdnb.run_cell(dist2, STEPS, stream=False, quiet=True)
    line(final=True)
    assert line.updates == 1
    run = get_store().current_run()
    assert run is not None and "step 5/5" in line.text(run, final=True)
