"""A compiled DDP model on a real 2-rank cluster (issue 46, item 5): hvdnb's automatic DDP
timing (``hvdnb.rank.frameworks.ddp_hooks``) adds no graph break and no Dynamo warning.

One cell trains the same MLP twice under ``torch.compile`` (the ``aot_eager`` backend: the
graph breaks and DDP's split are Dynamo's, the backend only compiles what it is given):
built as every DDP model on a rank is (hvdnb's hooks), and built with torch's own
``DistributedDataParallel.__init__`` (no hvdnb). Dynamo's graph breaks, its graphs and
DDPOptimizer's split of each graph per bucket must be the same for both, the hvdnb-built
model's buckets must still be timed, and no rank may print Dynamo's warning about a
builtin it cannot trace (``_thread.allocate_lock``: a lock taken inside the forward).
"""

from __future__ import annotations

import pytest

import hvdnb

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(180)]

COMPILED_DDP = r"""
import torch, torch.nn as nn, hvdnb
import torch._dynamo as dynamo
from torch._dynamo.backends.distributed import DDPOptimizer
from torch._dynamo.utils import counters, warn_once_cache
from torch.nn.parallel import DistributedDataParallel as DDP

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(256, 512), nn.Linear(512, 512)
        self.c, self.d = nn.Linear(512, 512), nn.Linear(512, 8)
    def forward(self, x):
        return self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))

split = []  # DDPOptimizer's buckets, per graph it compiled
_compile_fn = DDPOptimizer.compile_fn
def compile_fn(self, gm, example_inputs, **kw):
    out = _compile_fn(self, gm, example_inputs, **kw)
    split.append(len(self.buckets))
    return out

def train(model, log):
    dynamo.reset(); counters.clear(); split.clear(); warn_once_cache.clear()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(compiled.parameters(), lr=0.01)
    torch.manual_seed(1)
    for step in range(3):
        loss = compiled(torch.randn(16, 256)).square().mean()
        loss.backward(); opt.step(); opt.zero_grad()
        if log:
            hvdnb.log(step, loss)
    return dict(counters["graph_break"]), counters["stats"]["unique_graphs"], list(split)

DDPOptimizer.compile_fn = compile_fn
try:
    torch.manual_seed(0)
    timed = DDP(MLP(), bucket_cap_mb=1)  # as every DDP model on a rank: hvdnb's hooks
    hvdnb_init = DDP.__init__
    DDP.__init__ = hvdnb_init.__wrapped__  # torch's own constructor: no hvdnb
    try:
        plain = DDP(MLP(), bucket_cap_mb=1)
    finally:
        DDP.__init__ = hvdnb_init
    got = {"plain": train(plain, False), "hvdnb": train(timed, True)}
finally:
    DDPOptimizer.compile_fn = _compile_fn
got["timed"] = (bool(timed._comm_hooks), bool(plain._comm_hooks))
got
"""


def test_compiled_ddp_has_no_graph_break_from_hvdnb(dist2):
    r = hvdnb.run_cell(dist2, COMPILED_DDP, stream=False, quiet=True, timeout=150)
    for rank in range(2):
        got = r.values[rank]
        breaks, graphs, split = got["hvdnb"]
        # torch's own breaks (DDP's forward is partly eager), and its graphs, are the same
        assert (breaks, graphs, split) == got["plain"], (rank, got)
        # the MLP's 3.3 MB of parameters in 1 MB buckets: DDPOptimizer split the graph
        assert graphs >= 1 and split and min(split) > 1, (rank, got)
        assert got["timed"] == (True, False), (rank, got)  # hvdnb's timing is in place
        out = r.stdout[rank] + r.stderr[rank]
        for said in ("allocate_lock", "Dynamo does not know", "UserWarning"):
            assert said not in out, (rank, out)
    # the timing reached the panel: every bucket's collective, on every rank, every step
    df = hvdnb.metrics().to_pandas()
    df = df[(df.run == df.run.max()) & df.name.str.startswith("comm/ddp.bucket.")]
    assert sorted(df["rank"].unique()) == [0, 1], df
    assert sorted(df[df.name.str.endswith("/time")].step.unique()) == [0, 1, 2], df
