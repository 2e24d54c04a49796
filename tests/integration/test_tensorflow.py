"""TensorFlow on a real 2-rank cluster: every rank starts with a TF_CONFIG that names both
workers (distinct ports, free until TensorFlow binds them) and its own index, and
MultiWorkerMirroredStrategy training through it leaves both ranks with identical weights,
its loss on the panel through ``hvdnb.keras_callback()``. Also the callback in a real
``model.fit`` (one process, no cluster)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

import hvdnb

pytestmark = pytest.mark.timeout(240)

needs_tensorflow = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None,
    reason="tensorflow is not installed: pip install -e '.[tf]' (make test does)",
)


@pytest.mark.mpi
def test_every_rank_has_a_tf_config_naming_all_workers_and_itself(dist2):
    r = hvdnb.run_cell(
        dist2,
        "import os, socket, json\n"
        "cfg = json.loads(os.environ['TF_CONFIG'])\n"
        "host, port = cfg['cluster']['worker'][cfg['task']['index']].rsplit(':', 1)\n"
        "s = socket.socket(); s.bind((host, int(port))); s.close()  # free: nobody holds it\n"
        "cfg, int(os.environ['RANK']), os.environ['TF_NUM_INTRAOP_THREADS']",
        stream=False,
        quiet=True,
    )
    assert r.ok, r.errors
    cfgs = {rank: v[0] for rank, v in r.values.items()}
    assert {rank: v[1] for rank, v in r.values.items()} == {0: 0, 1: 1}
    workers = cfgs[0]["cluster"]["worker"]
    assert cfgs[1]["cluster"]["worker"] == workers and len(workers) == 2
    hosts = {w.rsplit(":", 1)[0] for w in workers}
    ports = {int(w.rsplit(":", 1)[1]) for w in workers}
    assert hosts == {"127.0.0.1"} and len(ports) == 2 and all(0 < p < 65536 for p in ports)
    for rank in (0, 1):
        assert cfgs[rank]["task"] == {"type": "worker", "index": rank}
        assert json.loads(json.dumps(cfgs[rank])) == cfgs[rank]
        assert int(r.values[rank][2]) >= 1  # TF's thread count: this rank's share of cores


_TRAIN = """
import os, numpy as np
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf, keras, hvdnb
tf.get_logger().setLevel("ERROR")
strategy = tf.distribute.MultiWorkerMirroredStrategy()
rng = np.random.default_rng(0)
X = rng.normal(size=(512, 16)).astype("float32")
y = (X @ rng.normal(size=16) > 0).astype("int64")
GLOBAL, STEPS = 32, 40
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
ds = tf.data.Dataset.from_tensor_slices((X, y)).shuffle(512, seed=0).repeat().batch(GLOBAL)
batches = iter(strategy.experimental_distribute_dataset(ds.with_options(options)))
keras.utils.set_random_seed(int(os.environ["RANK"]))  # differently seeded: the strategy syncs
with strategy.scope():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
    opt = keras.optimizers.SGD(0.1)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

def step_fn(x, y):
    with tf.GradientTape() as tape:
        loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)), global_batch_size=GLOBAL)
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

@tf.function
def train_step(it):
    return strategy.reduce("SUM", strategy.run(step_fn, args=next(it)), axis=None)

first = [w.copy() for w in model.get_weights()]
cbs = keras.callbacks.CallbackList([hvdnb.keras_callback()], model=model, epochs=1, steps=STEPS)
cbs.on_train_begin(); cbs.on_epoch_begin(0)
for step in range(STEPS):
    cbs.on_train_batch_end(step, {"loss": train_step(batches)})
cbs.on_train_end()
first, model.get_weights()
"""


@pytest.mark.mpi
@pytest.mark.slow
@needs_tensorflow
def test_multiworker_mirrored_training_leaves_identical_weights_on_every_rank(dist2):
    r = hvdnb.run_cell(dist2, _TRAIN, stream=False, quiet=True, timeout=180)
    assert r.ok, r.errors
    (first0, last0), (first1, last1) = r.values[0], r.values[1]
    assert len(last0) == len(last1) == 4
    for a, b in zip(first0, first1):  # seeded apart, started together (broadcast from worker 0)
        np.testing.assert_array_equal(a, b)
    for a, b in zip(last0, last1):  # bit-identical after training
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(first0, last0))  # and it trained
    # the callback's points: every step of both ranks reached the notebook
    df = hvdnb.metrics().to_pandas()
    loss = df[(df.run == df.run.max()) & (df.name == "loss")]
    assert {rank: sorted(g.step) for rank, g in loss.groupby("rank")} == {
        0: list(range(40)),
        1: list(range(40)),
    }


_FIT = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np, keras, tensorflow as tf, hvdnb
from hvdnb.rank.metrics import recorder
X = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
y = (X.sum(1) > 0).astype("int64")
for strategy in (tf.distribute.get_strategy(), tf.distribute.MirroredStrategy()):
    with strategy.scope():
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        m.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    cb = hvdnb.keras_callback()
    m.fit(X, y, batch_size=32, epochs=3, verbose=0, callbacks=[cb])
    print(type(strategy).__name__, cb.step, recorder.logged_step(), cb.params["steps"])
"""


@pytest.mark.slow
@needs_tensorflow
def test_keras_callback_logs_every_batch_of_a_real_fit():
    """In ``model.fit``, with the default strategy and with MirroredStrategy: one
    ``hvdnb.log`` per batch, steps running on across the epochs (3 epochs of 8 batches)."""
    res = subprocess.run([sys.executable, "-c", _FIT], capture_output=True, text=True, timeout=200)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line.split() for line in res.stdout.splitlines()]
    assert [line[1:] for line in lines] == [["24", "23", "8"], ["24", "23", "8"]], res.stdout
