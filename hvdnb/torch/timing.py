"""Timing of collectives for the comm listeners: NCCL's own kernel time, the compute
stream's wait on the GPU, and the gloo completion clock.

Owns: ``NcclSeconds`` (a collective's GPU time, read later from its Work), ``CudaGap`` and
``cuda_wait`` (how long the compute stream waited for NCCL), ``GlooClock`` (own seconds of
gloo works in enqueue order). Never: wait for the device on the training thread (values
are read later, off the step), issue a collective, or import another hvdnb module.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

__all__ = ["CudaGap", "GlooClock", "NcclSeconds", "cuda_wait"]


class NcclSeconds:
    """A collective's own GPU time as ProcessGroupNCCL measures it: CUDA events it records
    on its own stream around the kernel (``Work._get_duration`` in torch 2.11 and 2.13,
    ``get_duration`` where a torch names it so; needs ``TORCH_NCCL_ENABLE_TIMING=1``, which
    hvdnb's rendezvous sets for NCCL groups). Read later (the recorder's flusher thread,
    the timeline's flush), never in the step; read once, then kept; NaN ("n/a") when the
    group was made without timing. Seen on an H100: 7.8 us for a 4 MB one-rank allreduce."""

    __slots__ = ("value", "work")

    def __init__(self, work: Any) -> None:
        self.work = work
        self.value: float | None = None

    def ready(self) -> bool:
        """Has the GPU finished it (never waits)?"""
        w = self.work
        return w is None or self.value is not None or bool(w.is_completed())

    def item(self) -> float:
        if self.value is not None:
            return self.value
        w = self.work
        if w is None:
            return math.nan
        deadline = time.monotonic() + 60.0
        try:
            while not w.is_completed():  # polls the end event; never blocks the device
                if time.monotonic() > deadline:
                    return math.nan
                time.sleep(0.0002)
            get = getattr(w, "_get_duration", None) or w.get_duration  # torch >= 2.11: private
            v = float(get()) / 1000.0
        except Exception:  # timing off for this group, or the work failed
            v = math.nan
        self.value, self.work = v, None
        return v


class CudaGap:
    """How long the compute stream waited for a collective: CUDA events on the current
    stream just before and just after it was made to wait for the collective's end."""

    __slots__ = ("after", "before")

    def __init__(self, before: Any, after: Any) -> None:
        self.before, self.after = before, after

    def ready(self) -> bool:
        return bool(self.after.query())

    def item(self) -> float:
        self.after.synchronize()
        return float(self.before.elapsed_time(self.after)) / 1000.0


def cuda_wait(work: Any) -> CudaGap:
    """``work.wait()`` (the current stream waits for NCCL; the host does not) between two
    timing events: the exposed communication on the GPU."""
    # torch.cuda.Event's __new__ has no annotations in torch's sources
    before = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    after = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    before.record()
    work.wait()
    after.record()
    return CudaGap(before, after)


class GlooClock:
    """Completion times of one process group's gloo works, in enqueue order.

    A work's own time runs from max(its enqueue, completion of the work enqueued before it
    on the same group) to its completion: queueing behind earlier buckets is not counted.
    """

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: list[float] | None = None  # [done time] of the previous work, shared cell

    def attach(self, work: Any) -> list[float]:
        """Stamp ``work``; returns [enqueue, own seconds or nan until done, done cell]."""
        prev = self.last
        cell = [float("nan")]
        rec: list[Any] = [time.perf_counter(), float("nan"), cell, prev]
        self.last = cell

        def done(_fut: Any) -> None:
            t = time.perf_counter()
            cell[0] = t
            p = rec[3]
            start = rec[0] if p is None or p[0] != p[0] else max(rec[0], p[0])
            rec[1] = t - start
            rec[3] = None  # do not keep the chain alive
            return None

        work.get_future().then(done)
        return rec
