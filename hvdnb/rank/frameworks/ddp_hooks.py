"""Every DDP model on a rank reports its collective timings to the panel, with no call to
``hvdnb.ddp_comm_hook``, and a user's own comm hook keeps working.

DDP takes one communication hook per model, and the user may want that one. So nothing is
registered when the model is built: at its first backward, before its first bucket is
reduced, a model that has no hook yet gets hvdnb's timed ``allreduce``
(``hvdnb.rank.metrics.ddp.timed_hook``); and the model's ``register_comm_hook`` (an attribute
of the instance) registers the user's hook inside the same timing, so the panel shows its
buckets too. Accelerate, the HF Trainer and Lightning build plain DDP models: they are timed
the same way.

The first backward is seen by a one-shot hook on the parameters' gradients (each removed at
the first that runs): autograd calls it, and Dynamo never traces it. So a compiled model
(``torch.compile(model)``, ``model.compile()``) is timed as an eager one, with Dynamo's
graphs exactly as without hvdnb: no graph break, and DDPOptimizer's split of the graph per
bucket unchanged. (A forward pre-hook would run inside the compiled forward: the recorder's
and the hook's locks there broke the graph, with Dynamo's warning about
``_thread.allocate_lock`` on every rank.)

torch has no seam for "a DDP model was made": this patches ``DistributedDataParallel
.__init__`` (written for torch 2.13; the ``_comm_hooks`` list it reads exists since 2.1).
Never: register a second hook, wrap a hook that hvdnb registered already, or put code in the
model's forward (Dynamo traces it, and its pre- and post-hooks, into the compiled graph).
"""

from __future__ import annotations

from typing import Any

from hvdnb.rank.frameworks.common import Place

__all__ = ["install"]

_DONE = [False]


def install(p: Place) -> None:
    """Patch DDP's constructor once per process."""
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415  torch is heavy: loaded when first used

    if _DONE[0]:
        return
    _DONE[0] = True
    orig_init = DDP.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        try:
            _attach(self)
        except Exception:  # timings are an extra: the model must still be built
            pass

    __init__.__wrapped__ = orig_init  # type: ignore[attr-defined]
    DDP.__init__ = __init__  # type: ignore[method-assign]


def _attach(model: Any) -> None:
    from torch.compiler import is_compiling  # noqa: PLC0415  torch is heavy: loaded when first used

    from hvdnb.rank.metrics.ddp import timed_hook  # noqa: PLC0415  the recorder: on first DDP model only

    cls = type(model)

    def register_comm_hook(state: Any, hook: Any) -> None:
        """DDP's ``register_comm_hook``, with hvdnb's timing around ``hook``."""
        cls.register_comm_hook(model, state, timed_hook(model, state, inner=hook))
        model._hvdnb_timed = True

    model.register_comm_hook = register_comm_hook
    handles: list[Any] = []

    def first_backward(grad: Any) -> None:
        """The first gradient of the first backward (before DDP's reducer sees any): time
        the model's buckets unless it has a hook already; the grad is left as it is."""
        if is_compiling():  # compiled autograd traces tensor hooks: act in eager code only
            return
        for h in handles:  # torch allows a hook to remove itself while it runs
            h.remove()
        handles.clear()
        if getattr(model, "_hvdnb_timed", False) or getattr(model, "_comm_hooks", None):
            return
        try:
            cls.register_comm_hook(model, None, timed_hook(model))
        except Exception:  # a built-in hook (register_builtin_comm_hook) is in place; and
            return  # timings are an extra: the backward must still run
        model._hvdnb_timed = True

    for p in model.parameters():
        if p.requires_grad:
            handles.append(p.register_hook(first_backward))
