"""Learning-rate rules for data-parallel training: linear scaling, warmup, LARS.

Owns: ``scale_lr`` (Goyal et al. 2017: lr x number of ranks), ``warmup_lr`` and
``LinearWarmup`` (a linear ramp over the first N steps, Goyal et al. 2017, section 2.2),
and the ``LARS`` optimizer (You et al. 2017, layer-wise trust ratio). Never: communicate;
every rank computes the same schedule from the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from hvdnb.torch.basics import is_initialized, size
from hvdnb.torch.basics import size as _size

__all__ = ["LARS", "LinearWarmup", "scale_lr", "warmup_lr"]


def scale_lr(base_lr: float, size: int | None = None) -> float:
    """Linear scaling rule: with ``size`` times the global batch, use ``size`` times the lr.

    Parameters
    ----------
    base_lr : learning rate tuned for one rank's batch
    size : number of ranks (default: ``hvd.size()``)

    Examples
    --------
    >>> scale_lr(0.1, size=4)
    0.4
    """
    if size is None:
        size = _size()
    return base_lr * size


def warmup_lr(step: int, base_lr: float, target_lr: float, warmup_steps: int) -> float:
    """Learning rate at ``step`` of a linear ramp from ``base_lr`` to ``target_lr``.

    The ramp reaches ``target_lr`` at ``step == warmup_steps`` and stays there.

    Examples
    --------
    >>> warmup_lr(0, 0.1, 0.4, 3), warmup_lr(3, 0.1, 0.4, 3), warmup_lr(9, 0.1, 0.4, 3)
    (0.1, 0.4, 0.4)
    """
    if warmup_steps <= 0 or step >= warmup_steps:
        return target_lr
    return base_lr + (target_lr - base_lr) * step / warmup_steps


class LinearWarmup(LambdaLR):
    """Scheduler: multiply each group's lr by a factor ramping from ``start_factor`` to 1.

    Set the optimizer's lr to the scaled target (``scale_lr(base_lr)``) and use the default
    ``start_factor = 1 / hvd.size()``: training starts at the single-rank lr and reaches
    the scaled lr after ``warmup_steps`` calls to ``step()``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int,
        start_factor: float | None = None,
        last_epoch: int = -1,
    ) -> None:
        if start_factor is None:
            start_factor = 1.0 / size() if is_initialized() else 1.0
        sf = float(start_factor)

        def factor(step: int) -> float:
            return warmup_lr(step, sf, 1.0, warmup_steps)

        super().__init__(optimizer, factor, last_epoch=last_epoch)


class LARS(torch.optim.Optimizer):
    """Layer-wise Adaptive Rate Scaling (You, Gitman, Ginsburg 2017) with momentum.

    For each parameter tensor w with gradient g::

        local_lr = trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps)
        v = momentum * v + lr * local_lr * (g + weight_decay * w)
        w = w - v

    (local_lr is 1 when ||w|| or ||g|| is 0). Parameters in groups with ``lars=False``
    (e.g. biases and norms) get plain SGD with momentum.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError("LARS needs lr, momentum and weight_decay >= 0")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            lars=True,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            wd, mom = group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                local_lr = 1.0
                if group["lars"]:
                    wn, gn = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
                    if wn > 0 and gn > 0:
                        local_lr = float(
                            group["trust_coefficient"] * wn / (gn + wd * wn + group["eps"])
                        )
                d = g.add(p, alpha=wd) if wd else g.clone()
                d.mul_(group["lr"] * local_lr)
                st = self.state[p]
                if mom:
                    buf = st.get("momentum_buffer")
                    if buf is None:
                        buf = st["momentum_buffer"] = d
                    else:
                        buf.mul_(mom).add_(d)
                    d = buf
                p.sub_(d)
        return loss
