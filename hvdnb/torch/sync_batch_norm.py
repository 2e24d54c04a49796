"""SyncBatchNorm: batch normalisation with statistics over every rank's batch.

Owns: the forward that sums per-channel count, sum and sum of squares with one
differentiable allreduce (its backward sums the statistics' gradients over ranks), and
the running-statistics update. Never: synchronise in eval mode, or on one rank only (the
allreduce is collective: every rank runs forward the same number of times).
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from hvdnb.torch.ops import allreduce
from hvdnb.torch.process_sets import ProcessSet, global_process_set
from hvdnb.torch.spec import Sum

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm1d/2d/3d`` that normalises over the global batch.

    Parameters
    ----------
    num_features, eps, momentum, affine, track_running_stats : as ``torch.nn.BatchNorm2d``
    process_set : ranks whose batches form the global batch (default: all)
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: ProcessSet = global_process_set,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input, got {input.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training:
            return super().forward(x)
        # in training even one rank takes the synchronised path (as Horovod does): the
        # statistics come from the same formulas, and a batch of one value per channel
        # (which torch's BatchNorm refuses in training) gives variance 0
        c = x.shape[1]
        dims = [0, *range(2, x.dim())]
        xf = x.float()
        count = torch.full((1,), x.numel() // c, dtype=torch.float32, device=x.device)
        stats = torch.cat([xf.sum(dims), (xf * xf).sum(dims), count])
        stats = allreduce(stats, op=Sum, process_set=self.process_set)
        total = stats[-1]
        mean = stats[:c] / total
        var = (stats[c : 2 * c] / total - mean * mean).clamp_min(0)
        rm = self.running_mean
        if self.track_running_stats and rm is not None:
            with torch.no_grad():
                nbt, rv = self.num_batches_tracked, self.running_var
                assert nbt is not None and rv is not None  # tracked: all three buffers exist
                nbt.add_(1)  # in place, as ``+= 1`` on the buffer
                m = 1.0 / float(nbt) if self.momentum is None else self.momentum
                unbiased = var * total / (total - 1).clamp_min(1)
                rm.mul_(1 - m).add_(mean.to(rm.dtype), alpha=m)
                rv.mul_(1 - m).add_(unbiased.to(rv.dtype), alpha=m)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)

    @classmethod
    def convert_sync_batchnorm(
        cls, module: torch.nn.Module, process_set: ProcessSet = global_process_set
    ) -> torch.nn.Module:
        """Return ``module`` with every BatchNorm layer replaced by a SyncBatchNorm."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            out = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                process_set,
            )
            if module.affine:
                with torch.no_grad():
                    out.weight.copy_(module.weight)
                    out.bias.copy_(module.bias)
            if module.track_running_stats:
                out.running_mean = module.running_mean
                out.running_var = module.running_var
                out.num_batches_tracked = module.num_batches_tracked
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return out
