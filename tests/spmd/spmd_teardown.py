"""Exit is clean after training: the process group really goes away at shutdown.

torch.distributed.nn.functional binds ``group.WORLD`` as default arguments when imported,
and building the first optimizer imports it. Imported after the process group existed, it
kept the group alive past ``destroy_process_group``: gloo's worker threads then lived into
interpreter teardown, and one that dropped a finished collective's tensor there aborted
the process (exit -6 after a successful run, one torchrun run in four on a loaded machine).
The race is rare; its precondition is not: this script checks that no gloo thread is left
once hvdnb's exit handlers (the same functions atexit calls) have run.

A collective error that the script caught does the same: its traceback's frames hold the
transport, and so the group, in a reference cycle that only the garbage collector frees
(spmd_horovod aborted at exit three runs in ten under torchrun before the exit handler
collected first). The script keeps one such error on purpose.
"""

from __future__ import annotations

import os

import _spmd

_spmd.setup()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvdnb.rank.script  # noqa: E402
import hvdnb.torch as hvd  # noqa: E402
from hvdnb.rank import rendezvous  # noqa: E402


def gloo_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return [n for n in names if "gloo" in n]


w = hvdnb.rank.script.init()
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for _ in range(3):
    loss = F.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 0, 1]))
    opt.zero_grad()
    loss.backward()
    opt.step()
hvd.allgather(torch.tensor([float(w.rank)]))
try:  # ranks disagree on the shape: raises on every rank, the traceback forms a cycle
    if w.size > 1:
        hvd.allreduce(torch.ones(w.rank + 1), name="mismatch")
    else:  # one rank cannot disagree: a bad op raises from the same call path instead
        hvd.allreduce(torch.ones(1), name="mismatch", op=12345)
except Exception as exc:
    caught = exc
assert "caught" in globals(), "a mismatched allreduce must raise"
del caught  # the cycle (error -> traceback -> frames) stays: only gc can free it
uses_gloo = bool(gloo_threads())  # under mpiexec hvdnb may carry everything over MPI
hvd.shutdown()
rendezvous._shutdown()  # what atexit runs, in the same order
left = gloo_threads()
assert not left, f"gloo threads still running after shutdown: {left}"
print(f"OK spmd_teardown (gloo threads during training: {uses_gloo}, after: {len(left)})")
