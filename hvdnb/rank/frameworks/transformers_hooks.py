"""The Hugging Face ``Trainer`` on the ranks: distributed, and on the panel.

The Trainer builds Accelerate's ``PartialState`` from ``TrainingArguments``: with
``ACCELERATE_USE_CPU=1`` (set on CPU ranks by ``accelerate_hooks``) it reads the cluster's
group as ``ParallelMode.DISTRIBUTED``, ``args.world_size`` the ranks, the model wrapped in
DDP and each rank reading its share of the data. Nothing else is needed for that.

For the panel, ``HvdnbCallback`` (a ``TrainerCallback``) goes into the Trainer's default
callbacks (the module list ``transformers.trainer.DEFAULT_CALLBACKS``, which every Trainer
starts from; the user's own ``callbacks=`` come after it), so no line is added:

- every rank calls ``hvdnb.log(step)`` at each step's end (step time, memory, the
  collectives' timings of that step);
- the loss the Trainer logs (``on_log``, every ``logging_steps``: the mean over ranks, as
  the Trainer computes it) is recorded on rank 0 as ``loss_main``;
- the panel's ``lr`` and ``warmup_steps`` knobs drive the learning rate once changed
  (``hvdnb.rank.frameworks.lrknobs``), applied at one step on every rank.

Never: import transformers before the user does, or log on a rank the Trainer does not.
"""

from __future__ import annotations

from typing import Any

from hvdnb.protocol.kinds import MAIN_LOSS
from hvdnb.rank.frameworks.common import Place, on_import, warn_version

__all__ = ["install"]


def install(p: Place) -> None:
    """Add hvdnb's callback to the Trainer's defaults when ``transformers.trainer`` loads."""
    on_import("transformers.trainer", _hook)


def _hook(trainer_mod: Any) -> None:
    warn_version("transformers")
    cls = _callback_class()
    if not any(getattr(c, "__name__", "") == cls.__name__ for c in trainer_mod.DEFAULT_CALLBACKS):
        trainer_mod.DEFAULT_CALLBACKS.append(cls)


def _callback_class() -> Any:
    from transformers import TrainerCallback  # noqa: PLC0415  transformers is imported already (post-import hook)

    from hvdnb.rank.frameworks.lrknobs import LrKnobs  # noqa: PLC0415  knobs: with the framework only
    from hvdnb.rank.metrics.recorder import get_recorder, log  # noqa: PLC0415  the recorder, with the framework only

    class HvdnbCallback(TrainerCallback):
        """hvdnb's panel for the HF Trainer: step time and memory on every rank, the
        logged loss (mean over ranks) on rank 0, learning-rate knobs."""

        def __init__(self) -> None:
            self.lr: LrKnobs | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.lr = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            opt = kw.get("optimizer")
            if opt is None:
                return
            if self.lr is None:
                warm = int(args.get_warmup_steps(state.max_steps)) if state.max_steps else 0
                self.lr = LrKnobs(opt, warmup_steps=warm)
            self.lr.at_step(int(state.global_step), opt)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            # the step that just finished: the Trainer has counted it already (global_step
            # is 1 after the first), and knobs.step(s) at its start was told s
            # the samples this rank took in the step (its per-device batch, times the
            # accumulated micro-batches), so that the panel's samples/s is known
            samples = int(args.per_device_train_batch_size) * max(
                1, int(args.gradient_accumulation_steps or 1)
            )
            log(
                int(state.global_step) - 1,
                total_steps=int(state.max_steps or 0),
                samples=samples,
            )

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs and state.is_world_process_zero:
                get_recorder().record(int(state.global_step) - 1, MAIN_LOSS, float(logs["loss"]))

    return HvdnbCallback
