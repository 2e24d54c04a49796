"""Replica-drift fingerprints: cheap sums of the parameters, taken on the same sampled steps
on every rank, sent with the metrics; the notebook compares the ranks
(``hvdnb.notebook.metrics.watchers``).

Where the parameters are known: ``hvd.DistributedOptimizer`` calls ``on_step`` after each
``step()`` (registered with ``hvdnb.rank.hooks.add_step_listener``, the rank side's hook that
hvdnb.torch calls), with its step count and named parameters; ``hvdnb.ddp_comm_hook``
calls it at each backward's last bucket with its model's parameters (before the
optimizer's update: the same point on every rank).

A fingerprint is, per parameter, the sum of its elements (float64 on a GPU; on CPU the sum
torch accumulates in the parameter's precision, promoted: a float64-accumulating sum of a
float32 CPU tensor is ~30x slower) and its scale, the L2 norm times the square root of its
size (a bound on the sum of absolute values, what rounding differences are relative to).
No collective: each rank only computes and queues; a message carries them.

Sampling: optimizer step ``n`` (its own count, the same on every rank however fast each
rank runs) is fingerprinted when ``n % k == 0``, ``k`` a power of two: about
``HVDNB_DRIFT_INTERVAL`` seconds of steps (1 s; 0 turns fingerprints off), and enough steps
that fingerprints cost at most ``BUDGET`` (0.1 %) of the training time, from this rank's own
step time and fingerprint cost; the first ``k`` is 16. Ranks whose ``k`` differ (their
timings round to different powers of two) still share every step of the larger ``k``'s
grid, and the notebook compares the steps both sent.

A cell's last fingerprint: when a ``%%distributed`` cell ends without an error, the engine
calls ``at_cell_end``, which fingerprints each model that stepped in the cell once more, at
its last step count (the same on every rank in an SPMD loop), marked ``end``: a short loop
whose grid holds no step after the drift is still judged, since the recorder sends the cell's
last message before the cell's reply. It is after the last optimizer update (a DDP model's
sampled fingerprints are taken before it), so the notebook compares it only with other
ranks' ``end`` fingerprints of that count. One fingerprint per model and cell (~90-150 us for
notebook 03's or the benchmark's model on CPU).

Owns: ``install`` (the step listener), ``on_step``, ``at_cell_end``, the sampling and the
fingerprint.
Never: issue a collective, wait for a device in the step (a GPU fingerprint is read at the
pack, by the flusher thread), or raise into training (a model whose fingerprint fails is
skipped, once said).
"""

from __future__ import annotations

import math
import sys
import time
import weakref
import zlib
from collections.abc import Sequence
from typing import Any

from hvdnb.config import get_config
from hvdnb.rank import hooks
from hvdnb.rank.metrics.comm import on_torch
from hvdnb.rank.metrics.recorder import cell_no, current

__all__ = ["BUDGET", "FIRST_EVERY", "at_cell_end", "install", "on_step"]

#: fingerprints take at most this share of the training time (the sampling grid widens)
BUDGET = 0.001
#: the sampling period (steps) before this rank has timed its steps
FIRST_EVERY = 16
#: the longest sampling period (steps)
EVERY_MAX = 1 << 20
_NEVER = 1 << 62


def _pow2(x: float) -> int:
    """The power of two nearest to ``x`` on a log scale (at least 1)."""
    return 1 << round(math.log2(x)) if x > 1.0 else 1


class _Model:
    """One model's sampling state on this rank."""

    __slots__ = (
        "count",
        "every",
        "key",
        "n_last",
        "named",
        "names",
        "p0",
        "roots",
        "sent_cell",
        "t_last",
    )

    roots: Any  # sqrt of each parameter's size: a list, or a tensor on the parameters' device

    def __init__(self, named: Sequence[tuple[str, Any]], key: str) -> None:
        self.names = [str(n) for n, _ in named]
        self.key = key
        self.p0 = weakref.ref(named[0][1])  # which model (a new one after a re-run cell)
        self.roots = [math.sqrt(max(1, p.numel())) for _, p in named]
        self.every = FIRST_EVERY
        self.n_last = -1
        self.t_last = 0.0
        self.sent_cell: int | None = -1
        self.count = 0  # the last step count seen
        #: the parameters while the cell that steps them runs (None after its end: a model
        #: of an earlier cell is not kept alive here)
        self.named: Sequence[tuple[str, Any]] | None = None


_MODELS: dict[int, _Model] = {}  # id of the (name, parameter) tuple -> its state
_KEYS: dict[str, int] = {}  # structure hash -> models seen with it (two alike models)


def _model(named: Sequence[tuple[str, Any]]) -> _Model:
    desc = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in named)
    crc = f"{zlib.crc32(desc.encode()):08x}"
    i = _KEYS[crc] = _KEYS.get(crc, -1) + 1
    m = _Model(named, crc if i == 0 else f"{crc}.{i}")
    for k in [k for k, v in _MODELS.items() if v.p0() is None]:  # models gone
        del _MODELS[k]
    _MODELS[id(named)] = m
    return m


