"""DistributedOptimizer(op=hvd.Adasum): Horovod's delta optimizer.

Owns: the wrapper Horovod builds for ``op=Adasum`` on more than one rank (a dynamic subclass
of the user's optimizer sharing its state, as for the other ops): every rank takes the
wrapped optimizer's step on its own gradients, each parameter's *delta* (new - start) is
combined over the ranks with an Adasum allreduce (one per parameter, so the Adasum
coefficients are per layer, as Horovod computes them even inside a fused buffer), and
start + combined delta becomes the parameter. Also ``backward_passes_per_step`` (hooks
count the local backward passes), ``compression`` of the deltas, and Horovod's errors
(more passes than declared, zero_grad before step, skip_synchronize, non-global process
sets, a size that is not a power of two). Never: touch ``.grad`` or the optimizer state
(both stay each rank's own, as in Horovod), combine vectors itself (``reduce.py`` gathers,
``adasum.py`` combines), or communicate inside a hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch

from hvdnb.torch.listeners import after_step
from hvdnb.torch.process_sets import ProcessSet, global_process_set
from hvdnb.torch.reduce import allreduce_launch
from hvdnb.torch.spec import Adasum, parameter_names

__all__ = ["POWER_OF_TWO_ERROR", "adasum_optimizer"]

#: Horovod's message (``horovod/torch/mpi_ops.py``, CPU Adasum), raised on every rank
POWER_OF_TWO_ERROR = "Running Adasum with non-power of 2 ranks is not supported yet."


class _AdasumOptimizer(torch.optim.Optimizer):
    """Mixin placed before the user's optimizer class; see ``adasum_optimizer``."""

    def _hvd_adasum_setup(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        compression: Any,
        backward_passes_per_step: int,
        process_set: ProcessSet,
    ) -> None:
        params, pname = parameter_names(self.param_groups, named_parameters)
        #: Horovod's attribute: parameter -> the name its delta is reduced under
        self._parameter_names = dict(zip(params, pname))
        self._hvd_params = params
        self._hvd_names = [f"DistributedOptimizer.adasum.{n}" for n in pname]
        self._hvd_comp = compression
        self._hvd_bpps = int(backward_passes_per_step)
        self._hvd_ps = process_set
        self._hvd_counts = {p: 0 for p in params}
        self._hvd_due = False  # some parameter saw its last backward pass before the step
        for p in params:
            # a notebook cell run twice wraps the same model again: only the newest wrapper
            # (of either kind) may hook a parameter
            old = getattr(p, "_hvdnb_hook", None)
            if old is not None:
                old.remove()
            p._hvdnb_hook = p.register_post_accumulate_grad_hook(self._hvd_hook)

    def _hvd_hook(self, p: torch.Tensor) -> None:
        c = self._hvd_counts[p] + 1
        if c > self._hvd_bpps:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call "
                "to step(). Increase backward_passes_per_step to accumulate gradients locally."
            )
        self._hvd_counts[p] = c
        if c == self._hvd_bpps:
            self._hvd_due = True

    def synchronize(self) -> None:
        """Nothing to do (as in Horovod): the deltas are combined inside ``step()``."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError(
            "Skipping synchronization is not supported when using Adasum optimizer."
        )
        yield  # pragma: no cover - makes this a generator, as Horovod's is

    def step(self, closure: Any = None) -> Any:
        """Local step, then every parameter becomes start + Adasum of the ranks' deltas.

        Collective: one Adasum allreduce per parameter, in parameter order on every rank.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._hvd_params
        with torch.no_grad():
            starts = [p.detach().clone() for p in params]
        super().step()
        comp, ps = self._hvd_comp, self._hvd_ps
        with torch.no_grad():
            launched = []
            for p, start, name in zip(params, starts, self._hvd_names):
                wire, ctx = comp.compress(p.detach() - start)
                h = allreduce_launch(wire, True, name, Adasum, 1.0, 1.0, ps)
                launched.append((h, ctx))
            for p, start, (h, ctx) in zip(params, starts, launched):
                delta = comp.decompress(h.wait(), ctx)
                p.copy_(start.add_(delta))
        for p in self._hvd_counts:
            self._hvd_counts[p] = 0
        self._hvd_due = False
        return after_step(self, loss)  # step listeners (listeners.py): the drift watcher

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_due:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition."
            )
        super().zero_grad(set_to_none=set_to_none)


def adasum_optimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
    compression: Any,
    backward_passes_per_step: int,
    process_set: ProcessSet,
) -> torch.optim.Optimizer:
    """Horovod's ``DistributedOptimizer(op=hvd.Adasum)`` for more than one rank.

    ``step()`` runs the wrapped optimizer on this rank's (accumulated) gradients, then
    replaces every parameter by start + Adasum(delta of rank 0, ..., delta of rank N-1)
    (``compression`` applies to the deltas). Gradients and optimizer state stay local.
    SPMD contract: every rank wraps the same parameters and calls ``step()`` together.

    Raises NotImplementedError (Horovod's, on every rank) for a process set other than the
    global one or a size that is not a power of two; ValueError when
    ``backward_passes_per_step`` is not positive.
    """
    if process_set is not global_process_set:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    n = process_set.size()
    if n & (n - 1):
        raise NotImplementedError(
            f"{POWER_OF_TWO_ERROR} (hvdnb: {n} ranks; Adasum combines ranks pairwise in a "
            "tree, so the number of ranks must be 1, 2, 4, 8, ...)"
        )
    base = optimizer.__class__
    cls = cast("type[_AdasumOptimizer]", type(base.__name__, (_AdasumOptimizer, base), {}))
    dist_opt = cls.__new__(cls)
    dist_opt.__dict__.update(optimizer.__dict__)
    dist_opt._hvd_adasum_setup(named_parameters, compression, backward_passes_per_step, process_set)
    return dist_opt
