"""Local gradient accumulation for Horovod's Keras ``DistributedOptimizer``
(``backward_passes_per_step > 1``): sum the gradients of N passes on each rank, allreduce
once, apply once.

Owns: ``Aggregator`` (a pass counter and one accumulator variable per gradient, created on
the first pass; ``counter`` is Horovod's name, read by its tests) and ``apply`` (the base
optimizer's update on the pass that allreduced, otherwise only the iteration count moves
on). Never: allreduce on one rank and not another (every rank counts the same passes), or
carry a pass's gradient into the next cycle (accumulators are overwritten with zeros, so an
infinite gradient does not survive as NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

__all__ = ["Aggregator", "apply"]


class Aggregator:
    """Accumulates ``n`` passes, then returns ``reduce(sum)`` (divided by ``n`` when
    ``average``)."""

    def __init__(self, n: int, average: bool, reduce: Callable[..., list[Any]]) -> None:
        self.n, self.average, self.reduce = n, average, reduce
        self.counter = tf.Variable(0, dtype=tf.int32, trainable=False, name="hvd_agg_counter")
        self.acc: dict[Any, tf.Variable] = {}

    def _acc(self, g: Any, v: Any) -> tf.Variable:
        a = self.acc.get(v.ref())
        if a is None:
            with tf.init_scope():  # created once, outside any tf.function being traced
                a = tf.Variable(tf.zeros(g.shape, g.dtype), trainable=False)
            self.acc[v.ref()] = a
        return a

    def compute(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        """Add this pass's gradients; on the n-th pass return the reduced sums."""
        dense = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        idx = [i for i, g in enumerate(dense) if g is not None]
        accs = [self._acc(dense[i], variables[i]) for i in idx]
        for a, i in zip(accs, idx):
            a.assign_add(dense[i])
        count = self.counter.assign_add(1)

        def reduce() -> list[Any]:
            vals = [a.read_value() for a in accs]
            red = self.reduce(vals, [variables[i] for i in idx])
            if self.average:
                red = [r / tf.cast(self.n, r.dtype) for r in red]
            with tf.control_dependencies(red):
                for a in accs:
                    a.assign(tf.zeros_like(a))
                self.counter.assign(0)
            return [tf.identity(r) for r in red]

        def keep() -> list[Any]:
            return [a.read_value() for a in accs]

        if not idx:
            return list(dense)
        if tf.executing_eagerly():
            out = reduce() if int(count) >= self.n else keep()
        else:
            out = tf.cond(count >= self.n, reduce, keep)
        res: list[Any] = list(dense)
        for i, o in zip(idx, out):
            res[i] = o
        return res


def apply(agg: Aggregator, opt: Any, base_apply: Callable[[], Any]) -> Any:
    """Run ``base_apply`` on the pass that allreduced (the counter went back to 0), else
    only count the iteration."""

    def skip() -> Any:
        return opt.iterations.assign_add(1)

    if tf.executing_eagerly():
        return base_apply() if int(agg.counter.numpy()) == 0 else skip()

    def run() -> Any:
        base_apply()
        return tf.constant(True)

    def no() -> Any:
        skip()
        return tf.constant(False)

    return tf.cond(tf.equal(agg.counter, 0), run, no)
