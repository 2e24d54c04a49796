"""Collective timing: the recorder's listener on ``hvdnb.torch``'s collectives (the
``DistributedOptimizer``'s buckets, named allreduces) and the rows a collective makes.

Owns: ``CommTiming`` (a part of ``hvdnb.rank.metrics.recorder.Recorder``: ``on_comm``,
registering and removing it on ``hvdnb.torch.listeners.LISTENERS``, ``record_comm`` for
timings taken elsewhere, e.g. ``hvdnb.rank.metrics.ddp``).

While a loop logs, the listener is registered for one step in ``k`` only (``comm_every``,
switched by the recorder's ``_events``: timed steps ``comm_interval`` seconds apart, 8 ms
by default, for the loop's first ``warm`` seconds, then ``comm_interval_steady`` apart,
50 ms by default; every step when steps are longer; ``k`` a power of two, so that ranks in
lockstep time the same steps): reporting a timed collective costs the training thread
~7-9 us (cold caches, 2-rank loop of 1.4 ms steps), and its rows are drained, packed and
sent with the step's.

Also owns ``on_torch``: what else hooks into ``hvdnb.torch`` (the replica-drift
fingerprints of ``hvdnb.rank.metrics.fingerprint``) hooks in when the recorder attaches to
it: when the recorder is made, at a cell's start, or when a message is due (a loop that
imported ``hvdnb.torch`` after its first ``hvdnb.log``); and out with ``set_enabled(False)``.

Never: import torch (the listener list is looked up only when ``hvdnb.torch`` or torch is
already loaded), wait for a collective or a device, or issue a collective.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from hvdnb.rank.metrics.ring import Ring
from hvdnb.rank.metrics.state import COMM

__all__ = ["CommTiming", "on_torch"]

_TORCH_HOOKS: list[tuple[Callable[[], None], Callable[[], None] | None]] = []
_TORCH_ON = False  # a recorder is attached to hvdnb.torch now


def on_torch(fn: Callable[[], None], off: Callable[[], None] | None = None) -> None:
    """Call ``fn()`` whenever a recorder attaches to a loaded ``hvdnb.torch`` (now, if one
    is attached), and ``off()`` when recording is switched off (``set_enabled(False)``): a
    way to hook into ``hvdnb.torch`` without importing torch. Both must be idempotent."""
    if (fn, off) not in _TORCH_HOOKS:
        _TORCH_HOOKS.append((fn, off))
    if _TORCH_ON:
        fn()


def _torch_hooks(on: bool) -> None:
    global _TORCH_ON
    _TORCH_ON = on
    for fn, off in _TORCH_HOOKS:
        f = fn if on else off
        if f is None:
            continue
        try:
            f()
        except Exception as exc:  # a watcher must never break training
            print(f"hvdnb: {f!r} failed: {exc!r}", file=sys.stderr)


class CommTiming(Ring):
    """Collective timing: a part of ``Recorder`` (no fields of its own)."""

    __slots__ = ()

    def attach_comm_listener(self) -> None:
        """Time collectives: register ``on_comm`` on ``hvdnb.torch``'s listener list, only
        when ``hvdnb.torch`` (or torch) is already imported: never import torch for the
        panel's sake."""
        if "hvdnb.torch" in sys.modules or "torch" in sys.modules:
            try:
                from hvdnb.torch import listeners

                self._comm_list = listeners.LISTENERS
                self._time_comm(True)
            except Exception:
                return
            self._torch_noticed = True
            _torch_hooks(True)

    def notice_torch(self) -> None:
        """Attach to ``hvdnb.torch`` if it was loaded after this recorder was made (a cell
        that imports it after its first ``hvdnb.log``); cheap when it has been seen."""
        if self._torch_noticed or not self.enabled:
            return
        if self._comm_list is not None:  # given a listener list already
            self._torch_noticed = True
        elif "hvdnb.torch" in sys.modules:
            self.attach_comm_listener()

    def detach_comm_listener(self) -> None:
        """Stop timing collectives: ``hvdnb.torch`` takes its untimed paths again (and
        what hooked in through ``on_torch`` unhooks)."""
        self._time_comm(False)
        if self._comm_list is not None:
            _torch_hooks(False)
        self._comm_list = None

    def _time_comm(self, on: bool) -> None:
        """Register (``on``) or remove this recorder's allreduce listener."""
        lst = self._comm_list
        if lst is None:
            return
        fn = self._on_comm
        if on:
            if fn not in lst:
                lst.append(fn)
        else:
            try:
                lst.remove(fn)
            except ValueError:
                pass
        self._comm_on = on
        self._next_event = -1

    def on_comm(
        self, name: str, nbytes: int, seconds: Any, backend: str, exposed: float = math.nan
    ) -> None:
        """``hvdnb.torch`` comm listener: one collective (or fused bucket) just completed.

        Records ``comm/<name>/time`` (the collective's own duration; a CUDA-event span is
        kept as an object and read on the flusher thread), ``comm/<name>/exposed`` (what
        the training thread waited for it) and ``comm/<name>/bytes``.
        """
        if not self.enabled:
            return
        t = time.time()
        if threading.get_ident() == self._owner:
            q = self._pend
            q.append((COMM, t, self.cur_step, name, nbytes, seconds, backend, exposed))
            if len(q) > self.capacity:  # no log() drains it (allreduces alone, no channel)
                self._try_drain()
            return
        self.comm_backend = backend
        step = self.cur_step
        short = name.replace("DistributedOptimizer.", "")
        for n_, v_ in (
            (f"comm/{short}/time", seconds),
            (f"comm/{short}/exposed", exposed),
            (f"comm/{short}/bytes", nbytes),
        ):
            self._side.append((step, t, n_, v_))

    def record_comm(
        self,
        step: int,
        t: float,
        short: str,
        seconds: Any,
        exposed: Any,
        nbytes: float,
        backend: str,
    ) -> None:
        """Record one collective timed elsewhere (any thread; the DDP hook): its rows
        ``comm/<short>/time``, ``/exposed`` and ``/bytes`` go through the side queue, read at
        the next pack (``seconds`` may be an object read then, e.g. NCCL's own timing)."""
        side = self._side
        side.append((step, t, f"comm/{short}/time", seconds))
        side.append((step, t, f"comm/{short}/exposed", exposed))
        side.append((step, t, f"comm/{short}/bytes", nbytes))
        self.comm_backend = backend
