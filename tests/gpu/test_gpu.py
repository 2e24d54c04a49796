"""The GPU path on a real CUDA device: NCCL, one engine per GPU, GPU memory readings, NCCL
collective times from CUDA events, the timeline, and ranks sharing one GPU.

Skipped where no GPU is visible (the CPU suite covers the same paths over gloo/MPI).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import pytest

import hvdnb
from hvdnb.host import gpu_count
from hvdnb.notebook.cellout import cells
from hvdnb.notebook.cluster.launch import ClusterError
from hvdnb.notebook.metrics.store import attach
from tests.conftest import gpu_visible

pytestmark = [pytest.mark.gpu, pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(300)]

with gpu_visible():
    GPUS = gpu_count()
if GPUS == 0:
    pytest.skip("no CUDA GPU visible", allow_module_level=True)


def _start(n: int, **kw) -> hvdnb.Cluster:
    running = hvdnb.current()
    if running is not None and running.running:
        running.stop()
    with gpu_visible():  # the engines inherit the real GPU list
        return hvdnb.Cluster(n=n, timeout=180, **kw).start()


@pytest.fixture(scope="module")
def gpu_cluster():
    """One rank per GPU (capped at 2): the default backend is NCCL."""
    c = _start(min(GPUS, 2))
    yield c
    c.stop()


def run(c, code: str) -> dict:
    return cells.run_cell(c, code, quiet=True, stream=False).values


def test_one_engine_per_gpu_with_nccl_and_torchrun_variables(gpu_cluster):
    vals = run(
        gpu_cluster,
        """
