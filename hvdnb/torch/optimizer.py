"""DistributedOptimizer: gradient averaging fused into buckets and overlapped with backward.

Owns: wrapping a user's optimizer (a dynamic subclass sharing its state, as Horovod does),
hooks on every parameter's gradient accumulator, the bucket plan (reverse parameter order,
one dtype and device per bucket, at most ``Config.fusion_threshold`` bytes), launching each
bucket's allreduce as soon as its gradients are ready (in bucket order, identical on every
rank), and waiting for them in ``synchronize()`` / ``step()``; ``op=hvd.Adasum`` goes to
``adasum_optimizer.py`` (Horovod's delta optimizer). Never: launch buckets in an
order that depends on timing, block inside a hook, or call ``cuda.synchronize``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast

import torch

from hvdnb.config import get_config
from hvdnb.rank import nvtx as _nvtx
from hvdnb.torch.adasum_optimizer import adasum_optimizer
from hvdnb.torch.collectives import sparse_allreduce_async
from hvdnb.torch.compression import Compression
from hvdnb.torch.listeners import after_step
from hvdnb.torch.plans import planned_launch
from hvdnb.torch.process_sets import ProcessSet, global_process_set
from hvdnb.torch.reduce import allreduce_launch
from hvdnb.torch.spec import Adasum, Average, Sum, parameter_names

__all__ = ["DistributedOptimizer"]

#: CPU buckets over MPI hold at most this many bytes unless ``HVDNB_FUSION_THRESHOLD`` is set.
#: MPICH reduces a cache-sized buffer several times faster per byte than one that is not
#: (2 ranks here: 44 MB in 11 Allreduces of 4 MB took 17 ms, in one 41 ms), and a bucket
#: finished early in backward is progressed by the next buckets' header rounds. Measured
#: with bench_models.py's resnet18 layout at 2 ranks (one run, 12 interleaved blocks): the
#: step took 0.85x the one-bucket step at 2-8 MB, 0.86x at 0.5-1 MB; the transformer
#: stack 0.99x at 4 MB, 1.05x at 2 MB.
_CPU_MPI_BUCKET = 4 * 1024 * 1024


class _Bucket:
    __slots__ = (
        "ctx",
        "div",
        "flat",
        "handle",
        "key",
        "label",
        "name",
        "nvtx",
        "params",
        "ready",
        "sizes",
        "views",
    )

    def __init__(self, params: list[torch.Tensor], name: str, names: list[str]) -> None:
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.name = name
        desc = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in zip(names, params))
        self.key = zlib.crc32(desc.encode())
        self.ready = 0
        self.handle: Any = None
        self.flat: torch.Tensor | None = None
        self.ctx: Any = None
        #: the set's size when this launch left the Average undivided (divided on the copy out)
        self.div = 0
        self.nvtx: Any = None  # the bucket's NVTX range (CUDA only)
        self.label = "allreduce " + name.replace("DistributedOptimizer.", "")
        #: ``flat`` split into each parameter's shape (made once with ``flat``)
        self.views: list[torch.Tensor] = []


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixin placed before the user's optimizer class; see ``DistributedOptimizer``."""

    def _hvd_setup(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        compression: Any,
        backward_passes_per_step: int,
        op: int,
        gradient_predivide_factor: float,
        groups: Any,
        sparse_as_dense: bool,
        process_set: ProcessSet,
    ) -> None:
        if op not in (Average, Sum):
            raise ValueError("DistributedOptimizer supports op=hvd.Average, hvd.Sum or hvd.Adasum")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor needs op=hvd.Average")
        params, pname = parameter_names(self.param_groups, named_parameters)
        #: Horovod's attribute: parameter -> the name its gradient is reduced under
        self._parameter_names = dict(zip(params, pname))
        self._hvd_ps = process_set
        self._hvd_member = process_set.included()
        self._hvd_dense = bool(sparse_as_dense)
        self._hvd_sparse: dict[torch.Tensor, Any] = {}
        self._hvd_comp = compression
        self._hvd_bpps = int(backward_passes_per_step)
        self._hvd_op = op
        f = float(gradient_predivide_factor)
        self._hvd_scale = (1.0 / f, f)
        # an Average with no scaling and no compression over MPI: the bucket's sum is divided
        # as it is copied into .grad (one pass over the gradients instead of two)
        n = process_set.size() if self._hvd_member else 0
        plain = op == Average and f == 1.0 and compression is Compression.none
        self._hvd_div = n if plain and n > 1 and process_set.mpi is not None else 0
        self._hvd_buckets = self._hvd_plan(params, pname, groups, process_set)
        bucket_of = {p: b for b in self._hvd_buckets for p in b.params}
        #: per parameter (by its index in ``params``): its bucket, and the backward passes
        #: counted since the last allreduce (a list: the hook runs on every backward)
        self._hvd_bucket_at = [bucket_of[p] for p in params]
        self._hvd_counts = [0] * len(params)
        self._hvd_next = 0
        self._hvd_synced = False
        self._hvd_skip_sync = False
        for i, p in enumerate(params):
            # a notebook cell run twice wraps the same model again: only the newest wrapper
            # may hook a parameter, or every backward would launch the old buckets too
            old = getattr(p, "_hvdnb_hook", None)
            if old is not None:
                old.remove()
            # the hook knows its parameter's index: no tensor hashing in every backward
            p._hvdnb_hook = p.register_post_accumulate_grad_hook(
                functools.partial(self._hvd_hook, i)
            )

    @staticmethod
    def _hvd_plan(
        params: list[torch.Tensor], pname: list[str], groups: Any, ps: ProcessSet
    ) -> list[_Bucket]:
        limit = max(1, int(get_config().fusion_threshold))
        # the cap for CPU buckets over MPI (a CUDA or gloo bucket keeps the threshold)
        cpu_mpi = limit
        if ps.mpi is not None and "HVDNB_FUSION_THRESHOLD" not in os.environ:
            cpu_mpi = min(limit, _CPU_MPI_BUCKET)
        order = list(range(len(params)))[::-1]  # gradients arrive roughly in reverse order
        plans: list[list[int]] = []
        if isinstance(groups, int) and groups > 0:
            per = -(-len(order) // groups)
            plans = [order[i : i + per] for i in range(0, len(order), per)]
        elif groups:
            pos = {p: i for i, p in enumerate(params)}
            explicit = [[pos[p] for p in g] for g in groups]
            taken = {i for g in explicit for i in g}
            plans = explicit + [[i] for i in order if i not in taken]
        else:
            cur: list[int] = []
            nbytes = 0
            for i in order:
                p = params[i]
                sz = p.numel() * p.element_size()
                cap = limit if p.is_cuda else cpu_mpi
                if cur and (
                    nbytes + sz > cap
                    or p.dtype != params[cur[0]].dtype
                    or p.device != params[cur[0]].device
                ):
                    plans.append(cur)
                    cur, nbytes = [], 0
                cur.append(i)
                nbytes += sz
            if cur:
                plans.append(cur)
        out = []
        for k, idx in enumerate(plans):
            if len({(params[i].dtype, params[i].device) for i in idx}) > 1:
                raise ValueError(f"fusion group {k} mixes dtypes or devices; split it")
            out.append(
                _Bucket(
                    [params[i] for i in idx],
                    f"DistributedOptimizer.bucket.{k}",
                    [pname[i] for i in idx],
                )
            )
        return out

    # -- hooks and buckets -------------------------------------------------------------------
    def _hvd_hook(self, i: int, p: torch.Tensor) -> None:
        if not self._hvd_member:  # Horovod: a rank outside the process set trains alone
            return
        counts = self._hvd_counts
        c = counts[i] + 1
        counts[i] = c
        if c != self._hvd_bpps:
            return
        self._hvd_bucket_at[i].ready += 1
        bs = self._hvd_buckets
        # launch strictly in bucket order: every rank issues the same sequence
        while self._hvd_next < len(bs):
            b = bs[self._hvd_next]
            if b.ready != len(b.params):
                break
            self._hvd_launch(b)
            self._hvd_next += 1

    def _hvd_launch(self, b: _Bucket) -> None:
        p0 = b.params[0]
        if b.flat is None:
            b.flat = torch.empty(sum(b.sizes), dtype=p0.dtype, device=p0.device)
            b.views = [v.view_as(p) for v, p in zip(torch.split(b.flat, b.sizes), b.params)]
        grads = []
        for p in b.params:
            g = p.grad
            if g is None:
                g = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            elif g.is_sparse:
                if not self._hvd_dense:
                    # Horovod: sparse gradients travel as gathered indices and values
                    self._hvd_sparse[p] = sparse_allreduce_async(
                        g, self._parameter_names[p], self._hvd_op, self._hvd_ps
                    )
                    g = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                else:
                    g = g.to_dense()
            grads.append(g.reshape(-1))
        torch.cat(grads, out=b.flat)
        wire, b.ctx = self._hvd_comp.compress(b.flat)
        pre, post = self._hvd_scale
        b.nvtx = _nvtx.start(b.label)
        h = planned_launch(wire, b.name, self._hvd_op, pre, post, self._hvd_ps, b.key)
        if h is None:
            # CPU buckets over MPI: the Average left undivided, divided on the copy out
            b.div = self._hvd_div if not wire.is_cuda and wire.is_floating_point() else 0
            h = allreduce_launch(
                wire,
                True,
                b.name,
                self._hvd_op,
                pre,
                post,
                self._hvd_ps,
                shape_key=b.key,
                divide=not b.div,
            )
        b.handle = h

    def synchronize(self) -> None:
        """Finish every bucket's allreduce and write the averaged gradients into ``.grad``.

        Collective (each bucket is one allreduce). Buckets whose gradients never arrived
        (unused parameters) are launched now with zeros, in bucket order on every rank.
        """
        if not self._hvd_member:
            self._hvd_synced = True
            return
        with torch.no_grad():
            for b in self._hvd_buckets[self._hvd_next :]:
                self._hvd_launch(b)
            self._hvd_next = len(self._hvd_buckets)
            for b in self._hvd_buckets:
                res = self._hvd_comp.decompress(b.handle.wait(), b.ctx)
                b.handle = None
                _nvtx.end(b.nvtx)
                b.nvtx = None
                dst, src = [], []
                # the reduced buffer in each parameter's shape (views made once when the
                # result is the bucket's own buffer, as it is without compression)
                parts = b.views if res is b.flat else res.split(b.sizes)
                div, b.div = b.div, 0
                for p, part in zip(b.params, parts):
                    sparse = self._hvd_sparse.pop(p, None) if self._hvd_sparse else None
                    g = p.grad
                    if sparse is not None:
                        p.grad = sparse()
                    elif g is None:
                        p.grad = part.view_as(p).div(div) if div else part.view_as(p).clone()
                    elif g.is_sparse:  # sparse_as_dense: back in the optimizer's layout
                        p.grad = (part.div(div) if div else part).view_as(p).to_sparse()
                    elif div:  # the division and the copy in one pass (CPU)
                        torch.div(part if part.shape == p.shape else part.view_as(p), div, out=g)
                    else:
                        dst.append(g)
                        src.append(part if part.shape == p.shape else part.view_as(p))
                if dst:  # one multi-tensor kernel on CUDA instead of one copy per parameter
                    torch._foreach_copy_(dst, src)
                b.ready = 0
        counts = self._hvd_counts
        counts[:] = [0] * len(counts)
        self._hvd_next = 0
        self._hvd_synced = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Let ``step()`` skip ``synchronize()`` (after calling it yourself, e.g. to clip)."""
        self._hvd_skip_sync = True
        try:
            yield
        finally:
            self._hvd_skip_sync = False

    def step(self, closure: Any = None) -> Any:
        if not self._hvd_skip_sync:
            if self._hvd_synced:
                # gradients are averaged already: averaging them again would be wasted work
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context "
                    "after optimizer.synchronize(). This can cause training slowdown. You may "
                    "want to consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            else:
                self.synchronize()
        self._hvd_synced = False
        return after_step(self, super().step(closure))  # step listeners (listeners.py)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if any(b.handle is not None for b in self._hvd_buckets):
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(); gradients are being averaged. "
                "Call step() (or synchronize()) first."
            )
        super().zero_grad(set_to_none=set_to_none)


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | Sequence[Sequence[torch.Tensor]] | None = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so ``step()`` uses gradients averaged over all ranks.

    Each parameter's gradient accumulator gets a hook; when every gradient of a bucket
    (``Config.fusion_threshold`` bytes, ``HVDNB_FUSION_THRESHOLD``) is ready, the bucket is
    flattened and its allreduce starts while backward goes on. ``step()`` waits for all of
    them, then runs the wrapped optimizer. SPMD contract: every rank wraps the same
    parameters in the same order and calls backward/step the same number of times.

    Parameters
    ----------
    optimizer : any torch optimizer; the result is an instance of a subclass of its class
        sharing its state
    named_parameters : ``model.named_parameters()``, used in names and error messages
    compression : ``Compression.none`` or ``Compression.fp16``
    backward_passes_per_step : local accumulation passes before each allreduce
    op : ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum``. Adasum is Horovod's
        delta optimizer (``adasum_optimizer.py``): each rank steps on its own gradients and
        the parameter updates are combined with Adasum; a power-of-two number of ranks,
        the global process set, no groups or predivide factor
    gradient_predivide_factor : with Average, divide by this before the sum and by
        ``size / factor`` after (guards low-precision sums)
    num_groups : deprecated (Horovod's): the same as ``groups=num_groups``
    groups : an int (split parameters into that many fused groups) or explicit lists of
        parameters to fuse together; default: by ``fusion_threshold``
    sparse_as_dense : reduce sparse gradients (``nn.Embedding(sparse=True)``) as dense
        tensors inside the buckets; by default they travel as gathered indices and values.
        Either way ``.grad`` stays sparse for the optimizer
    process_set : ranks that average gradients (default: all)

    Returns
    -------
    torch.optim.Optimizer
    """
    if num_groups:
        if groups is not None:
            raise ValueError("pass groups= or num_groups= (deprecated), not both")
        warnings.warn("num_groups is deprecated; use groups=", DeprecationWarning, stacklevel=2)
        groups = int(num_groups)
    if op == Adasum:
        if gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor needs op=hvd.Average")
        if global_process_set.size() > 1:
            return adasum_optimizer(
                optimizer, named_parameters, compression, backward_passes_per_step, process_set
            )
        op = Sum  # Horovod: one rank gets the plain wrapper (Adasum of one vector is itself)
    base = optimizer.__class__
    cls = cast(
        "type[_DistributedOptimizer]", type(base.__name__, (_DistributedOptimizer, base), {})
    )
    dist_opt = cls.__new__(cls)
    dist_opt.__dict__.update(optimizer.__dict__)
    dist_opt._hvd_setup(
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
    )
    return dist_opt
