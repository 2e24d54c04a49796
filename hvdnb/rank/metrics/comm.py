"""Collective timing: when the recorder's listener sits on the rank's comm listeners
(``hvdnb.rank.hooks.COMM_LISTENERS``, which ``hvdnb.torch``'s collectives call: the
``DistributedOptimizer``'s buckets, named allreduces).

Owns: ``CommTiming`` (a part of ``hvdnb.rank.metrics.recorder.Recorder``: the listener list
while attached, the sampling period ``every`` and the intervals it follows, registering and
removing the recorder's listener). The listener itself (``Recorder.on_comm``) and the rows a
collective makes are the recorder's and the drain's.

While a loop logs, the listener is registered for one step in ``k`` only (``every``,
switched by the recorder's ``_events`` through ``plan``: timed steps ``interval`` seconds
apart, 8 ms by default, for the loop's first ``warm`` seconds, then ``interval_steady``
apart, 50 ms by default; every step when steps are longer; ``k`` a power of two, so that
ranks in lockstep time the same steps): reporting a timed collective costs the training
thread ~7-9 us (cold caches, 2-rank loop of 1.4 ms steps), and its rows are drained, packed
and sent with the step's.

Also owns ``on_torch``: what else hooks into the collective layer (the replica-drift
fingerprints of ``hvdnb.rank.metrics.fingerprint``) hooks in when the recorder attaches:
when the recorder is made, at a cell's start, or when a message is due (a loop that
imported torch after its first ``hvdnb.log``); and out with ``set_enabled(False)``.

Never: import torch or ``hvdnb.torch`` (it attaches only once torch is loaded: nothing else
calls the listeners), wait for a collective or a device, or issue a collective.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

from hvdnb.rank import hooks
from hvdnb.rank.metrics.state import COMM_EVERY_MAX

__all__ = ["CommTiming", "on_torch", "pow2"]

_TORCH_HOOKS: list[tuple[Callable[[], None], Callable[[], None] | None]] = []
_TORCH_ON = False  # a recorder is attached to the collective layer now
_NEVER = 1 << 62  # a step no loop reaches


def on_torch(fn: Callable[[], None], off: Callable[[], None] | None = None) -> None:
    """Call ``fn()`` whenever a recorder attaches to the collective layer (now, if one is
    attached), and ``off()`` when recording is switched off (``set_enabled(False)``): a
    way to hook into ``hvdnb.rank.hooks`` only while a recorder listens. Both must be
    idempotent."""
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


def pow2(x: float) -> int:
    """The power of two nearest to ``x`` on a log scale (at least 1): ranks whose
    estimates differ a little still agree, and when they do not, one's grid holds the
    other's."""
    return 1 << round(math.log2(x)) if x > 1.0 else 1


class CommTiming:
    """Which steps' collectives the recorder times.

    Parameters
    ----------
    listener : the recorder's ``on_comm`` (one bound method: registered and removed by
        identity)
    interval : while a loop logs, time its collectives on one step in ``k``, with ``k`` the
        whole number of steps in ``interval`` seconds (1 to ``COMM_EVERY_MAX``); 0 times
        every step
    interval_steady : the same once the loop has logged for ``warm`` seconds (the larger
        of the two applies)
    """

    __slots__ = ("every", "interval", "interval_steady", "listener", "listeners", "noticed", "on")

    def __init__(
        self, listener: Callable[..., None], interval: float, interval_steady: float
    ) -> None:
        self.listener = listener
        self.interval = float(interval)
        self.interval_steady = float(interval_steady)
        self.every = 1
        #: the listener list while attached (None: not: torch is not loaded, or recording is
        #: off); ``on``: the listener is registered on it now
        self.listeners: list[Any] | None = None
        self.on = False
        self.noticed = False  # attached once torch was loaded (see ``notice``)

    def attach(self) -> None:
        """Time collectives: register the listener, once torch is loaded (before that no
        collective layer calls it: no step-driven switching for a loop without one)."""
        if "torch" in sys.modules:
            self.listeners = hooks.COMM_LISTENERS
            self.switch(True)
            self.noticed = True
            _torch_hooks(True)

    def notice(self) -> None:
        """Attach if ``hvdnb.torch`` was loaded after the recorder was made (a cell that
        imports it after its first ``hvdnb.log``: it registered into ``hvdnb.rank.hooks``);
        cheap once seen."""
        if self.noticed:
            return
        if self.listeners is not None:  # given a listener list already
            self.noticed = True
        elif hooks.layer_loaded():
            self.attach()

    def detach(self) -> None:
        """Stop timing collectives: the collective layer takes its untimed paths again (and
        what hooked in through ``on_torch`` unhooks)."""
        self.switch(False)
        if self.listeners is not None:
            _torch_hooks(False)
        self.listeners = None

    def switch(self, on: bool) -> None:
        """Register (``on``) or remove the listener (attached only)."""
        lst = self.listeners
        if lst is None:
            return
        fn = self.listener
        if on:
            if fn not in lst:
                lst.append(fn)
        else:
            try:
                lst.remove(fn)
            except ValueError:
                pass
        self.on = on

    def plan(self, nxt: int) -> int:
        """Step ``nxt`` starts: register the listener if its collectives are timed
        (``nxt % every == 0``), else remove it; returns the next step at which to look
        again (after a timed step; before the next timed one)."""
        k = self.every
        if self.listeners is None or k <= 1:
            if self.listeners is not None and not self.on:
                self.switch(True)
            return _NEVER  # not timing, or timing every step: nothing to switch
        on = nxt % k == 0
        if on is not self.on:
            self.switch(on)
        return nxt if on else nxt + (k - nxt % k) - 1

    def resample(self, per: float, last: float, t0: float, warm: float) -> None:
        """The step time over the last drain is ``per`` (every rank in lockstep sees the
        same): time one step in ``every``, ``interval`` seconds of steps (``interval_steady``
        once the loop that started at ``t0`` has run ``warm`` seconds at ``last``)."""
        if per > 0.0 and self.interval > 0.0:
            ci = self.interval
            if t0 and last - t0 >= warm:  # past the loop's first seconds: sparser
                ci = max(ci, self.interval_steady)
            self.every = min(COMM_EVERY_MAX, pow2(ci / per))
        else:
            self.every = 1