import os, torch, torch.distributed as dist
(dist.get_backend(), torch.cuda.current_device(), int(os.environ["LOCAL_RANK"]),
 int(os.environ["WORLD_SIZE"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
""",
    )
    n = gpu_cluster.n
    for rank, (backend, dev, local, world, addr, port) in vals.items():
        assert backend == "nccl"
        assert dev == local == rank  # one host: local rank = rank, pinned to that GPU
        assert world == n and addr and port > 0


def test_nccl_allreduce_and_hvdnb_collectives_on_cuda_tensors(gpu_cluster):
    n = gpu_cluster.n
    vals = run(
        gpu_cluster,
        """
import torch, torch.distributed as dist
import hvdnb.torch as hvd
hvd.init()
r = dist.get_rank()
x = torch.full((1 << 16,), r + 1.0, device="cuda")
dist.all_reduce(x)
s = hvd.allreduce(torch.full((1000,), r + 1.0, device="cuda"), op=hvd.Sum, name="s")
a = hvd.allreduce(torch.full((1000,), r + 1.0, device="cuda"), name="a")
g = hvd.allgather(torch.full((2, 3), float(r), device="cuda"), name="g")
b = torch.full((5,), float(r), device="cuda"); hvd.broadcast_(b, root_rank=0, name="b")
h = hvd.allreduce_async(torch.ones(10, device="cuda"), op=hvd.Sum, name="h")
hs = hvd.synchronize(h)
(x[0].item(), x.device.type, s[0].item(), s.device.type, a[0].item(), g.shape[0],
 g[:, 0].tolist(), b.sum().item(), hs.sum().item(), hs.device.type)
""",
    )
    total = n * (n + 1) / 2
    for x0, xdev, s0, sdev, a0, gn, gcol, bsum, hsum, hdev in vals.values():
        assert x0 == total and xdev == "cuda"
        assert s0 == total and sdev == "cuda"
        assert a0 == pytest.approx(total / n)
        assert gn == 2 * n and gcol == [float(r) for r in range(n) for _ in range(2)]
        assert bsum == 0.0 and hsum == 10.0 * n and hdev == "cuda"


TRAIN = r"""
import torch, hvdnb
import hvdnb.torch as hvd
hvd.init()
torch.manual_seed(0)
dev = torch.device("cuda", hvd.local_rank())
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 10)).to(dev)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x, y = torch.randn(256, 1024, device=dev), torch.randint(0, 10, (256,), device=dev)
before = torch.cuda.memory_allocated()
ballast = None
for step in range(300):
    if step == 160:  # a known allocation the memory readings must show
        ballast = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    hvdnb.log(step, loss, samples=256)
    if step == 150:
        hvdnb.metrics.get_recorder().flush()  # a memory sample before it (fast steps)
torch.cuda.synchronize()
hvdnb.metrics.get_recorder().flush()
after_loop = torch.cuda.memory_allocated()
# the same bytes allreduced alone, timed with our own CUDA events on the compute stream
# (independent of hvdnb and of NCCL's timing); a matmul queued first keeps the GPU busy
# so the events do not count the host's launch gap
nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
buf = torch.ones(nbytes // 4, device=dev)
big = torch.randn(4096, 4096, device=dev)
import torch.distributed as dist
ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
alone = []
for _ in range(50):
    torch.mm(big, big)
    ev[0].record(); dist.all_reduce(buf); ev[1].record(); ev[1].synchronize()
    alone.append(ev[0].elapsed_time(ev[1]) / 1e3)
alone.sort()
(before, after_loop, torch.cuda.memory_reserved(), alone[len(alone) // 2],
 nbytes, loss.item())
"""


def test_training_on_gpu_reports_gpu_memory_and_nccl_times(gpu_cluster):
    store = attach(gpu_cluster)
    store.clear()
    vals = run(gpu_cluster, TRAIN)
    assert {i.get("backend") for i in store.rank_info.values()} == {"nccl"}
    names = store.names()
    for rank, (before, alloc, reserved, alone, nbytes, loss) in vals.items():
        assert math.isfinite(loss)
        steps, allocs, _ = store.series("mem/gpu_allocated", rank, run=-1)
        _, reserved_s, _ = store.series("mem/gpu_reserved", rank, run=-1)
        _, nvml, _ = store.series("mem/gpu_nvml_used", rank, run=-1)
        assert allocs and reserved_s and nvml, names
        # the 256 MiB ballast allocated at step 160 shows up in torch's own reading
        early = [a for s, a in zip(steps, allocs) if s <= 155]
        late = [a for s, a in zip(steps, allocs) if s > 165]
        assert early and late, steps
        # (within 1 %: the loop's own temporaries come and go around it)
        assert late[0] - early[-1] == pytest.approx(256 << 20, rel=0.01)
        assert late[-1] == pytest.approx(alloc, rel=0.05)
        # reserved holds allocated; NVML's device-wide "used" holds this process's reserve
        assert reserved_s[-1] >= late[-1] and nvml[-1] >= reserved_s[-1]
        # NCCL collective times come from CUDA events: at least 10 steps timed, finite and
        # positive, as is the same-size allreduce timed alone (how near the two are is a
        # speed, measured in bench/, not asserted on a shared GPU)
        coll = store.per_step("comm/", rank, 300)
        times = [v for v in coll.values() if math.isfinite(v) and v > 0]
        assert len(times) >= 10, coll
        assert math.isfinite(alone) and alone > 0, alone
        assert any(n.endswith("/bytes") for n in names)
        # exposed: how long the compute stream waited for NCCL (CUDA events), finite, >= 0
        exposed = store.per_step("comm/", rank, 300, suffix="/exposed")
        assert exposed and all(math.isfinite(v) and v >= 0 for v in exposed.values())


def test_ddp_comm_hook_reports_nccl_kernel_times(gpu_cluster):
    store = attach(gpu_cluster)
    store.clear()
    run(
        gpu_cluster,
        """
import torch, hvdnb
from torch.nn.parallel import DistributedDataParallel as DDP
dev = torch.device("cuda", torch.cuda.current_device())
model = DDP(torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10)).to(dev), device_ids=[dev.index])
hvdnb.metrics.ddp_comm_hook(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 512, device=dev), torch.randint(0, 10, (64,), device=dev)
for step in range(50):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    hvdnb.log(step, loss)
hvdnb.metrics.get_recorder().flush()
""",
    )
    for rank in range(gpu_cluster.n):
        times = store.per_step("comm/ddp.", rank, 100)
        # finite, positive seconds (how fast is bench/'s: no upper bound here)
        assert len(times) >= 5 and all(math.isfinite(v) and v > 0 for v in times.values()), times
        exposed = [v for _, v, _ in zip(*store.series("comm/ddp.bucket.0/exposed", rank, run=-1))]
        assert exposed and all(math.isnan(v) for v in exposed)  # n/a on CUDA, as documented


def test_nvml_reading_matches_nvidia_smi(gpu_cluster):
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no nvidia-smi to compare with")
    store = attach(gpu_cluster)
    store.clear()
    run(
        gpu_cluster,
        """
import torch, hvdnb
x = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
for s in range(5):
    hvdnb.log(s, 1.0)
hvdnb.metrics.get_recorder().flush()
""",
    )
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    smi = float(out.split()[0]) * 2**20
    _, nvml, _ = store.series("mem/gpu_nvml_used", 0, run=-1)
    assert nvml
    assert nvml[-1] == pytest.approx(smi, rel=0.1, abs=256 * 2**20)


def test_gpu_utilisation_matches_nvidia_smi_under_a_busy_kernel(gpu_cluster):
    """Each rank keeps its GPU busy with matmuls while it logs; rank 0's readings (NVML
    utilization.gpu and memory bandwidth, sampled with each message) arrive as percentages.
    How high they are is a speed (bench/'s): nvidia-smi's reading is printed beside them."""
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no nvidia-smi to compare with")
    store = attach(gpu_cluster)
    store.clear()
    run(
        gpu_cluster,
        """
import time, torch, hvdnb
a = torch.randn(4096, 4096, device="cuda")
t0, s = time.time(), 0
while time.time() - t0 < 4:
    for _ in range(8):
        a = (a @ a).clamp_(-1, 1)
    hvdnb.log(s, 1.0)
    s += 1
torch.cuda.synchronize()
hvdnb.metrics.get_recorder().flush()
""",
    )
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    _, util, _ = store.series("mem/gpu_util_pct", 0, run=-1)
    _, membw, _ = store.series("mem/gpu_membw_util_pct", 0, run=-1)
    assert util and membw, "no utilisation reading (is nvidia-ml-py installed?)"
    # percentages, one per message (how busy the GPU was is a speed: bench/'s, not here)
    assert all(math.isfinite(u) and 0 <= u <= 100 for u in util), util
    assert all(math.isfinite(m) and 0 <= m <= 100 for m in membw), membw
    print(f"utilization.gpu: panel max {max(util):.0f} %, nvidia-smi now {out.strip()} %")


def test_timeline_on_gpu_is_a_chrome_trace(gpu_cluster, tmp_path):
    path = tmp_path / "tl.json"
    run(
        gpu_cluster,
        f"""
import torch
import hvdnb.torch as hvd
hvd.init()
hvd.start_timeline({str(path)!r})
for i in range(5):
    hvd.allreduce(torch.ones(4096, device="cuda"), name="tl.grad")
hvd.stop_timeline()
""",
    )
    trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e.get("name") for e in events} | {e.get("args", {}).get("name") for e in events}
    assert any("tl.grad" in str(n) for n in names), sorted(map(str, names))[:20]
    assert all("ph" in e for e in events)


def test_ranks_sharing_one_gpu_use_gloo_on_cuda_tensors():
    if GPUS > 1:
        pytest.skip("sharing is tested where ranks outnumber the GPUs (one GPU)")
    with gpu_visible():
        with pytest.raises(ClusterError, match="NCCL refuses two ranks on one GPU"):
            hvdnb.Cluster(n=2, oversubscribe=True, backend="nccl")
        with pytest.raises(ClusterError, match="--oversubscribe"):
            hvdnb.Cluster(n=2)
    c = _start(2, oversubscribe=True)
    try:
        vals = run(
            c,
            """
import torch, torch.distributed as dist
import hvdnb.torch as hvd
hvd.init()
x = torch.full((1000,), dist.get_rank() + 1.0, device="cuda")
dist.all_reduce(x)
y = hvd.allreduce(torch.full((1000,), dist.get_rank() + 1.0, device="cuda"), op=hvd.Sum)
model = torch.nn.Linear(64, 4).cuda()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
torch.manual_seed(dist.get_rank())
for _ in range(5):
    loss = model(torch.randn(8, 64, device="cuda")).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
w = hvd.allgather(model.weight.detach().reshape(1, -1))
(dist.get_backend(), torch.cuda.current_device(), x[0].item(), y[0].item(),
 bool((w[0] - w[1]).abs().max() == 0))
""",
        )
    finally:
        c.stop()
    for backend, dev, x0, y0, same in vals.values():
        assert backend == "gloo" and dev == 0
        assert x0 == 3.0 and y0 == 3.0 and same
