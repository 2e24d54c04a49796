"""hvdnb.tensorflow under mpiexec: every op, eager and inside tf.function, at any size.

Each check runs twice, eagerly and as a ``tf.function`` (traced once, so the collectives
run from TensorFlow's executor), and asserts against what every rank can compute alone
from ``size()``. Ends with a mismatch (every rank must raise, then keep working).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))
import _spmd

_spmd.setup()

# no fallback for a missing TensorFlow: test_spmd.py skips this script, saying why, where
# it is not installed; an ImportError here (hvdnb's own included) fails the run
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdnb.tensorflow as hvd  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
ranks = np.arange(N, dtype=np.float64)


def both(name, fn, check):
    """``check(fn())`` eagerly and with ``fn`` as a tf.function."""
    for mode, f in (("eager", fn), ("tf.function", tf.function(fn))):
        try:
            check(f())
        except AssertionError as exc:
            raise AssertionError(f"{name} ({mode}): {exc}") from exc


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


x = tf.fill([3, 4], float(R + 1))
# -- allreduce, every op
both("average", lambda: hvd.allreduce(x), lambda r: close(r, np.full([3, 4], (N + 1) / 2)))
both(
    "sum",
    lambda: hvd.allreduce(x, op=hvd.Sum),
    lambda r: close(r, np.full([3, 4], N * (N + 1) / 2)),
)
both("min", lambda: hvd.allreduce(x, op=hvd.Min), lambda r: close(r, np.ones([3, 4])))
both("max", lambda: hvd.allreduce(x, op=hvd.Max), lambda r: close(r, np.full([3, 4], N)))
both(
    "product",
    lambda: hvd.allreduce(x, op=hvd.Product),
    lambda r: close(r, np.full([3, 4], np.prod(ranks + 1))),
)
both(
    "scaled",
    lambda: hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
    lambda r: close(r, np.full([3, 4], 1.5 * N * (N + 1) / 2)),
)
both(
    "int average truncates",
    lambda: hvd.allreduce(tf.constant([R * 3 + 1], tf.int32)),
    lambda r: close(r, [int(sum(k * 3 + 1 for k in range(N)) / N)]),
)
both(
    "fp16 compression",
    lambda: hvd.allreduce(x, compression=hvd.Compression.fp16),
    lambda r: (close(r, np.full([3, 4], (N + 1) / 2)), r.dtype == tf.float32 or sys.exit(1)),
)
if N & (N - 1) == 0:
    both(
        "adasum of equal vectors",
        lambda: hvd.allreduce(tf.ones([4]), op=hvd.Adasum),
        lambda r: close(r, np.ones(4)),
    )


# -- a named call site, again and again: small tensors travel through the site's own buffer
# (its plan is built once); every result is a tensor of its own, never that buffer
def named_site():
    outs = [hvd.allreduce(tf.fill([256], float(R + k)), op=hvd.Sum, name="site") for k in range(3)]
    return tf.stack(outs)


both(
    "named site, three calls",
    named_site,
    lambda r: close(r, np.stack([np.full([256], N * (N - 1) / 2 + N * k) for k in range(3)])),
)
kept = hvd.allreduce(tf.fill([4], float(R)), op=hvd.Max, name="kept")
hvd.allreduce(tf.fill([4], 100.0 + R), op=hvd.Max, name="kept")
close(kept, np.full([4], N - 1.0))  # the first result is not the buffer the second reused
with tf.GradientTape() as tape_named:  # under a tape the same site is differentiable
    v = tf.constant([1.0, 2.0])
    tape_named.watch(v)
    y = tf.reduce_sum(hvd.allreduce(v * float(R + 1), op=hvd.Sum, name="kept.grad"))
close(tape_named.gradient(y, v), np.full([2], N * (R + 1.0)))

# -- grouped: mixed dtypes, one call
both(
    "grouped",
    lambda: hvd.grouped_allreduce([x, tf.constant([R], tf.int64), 2 * x], op=hvd.Sum),
    lambda rs: (
        close(rs[0], np.full([3, 4], N * (N + 1) / 2)),
        close(rs[1], [N * (N - 1) // 2]),
        close(rs[2], np.full([3, 4], N * (N + 1))),
    ),
)
# -- IndexedSlices: gathered, averaged
sl = tf.IndexedSlices(tf.fill([1, 2], float(R)), tf.constant([R]), tf.constant([N, 2]))
rs = hvd.allreduce(sl)
close(tf.convert_to_tensor(rs), np.repeat(ranks[:, None], 2, 1) / N)
# -- allgather: rank r sends r + 1 rows
both(
    "allgather",
    lambda: hvd.allgather(tf.fill([R + 1, 2], R)),
    lambda r: close(r, np.concatenate([np.full([k + 1, 2], k) for k in range(N)])),
)
both(
    "grouped_allgather",
    lambda: hvd.grouped_allgather([tf.constant([R]), tf.constant([[1.0 * R]])]),
    lambda rs: (close(rs[0], np.arange(N)), close(rs[1], ranks[:, None])),
)
# -- broadcast, from the last rank
both("broadcast", lambda: hvd.broadcast(x, N - 1), lambda r: close(r, np.full([3, 4], N)))
v = tf.Variable([float(R), 1.0])
hvd.broadcast_([v], 0)
close(v, [0.0, 1.0])
# -- alltoall: rank r sends k + 1 rows of value r to rank k
a2a_in = tf.concat([tf.fill([k + 1], R) for k in range(N)], 0)
both(
    "alltoall splits",
    lambda: hvd.alltoall(a2a_in, splits=[k + 1 for k in range(N)]),
    lambda r: (close(r[0], np.repeat(np.arange(N), R + 1)), close(r[1], [R + 1] * N)),
)
both(
    "alltoall equal",
    lambda: hvd.alltoall(tf.fill([2 * N], R)),
    lambda r: close(r, np.repeat(np.arange(N), 2)),
)
# the last rank sends nothing: an empty uint16 (moved as raw bytes; numpy gives a zero-size
# array stride 0, which once made that rank fail alone while the others waited in MPI)
silent = R == N - 1
a2a_u16 = tf.zeros([0], tf.uint16) if silent else tf.cast(tf.fill([N], R), tf.uint16)
both(
    "alltoall, one rank sends nothing",
    lambda: hvd.alltoall(a2a_u16, splits=[0 if silent else 1] * N),
    lambda r: (close(r[0], np.arange(N - 1)), close(r[1], [1] * (N - 1) + [0])),
)
# -- reducescatter: uneven rows (the first dim0 % N ranks one more)
rows = 2 * N + 1
mine = 3 if R == 0 else 2
both(
    "reducescatter",
    lambda: hvd.reducescatter(tf.fill([rows, 2], float(R + 1))),
    lambda r: close(r, np.full([mine, 2], (N + 1) / 2)),
)
both(
    "grouped_reducescatter",
    lambda: hvd.grouped_reducescatter([tf.fill([rows, 2], float(R + 1))], op=hvd.Sum),
    lambda rs: close(rs[0], np.full([mine, 2], N * (N + 1) / 2)),
)
# -- gradients
w = tf.Variable(tf.fill([2], float(R + 1)))
with tf.GradientTape(persistent=True) as t:
    s1 = tf.reduce_sum(hvd.allreduce(w * float(R + 1), op=hvd.Sum))
    s2 = tf.reduce_sum(hvd.allgather(w))
    s3 = tf.reduce_sum(hvd.broadcast(w, 0))
close(t.gradient(s1, w), np.full([2], N * (R + 1.0)))  # Sum's gradient: the summed ones, times r+1
close(t.gradient(s2, w), np.ones(2))
close(t.gradient(s3, w), np.ones(2) if R == 0 else np.zeros(2))


# -- DistributedGradientTape, eager and in tf.function
def tape_step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * float(R + 1))
    tape = hvd.DistributedGradientTape(tape)
    return tape.gradient(loss, [w])[0]


both("DistributedGradientTape", tape_step, lambda g: close(g, np.full([2], (N + 1) / 2)))
# a local source keeps its own gradient, divided by the size; Horovod's split of the two
own = tf.Variable(tf.ones([2]))
with tf.GradientTape() as t:
    loss = tf.reduce_sum(w * float(R + 1)) + tf.reduce_sum(own * float(R + 1))
t = hvd.DistributedGradientTape(t)
t.register_local_source(own)
(local_pairs, averaged_pairs) = t.get_local_and_global_gradients(loss, [w, own])
assert [v is own for v, _ in local_pairs] == [True] and [v is w for v, _ in averaged_pairs] == [
    True
]
close(local_pairs[0][1], np.full([2], (R + 1.0) / N))
close(averaged_pairs[0][1], np.full([2], (N + 1) / 2))
# -- variables and objects
m = tf.Variable(tf.fill([3], float(R)))
hvd.broadcast_variables([m, w], root_rank=N - 1)
close(m, np.full([3], N - 1.0))
close(w, np.full([2], float(N)))
assert hvd.broadcast_object({"from": R}, root_rank=N - 1) == {"from": N - 1}
assert hvd.allgather_object(R * 10) == [k * 10 for k in range(N)]
assert int(hvd.size_op()) == N and int(hvd.rank_op()) == R
hvd.barrier()

# -- the same error on every rank, then the group still works (one rank has nobody to
# disagree with: there the same calls are ordinary ones and must succeed)
try:
    hvd.allreduce(tf.ones([17 + R]))
    mismatch = None
except tf.errors.FailedPreconditionError as exc:
    mismatch = str(exc)
assert (mismatch is None) if N == 1 else (mismatch is not None and "shape" in mismatch), mismatch


@tf.function
def bad():
    return hvd.allreduce(tf.ones([5, R + 1]))


try:
    bad()
    raised = None
except tf.errors.OpError as exc:  # from the graph: TensorFlow wraps it, the message stays
    raised = str(exc)
assert (raised is None) if N == 1 else (raised is not None and "disagree" in raised), raised
close(hvd.allreduce(tf.ones([2]), op=hvd.Sum), np.full([2], N))
# a named site whose ranks disagree (one site buffer per shape): the same error everywhere,
# then the site works again
try:
    hvd.allreduce(tf.ones([3 + R]), name="site.mismatch")
    site_err = None
except tf.errors.FailedPreconditionError as exc:
    site_err = str(exc)
assert (site_err is None) if N == 1 else (site_err is not None and "shape" in site_err), site_err
close(hvd.allreduce(tf.ones([3]), op=hvd.Sum, name="site.mismatch"), np.full([3], N))
assert int(hvd.join()) in range(N)
print(f"OK spmd_tf_ops (rank {R} of {N})")
