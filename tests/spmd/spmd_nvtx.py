"""NVTX ranges from hvdnb.phase and DistributedOptimizer's buckets, as Nsight would see them.

This machine has no CUDA, so torch's NVTX calls are replaced by recorders and hvdnb is
told CUDA is in use (``_nvtx.active``); the GPU test of ``tests/unit/test_nvtx.py`` covers
the real calls. Checks: one push/pop pair per phase block, one start/end range per bucket
per step from its launch (during backward) to the end of synchronize's wait, every range
closed, names as documented in ``hvdnb/_nvtx.py``.
"""

from __future__ import annotations

import itertools

import _spmd

_spmd.setup()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvdnb  # noqa: E402
import hvdnb.torch as hvd  # noqa: E402
from hvdnb.rank import nvtx as _nvtx  # noqa: E402

events: list[tuple[str, object]] = []
ids = itertools.count(1)


def _start(name: str) -> int:
    i = next(ids)
    events.append(("start", (name, i)))
    return i


torch.cuda.nvtx.range_push = lambda name: events.append(("push", name))  # type: ignore
torch.cuda.nvtx.range_pop = lambda: events.append(("pop", None))  # type: ignore
torch.cuda.nvtx.range_start = _start  # type: ignore
torch.cuda.nvtx.range_end = lambda i: events.append(("end", i))  # type: ignore
_nvtx.active = lambda: True  # type: ignore[assignment]

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), groups=2
)
steps = 3
for _ in range(steps):
    with hvdnb.phase("data"):
        x, y = torch.randn(4, 8), torch.tensor([0, 1, 0, 1])
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()

pushes = [e for e in events if e[0] in ("push", "pop")]
assert pushes == [("push", "data"), ("pop", None)] * steps, pushes
starts = [e[1] for e in events if e[0] == "start"]
ends = [e[1] for e in events if e[0] == "end"]
names = sorted({n for n, _ in starts})
assert names == ["allreduce bucket.0", "allreduce bucket.1"], names
assert len(starts) == 2 * steps and sorted(ends) == sorted(i for _, i in starts), (starts, ends)
# a bucket's range ends after every bucket of its step started (synchronize waits in order)
first_end = next(k for k, e in enumerate(events) if e[0] == "end")
assert sum(1 for e in events[:first_end] if e[0] == "start") == 2, events
print(f"OK spmd_nvtx ({len(starts)} bucket ranges, {len(pushes) // 2} phase ranges)")
