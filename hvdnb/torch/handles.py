"""The async handle table: what ``*_async`` returns, ``poll`` and ``synchronize``.

Owns: the table from handle number to pending work (a queued op, or a group of handles),
``submit`` (queue an op for the next round and return its number), ``register``,
``poll``, ``synchronize`` and ``clear`` (``shutdown`` forgets every handle). Never: send
anything in ``poll``, or run an op outside a round (``synchronize`` takes part in rounds
through ``rounds.py`` until its op has run).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from hvdnb.torch.rounds import Op, defer, rounds

__all__ = ["Group", "clear", "poll", "register", "submit", "synchronize"]


class _Async:
    """What ``*_async`` returns a number for: a queued op, then its started Handle."""

    __slots__ = ("op", "post", "tr")

    def __init__(self, op: Op, tr: Any, post: Callable[[Any], Any] | None = None) -> None:
        self.op, self.tr, self.post = op, tr, post

    def done(self) -> bool:
        op = self.op
        if op.error is not None:
            return True
        return op.handle is not None and op.handle.test()

    def wait(self) -> Any:
        op = self.op
        if not op.settled:
            t0 = time.perf_counter()
            rounds(self.tr, None, op)
            if op.handle is not None and op.handle.meta is not None:
                op.handle.exp += time.perf_counter() - t0
        if op.error is not None:
            raise op.error
        assert op.handle is not None
        r = op.handle.wait()
        return r if self.post is None else self.post(r)


_HANDLES: dict[int, Any] = {}
_IDS = itertools.count(1)


def register(h: Any) -> int:
    """A new handle number for ``h`` (anything with ``done()`` and ``wait()``)."""
    hid = next(_IDS)
    _HANDLES[hid] = h
    return hid


def submit(tr: Any, op: Op, post: Callable[[Any], Any] | None = None) -> int:
    """Queue ``op`` on ``tr`` for its next round; its handle's result goes through ``post``."""
    return register(_Async(defer(tr, op), tr, post))


def poll(handle: int) -> bool:
    """Whether the async op behind ``handle`` has completed; never blocks.

    An async op is negotiated in the next round on its process set (any collective or
    ``synchronize`` there), so ``poll`` is False until then, and afterwards until its data
    has arrived. Loop on ``synchronize``, not on ``poll``, to make progress.
    """
    h = _HANDLES.get(handle)
    if h is None:
        raise ValueError(f"unknown or already synchronized handle {handle}")
    return bool(h.done())


def synchronize(handle: int) -> Any:
    """Wait for the async op behind ``handle`` and return its result (once per handle).

    Collective when the op has not been negotiated yet: the other ranks must reach a
    collective or ``synchronize`` on the same process set. Raises what the op raised
    (e.g. ``CollectiveMismatchError`` on every rank).
    """
    h = _HANDLES.pop(handle, None)
    if h is None:
        raise ValueError(f"unknown or already synchronized handle {handle}")
    return h.wait()


def clear() -> None:
    """Forget every handle (``shutdown``: their transports are gone)."""
    _HANDLES.clear()


class Group:
    """A handle over several async ops: ``synchronize`` returns the list of results."""

    __slots__ = ("ids", "post")

    def __init__(self, ids: list[int], post: Callable[[list[Any]], Any] | None = None) -> None:
        self.ids, self.post = ids, post

    def done(self) -> bool:
        return all(_HANDLES[i].done() for i in self.ids if i in _HANDLES)

    def wait(self) -> Any:
        out = [synchronize(i) for i in self.ids]
        return out if self.post is None else self.post(out)
