"""The panel's learning-rate knobs for a framework's own loop (the HF Trainer, Lightning).

At the first step the loop's optimizer is read: ``lr`` starts at its first parameter
group's learning rate, ``warmup_steps`` at the framework's own warmup (0 when it has
none), both announced to the panel as ``hvdnb.knobs`` (same values on every rank). While
neither has been changed, the framework's scheduler drives the learning rate untouched.
From the step a change is applied on (the same step on every rank, as for every knob),
hvdnb sets each parameter group's learning rate at the start of every step to
``lr * min(1, (step + 1) / warmup_steps)``, scaled by the group's share of the first
group's starting rate; the framework's scheduler no longer decides it.

Batch size is not a knob here: these frameworks build their data loaders once per fit.

Never: touch the optimizer before a change was applied.
"""

from __future__ import annotations

from typing import Any

from hvdnb.rank.metrics.knobs import knobs

__all__ = ["LrKnobs"]


class LrKnobs:
    """``lr`` and ``warmup_steps`` knobs driving one optimizer."""

    def __init__(self, optimizer: Any, warmup_steps: int = 0) -> None:
        groups = list(getattr(optimizer, "param_groups", []))
        self.start = [float(g.get("initial_lr", g["lr"])) for g in groups]
        base = self.start[0] if self.start else 1.0
        self.shares = [s / base if base else 1.0 for s in self.start]
        self.initial = {"lr": base, "warmup_steps": int(warmup_steps)}
        self.knobs = knobs(lr=base, warmup_steps=int(warmup_steps))

    @property
    def changed(self) -> bool:
        """Has a change from the panel been applied on this rank?"""
        return any(self.knobs.values[k] != v for k, v in self.initial.items())

    def at_step(self, step: int, optimizer: Any) -> None:
        """Apply a planned change due at ``step``, then drive the learning rate if one was."""
        self.knobs.step(step)
        if not self.changed:
            return
        lr = float(self.knobs.lr) * min(1.0, (step + 1) / max(1, int(self.knobs.warmup_steps)))
        for g, share in zip(getattr(optimizer, "param_groups", []), self.shares):
            g["lr"] = lr * share