def on_step(count: int, named: Sequence[tuple[str, Any]]) -> None:
    """A step of an optimizer (or DDP model) over ``named`` parameters just ended, its
    ``count``-th: fingerprint it when ``count`` is on this model's sampling grid."""
    m = _MODELS.get(id(named))
    if m is None:
        if not named:
            return
        m = _model(named)
    m.count = count
    m.named = named  # for the cell's last fingerprint (at_cell_end)
    if count % m.every:
        return
    if m.p0() is not named[0][1]:  # another model now holds this id: start afresh
        m = _model(named)
        m.count, m.named = count, named
        if count % m.every:
            return
    _sample(m, count, named)


def _sample(m: _Model, count: int, named: Sequence[tuple[str, Any]]) -> None:
    t = _take(m, count, named, end=False)
    if t is None:
        return
    t0, t1 = t
    if m.n_last >= 0 and count > m.n_last:
        interval = get_config().drift_interval
        per = max(1e-7, (t0 - m.t_last) / (count - m.n_last))  # seconds per step
        want = max(interval / per, (t1 - t0) / (BUDGET * per))
        m.every = min(EVERY_MAX, _pow2(want))
    m.n_last, m.t_last = count, t1


def _take(
    m: _Model, count: int, named: Sequence[tuple[str, Any]], end: bool
) -> tuple[float, float] | None:
    """Fingerprint ``named`` at step count ``count`` and queue it for the next message;
    (start, end) of the fingerprint on the clock, or None when none was taken (no recorder,
    recording off, fingerprints off or failing)."""
    rec = current()
    if rec is None or not rec.enabled or m.every == _NEVER:
        return None
    if get_config().drift_interval <= 0:
        return None
    t0 = time.perf_counter()
    try:
        sums, scale, on_device = _fingerprint(m, [p for _, p in named])
    except Exception as exc:
        m.every = _NEVER
        print(f"hvdnb: no drift fingerprints for model {m.key}: {exc!r}", file=sys.stderr)
        return None
    t1 = time.perf_counter()
    entry: dict[str, Any] = {
        "key": m.key,
        "n": count,
        "step": rec.cur_step,
        "sums": sums,
        "scale": scale,
    }
    if end:
        entry["end"] = True
    cell = cell_no()
    if m.sent_cell != cell:  # names once per model and cell
        entry["names"] = m.names
        m.sent_cell = cell
    rec.add_fingerprint(entry, on_device)
    return t0, t1


def at_cell_end(take: bool = True) -> int:
    """A cell ended (the engine, before the cell's last metrics message): fingerprint each
    model that stepped in it at its last step count, marked ``end`` (``take``: the cell
    ran to its end; after an error a rank may have stopped inside a step, so none is
    taken), then let go of the parameters. Returns how many were taken. Never raises."""
    taken = 0
    for m in list(_MODELS.values()):
        named, m.named = m.named, None
        if named is None or not take:
            continue
        try:
            count = m.count
            if m.p0() is not named[0][1]:  # another model now holds this id
                m = _model(named)
            if _take(m, count, named, end=True) is not None:
                taken += 1
        except Exception as exc:  # a watcher must never break the cell's reply
            print(f"hvdnb: no last drift fingerprint: {exc!r}", file=sys.stderr)
    return taken


def _fingerprint(m: _Model, params: list[Any]) -> tuple[Any, Any, bool]:
    """(sums, scales, on a device) of ``params``: lists on CPU; tensors, read later, on a
    device."""
    import torch  # noqa: PLC0415  torch is heavy: loaded when first used

    with torch.no_grad():
        ps = [p.detach() for p in params]
        dev = ps[0].device
        if dev.type == "cpu":
            sums: Any = torch.stack([p.sum().double() for p in ps])
        else:
            sums = torch.stack([p.sum(dtype=torch.float64) for p in ps])
        norms: Any
        try:
            norms = torch._foreach_norm(ps)  # one kernel for every parameter on a GPU
        except Exception:
            norms = [torch.linalg.vector_norm(p) for p in ps]
        scale: Any = torch.stack([n.double() for n in norms])
        if dev.type == "cpu":
            return sums.tolist(), [s * r for s, r in zip(scale.tolist(), m.roots)], False
        if isinstance(m.roots, list):  # copied to the device once (a copy waits for it)
            m.roots = torch.tensor(m.roots, dtype=torch.float64, device=dev)
        return sums, scale * m.roots, True


def _attach() -> None:
    hooks.add_step_listener(on_step)


def _detach() -> None:
    hooks.remove_step_listener(on_step)


def install() -> None:
    """Fingerprint ``DistributedOptimizer``'s parameters while a recorder is attached to
    ``hvdnb.torch`` (the recorder's ``on_torch``; off with ``set_enabled(False)``, as the
    collective timing; idempotent)."""
    on_torch(_attach, _detach)
