"""The DDP communication hook: per-bucket allreduce timings for plain
``torch.nn.parallel.DistributedDataParallel`` users (``hvdnb.torch``'s
DistributedOptimizer reports through the recorder's listener by itself).

Owns: ``ddp_comm_hook``. Never: wait for the device (no ``cuda.synchronize``: an NCCL
timing is read on the flusher thread), issue a collective beyond the bucket's own
allreduce, or import torch before ``ddp_comm_hook`` is called.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from hvdnb.protocol.errors import InputTypeError
from hvdnb.rank.hooks import NcclSeconds
from hvdnb.rank.metrics import fingerprint
from hvdnb.rank.metrics.recorder import get_recorder

__all__ = ["ddp_comm_hook", "timed_hook"]


def ddp_comm_hook(model: Any, state: Any = None) -> Any:
    """Register a DDP communication hook that records each bucket's allreduce timings.

    For plain ``torch.nn.parallel.DistributedDataParallel`` users (hvdnb.torch's
    DistributedOptimizer reports by itself). The hook is torch's ``allreduce_hook``; per
    bucket and step it records, never waiting for the device (no ``cuda.synchronize``):

    - ``comm/ddp.bucket.<i>/time``, the collective's own duration: from when it could
      start (its launch, or the previous bucket's completion when the backend was still
      busy with that one: Gloo runs a group's collectives in order) to its completion;
      on CUDA (NCCL) the host cannot see the stream, so this is "n/a" (NaN). A rank
      that starts a bucket before its peers also counts waiting for them (the store
      takes the smallest reading over the ranks as the collective's time), and the
      completion is seen when Gloo's thread gets the GIL, so a bucket that completes
      while the training thread still runs Python reads late: measured on 2 CPU ranks,
      6 buckets of 257 KB read 0.4-0.9 ms where the same allreduce alone took 0.45-0.65
      ms, except the first of each step, 1.7-2.4 ms. On CUDA (NCCL) it is NCCL's own
      kernel time (``Work._get_duration()``: CUDA events ProcessGroupNCCL records on its
      stream; ``TORCH_NCCL_ENABLE_TIMING=1``, which hvdnb's rendezvous sets), read on the
      flusher thread; "n/a" (NaN) for a group made without timing;
    - ``comm/ddp.bucket.<i>/exposed``, communication the step waited for: DDP waits for
      every bucket once the last one is launched (backward compute is over), so a bucket
      completing after that instant exposes the time since the later of that instant
      and the previous completion; buckets done earlier were hidden behind backward (0).
      On CUDA "n/a" (NaN): DDP makes the stream wait inside its C++ reducer, where no
      event can be placed (hvdnb.torch's DistributedOptimizer measures it on the GPU);
    - ``comm/ddp.bucket.<i>/bytes``.

    It also feeds the replica-drift watcher: at each backward's last bucket (the
    parameters hold the previous step's update on every rank), on sampled backward passes,
    a fingerprint of the model's parameters (``hvdnb.rank.metrics.fingerprint``).

    Parameters
    ----------
    model : a DistributedDataParallel module
    state : the process group (default: the default group)

    Returns
    -------
    the model, with the hook registered
    """
    if getattr(model, "_hvdnb_timed", False):  # hvdnb timed this model already (on a rank,
        return model  # every DDP model is: hvdnb.rank.frameworks.ddp_hooks)
    # the class's method: on a rank the model's own is hvdnb's wrapper, which would time twice
    if not callable(getattr(model, "register_comm_hook", None)):
        raise InputTypeError(
            "hvdnb.ddp_comm_hook takes the model wrapped in torch's DistributedDataParallel "
            f"(ddp = DDP(model); hvdnb.ddp_comm_hook(ddp)), not {type(model).__name__}"
        )
    type(model).register_comm_hook(model, state, timed_hook(model, state))
    model._hvdnb_timed = True
    return model


def timed_hook(model: Any, state: Any = None, inner: Any = None) -> Any:
    """The hook ``ddp_comm_hook`` registers: ``inner`` (default: torch's ``allreduce_hook``)
    with each bucket timed as ``ddp_comm_hook`` says. A user's own ``inner`` is timed from
    the hook's call to its future's completion, on CUDA too (NCCL's kernel time needs the
    Work, which a user's hook keeps to itself)."""
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: PLC0415  torch is heavy: loaded when first used

    rec = get_recorder()
    backend = str(
        dist.get_backend(state) if isinstance(state, dist.ProcessGroup) else dist.get_backend()
    )
    # this step's clock: when the last bucket was launched (0: not yet), the previous
    # bucket's completion; the hook runs on the training thread, completions on Gloo's
    clock = {"last_launch": 0.0, "prev_done": 0.0}
    lock = threading.Lock()
    named = tuple(
        (n, p) for n, p in getattr(model, "module", model).named_parameters() if p.requires_grad
    )
    passes = [0]  # backward passes seen: the drift fingerprints' step count
    call = inner if inner is not None else allreduce_hook

    # no annotations: DDP rejects a hook whose annotations are not exactly GradBucket and
    # torch.futures.Future (this module's are strings under `from __future__ import`)
    def hook(st, bucket):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        step = rec.cur_step
        idx = bucket.index()
        is_last = bucket.is_last()
        if is_last:
            passes[0] += 1
            fingerprint.on_step(passes[0], named)
        buf = bucket.buffer()
        nbytes = float(buf.numel() * buf.element_size())
        if buf.is_cuda and inner is None:  # allreduce_hook's own steps, keeping the Work
            group: Any = st if st is not None else dist.group.WORLD
            buf.div_(group.size())
            work = dist.all_reduce(buf, group=group, async_op=True)
            t = time.time()
            rec.record_comm(
                step, t, f"ddp.bucket.{idx}", NcclSeconds(work), math.nan, nbytes, backend
            )
            return work.get_future().then(lambda f: f.value()[0])
        if is_last:
            with lock:
                clock["last_launch"] = t0
        fut = call(st, bucket)

        def done(f: Any) -> Any:
            t1 = time.perf_counter()
            with lock:
                prev = clock["prev_done"]
                start = max(t0, prev)
                last = clock["last_launch"]
                exposed = max(0.0, t1 - max(last, prev)) if last else 0.0
                clock["prev_done"] = t1
                if is_last:  # every bucket of this step is done: the next step starts afresh
                    clock["last_launch"] = clock["prev_done"] = 0.0
            t = time.time()
            rec.record_comm(step, t, f"ddp.bucket.{idx}", t1 - start, exposed, nbytes, backend)
            return f.value()

        return fut.then(done)

    return hook
