"""``hvdnb.elastic``: an elastic training loop for any torch.distributed code.

``@hvdnb.elastic.run`` wraps ``train(state)``, where ``state`` is an ``hvdnb.State`` (or
any of Horovod's elastic states): when a rank of an elastic cluster (``%dist start -n N
--min-np M``) dies, the survivors restore the last ``state.commit()``, form the next
generation of the default process group without it, run the state's reset callbacks and
call ``train`` again, at the new size. The function rebuilds whatever holds the old group
(a ``DistributedDataParallel`` wrapper, a ``DistributedSampler``, Accelerate's prepared
objects): build them inside ``train``, as Horovod's elastic docs ask.

Horovod's own API is ``hvdnb.torch.elastic`` (``hvd.elastic.run``, ``TorchState``,
``ElasticSampler``); both share one loop (``hvdnb.rank.elastic``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from hvdnb.protocol.errors import InputTypeError
from hvdnb.rank import elastic as _core
from hvdnb.rank.elastic import HorovodInternalError, HostsUpdatedInterrupt, RankRemoved

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "RankRemoved", "run"]

F = TypeVar("F", bound=Callable[..., Any])


def run(func: F) -> F:
    """Run ``func(state, ...)`` and go on at the new size when a rank is lost."""
    __tracebackhide__ = True
    if not callable(func):
        raise InputTypeError(
            f"hvdnb.elastic.run decorates the training function, `@hvdnb.elastic.run` above "
            f"`def train(state): ...`; it was given {type(func).__name__} ({func!r})"
        )
    return _core.run_fn(func, _core.reform, _generation)


def _generation() -> int:
    # `import hvdnb` in the notebook kernel loads no rendezvous code (20 ms)
    from hvdnb.rank import rendezvous  # noqa: PLC0415  the rank's rendezvous, only where a loop runs

    return rendezvous.generation()
