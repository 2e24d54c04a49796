"""LR rules without processes: linear scaling, warmup ramp, LARS update."""

from __future__ import annotations

import math

import pytest
import torch

from hvdnb.torch import LARS, LinearWarmup, scale_lr, warmup_lr


def test_scale_lr_is_linear_in_ranks() -> None:
    assert scale_lr(0.1, size=1) == 0.1
    assert scale_lr(0.1, size=8) == pytest.approx(0.8)


def test_warmup_ramps_linearly_then_holds() -> None:
    lrs = [warmup_lr(s, 0.1, 0.5, 4) for s in range(7)]
    assert lrs[:5] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert lrs[5:] == [0.5, 0.5]
    assert warmup_lr(0, 0.1, 0.5, 0) == 0.5


def test_linear_warmup_scheduler_reaches_scaled_lr() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.4)  # = scale_lr(0.1, size=4)
    sched = LinearWarmup(opt, warmup_steps=3, start_factor=0.25)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4])


def test_lars_step_matches_the_paper() -> None:
    torch.manual_seed(0)
    w0 = torch.randn(5, 3)
    g = torch.randn(5, 3)
    p = torch.nn.Parameter(w0.clone())
    opt = LARS([p], lr=0.5, momentum=0.9, weight_decay=1e-2, trust_coefficient=0.02)
    for step in range(2):
        p.grad = g.clone()
        opt.step()
    # by hand: local_lr = eta * ||w|| / (||g|| + wd ||w||); v = m v + lr * local_lr * (g + wd w)
    w, v = w0.clone(), torch.zeros_like(w0)
    for _ in range(2):
        local = 0.02 * w.norm() / (g.norm() + 1e-2 * w.norm() + 1e-8)
        v = 0.9 * v + 0.5 * local * (g + 1e-2 * w)
        w = w - v
    assert torch.allclose(p.detach(), w, atol=1e-6)


def test_lars_trust_ratio_keeps_update_relative_to_weight_norm() -> None:
    # a huge gradient moves the weight by ~ lr * eta * ||w||, not by the gradient's size
    p = torch.nn.Parameter(torch.ones(100))
    opt = LARS([p], lr=1.0, momentum=0.0, trust_coefficient=0.01)
    p.grad = torch.full((100,), 1e6)
    opt.step()
    moved = (torch.ones(100) - p.detach()).norm().item()
    assert math.isclose(moved, 0.01 * 10.0, rel_tol=1e-4)


def test_lars_plain_sgd_for_excluded_groups() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = LARS([{"params": [p], "lars": False}], lr=0.1, momentum=0.0)
    p.grad = torch.ones(3)
    opt.step()
    assert torch.allclose(p.detach(), torch.full((3,), 0.9))
