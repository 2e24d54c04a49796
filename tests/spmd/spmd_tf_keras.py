"""hvdnb.tensorflow.keras under mpiexec: a Keras 2 ``fit`` with Horovod's callbacks ends
with the same weights on every rank, although every rank starts from its own random ones
and trains on its own data; the epoch's loss is averaged. (The refusal of a Keras 3 optimizer
is checked in tests/integration/test_hvdnb_tensorflow.py, which skips, saying why, where
Keras 3 is not installed.)
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow: tf.keras is tf-keras (Keras 2)
sys.path.insert(0, os.path.dirname(__file__))
import _spmd

_spmd.setup()

# no fallback for a missing TensorFlow or tf-keras: test_spmd.py skips this script, saying
# why, where either is not installed; an ImportError here (hvdnb's own included) fails the run
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402, F401

import hvdnb.tensorflow.keras as hvd  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
tf.keras.utils.set_random_seed(100 + R)  # different initial weights on every rank
model = tf.keras.Sequential(
    [tf.keras.layers.Dense(16, activation="relu", input_shape=(4,)), tf.keras.layers.Dense(1)]
)
opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.01 * N))
assert type(opt).__name__ == "Adam" and isinstance(opt, tf.keras.optimizers.Adam)
model.compile(optimizer=opt, loss="mse")
rng = np.random.RandomState(R)  # different data on every rank
x = rng.rand(96, 4).astype("float32")
y = (x @ np.array([1.0, -2.0, 0.5, 3.0], "float32"))[:, None]
seen_lr = []


class LR(tf.keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        seen_lr.append(float(self.model.optimizer.lr.numpy()))


hist = model.fit(
    x,
    y,
    batch_size=16,
    epochs=4,
    verbose=0,
    callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * N, warmup_epochs=2),
        hvd.callbacks.LearningRateScheduleCallback(
            initial_lr=0.01 * N, multiplier=0.5, start_epoch=2
        ),
        LR(),
    ],
)
flat = np.concatenate([w.ravel() for w in model.get_weights()])
every = hvd.allgather_object(flat)
assert all(np.array_equal(every[0], w) for w in every), "weights differ across ranks after fit"
losses = hvd.allgather_object(hist.history["loss"])
assert all(ls == losses[0] for ls in losses), f"epoch losses not averaged: {losses}"
assert losses[0][-1] < losses[0][0], losses[0]
assert np.isclose(seen_lr[-1], 0.005 * N), seen_lr  # the schedule's multiplier from epoch 2
assert seen_lr[0] <= 0.01 * N + 1e-9, seen_lr  # warming up

# gradient accumulation: two passes per update, the same weights everywhere
acc = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01), backward_passes_per_step=2)
model.compile(optimizer=acc, loss="mse")
model.fit(x, y, batch_size=16, epochs=1, verbose=0)
assert int(acc._agg_helper.counter.numpy()) == (96 // 16) % 2
flat = np.concatenate([w.ravel() for w in model.get_weights()])
every = hvd.allgather_object(flat)
assert all(np.array_equal(every[0], w) for w in every), "weights differ after accumulation"

# a model given no input shape has no weights when training begins (Horovod's
# tensorflow2_keras_mnist.py): the callback broadcasts after the first batch instead;
# with a learning rate of 0 only that broadcast can make the ranks' weights equal
lazy = tf.keras.Sequential([tf.keras.layers.Dense(1)])
lazy.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.0)), loss="mse")
lazy.fit(
    x,
    y,
    batch_size=16,
    epochs=1,
    verbose=0,
    callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
)
every = hvd.allgather_object(np.concatenate([w.ravel() for w in lazy.get_weights()]))
assert all(np.array_equal(every[0], w) for w in every), "an unbuilt model was not broadcast"

# SyncBatchNormalization: each rank normalizes its 4 rows with the whole batch's moments
import hvdnb.tensorflow as htf  # noqa: E402

whole = ((np.arange(N * 8, dtype="float32").reshape(N * 4, 2) % 7) ** 2).astype("float32")
plain = tf.keras.layers.BatchNormalization(fused=False)
expected = plain(whole, training=True).numpy()[4 * R : 4 * R + 4]
sync = htf.SyncBatchNormalization()
np.testing.assert_allclose(sync(whole[4 * R : 4 * R + 4], training=True), expected, atol=1e-4)
np.testing.assert_allclose(sync.moving_mean, plain.moving_mean, atol=1e-5)
np.testing.assert_allclose(sync.moving_variance, plain.moving_variance, atol=1e-4)
try:
    htf.SyncBatchNormalization(fused=True)
    raise AssertionError("fused=True was accepted")
except ValueError as exc:
    assert "fused=False" in str(exc), exc

print(f"OK spmd_tf_keras (rank {R} of {N})")
