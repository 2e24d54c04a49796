"""Timing of collectives for the comm listeners: the compute stream's wait on the GPU and
the gloo completion clock (NCCL's own kernel time, ``NcclSeconds``, is the rank side's:
``hvdnb.rank.hooks``, re-exported here).

Owns: ``CudaGap`` and ``cuda_wait`` (how long the compute stream waited for NCCL),
``GlooClock`` (own seconds of gloo works in enqueue order). Never: wait for the device on
the training thread (values are read later, off the step), issue a collective, or import
an hvdnb module but ``hvdnb.rank.hooks``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hvdnb.rank.hooks import NcclSeconds

__all__ = ["CudaGap", "GlooClock", "NcclSeconds", "cuda_wait"]


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
