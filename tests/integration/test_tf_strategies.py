"""TensorFlow's strategies on real ranks under mpiexec.

``model.fit`` under ``MultiWorkerMirroredStrategy`` through tf-keras (``TF_USE_LEGACY_KERAS=1``
set in the cell, before TensorFlow): two ranks seeded apart end with identical weights, and
``hvdnb.keras_callback()`` brings every batch's loss to the notebook. Keras 3's ``fit`` under
the same strategy fails (keras-team/keras#20585): the cell's error carries the line naming
the fix.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import time

import numpy as np
import pytest
from IPython.core.error import UsageError

import hvdnb
from hvdnb.extras import KERAS3_FIT_HINT
from hvdnb.notebook.cellout.cells import DistributedCellError
from hvdnb.notebook.cluster import health
from hvdnb.notebook.metrics.store import get_store
from hvdnb.notebook.panel.tables import tables_html

pytestmark = [pytest.mark.timeout(300), pytest.mark.mpi, pytest.mark.slow]

needs_tf_keras = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("tf_keras") is None,
    reason="tensorflow or tf-keras is not installed: pip install -e '.[tf]' (make test does)",
)

_FIT = """
import os
os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow: tf.keras is tf-keras (Keras 2)
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np, tensorflow as tf, hvdnb
assert tf.keras.__name__.startswith("tf_keras"), tf.keras.__name__
strategy = tf.distribute.MultiWorkerMirroredStrategy()
rng = np.random.default_rng(0)
X = rng.normal(size=(512, 16)).astype("float32")
y = (X @ rng.normal(size=16) > 0).astype("int64")
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
ds = tf.data.Dataset.from_tensor_slices((X, y)).batch(32).with_options(options)  # global batch
tf.keras.utils.set_random_seed(int(os.environ["RANK"]))  # seeded apart: the strategy syncs
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu", input_shape=(16,)),
                                 tf.keras.layers.Dense(2)])
    model.compile(tf.keras.optimizers.SGD(0.1),
                  tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
first = [w.copy() for w in model.get_weights()]
hist = model.fit(ds, epochs=2, verbose=0, callbacks=[hvdnb.keras_callback()])
first, model.get_weights(), hist.history["loss"]
"""


@needs_tf_keras
def test_fit_under_multiworker_mirrored_with_tf_keras_trains_identical_weights(dist2):
    r = hvdnb.run_cell(dist2, _FIT, stream=False, quiet=True, timeout=240)
    assert r.ok, r.errors
    (first0, last0, loss0), (first1, last1, loss1) = r.values[0], r.values[1]
    assert len(last0) == len(last1) == 4
    for a, b in zip(first0, first1):  # seeded apart, started together (synced by the strategy)
        np.testing.assert_array_equal(a, b)
    for a, b in zip(last0, last1):  # identical after fit
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(first0, last0))  # and it trained
    assert loss0 == loss1 and loss0[-1] < loss0[0]
    df = hvdnb.metrics().to_pandas()  # 512 samples / 32 = 16 batches x 2 epochs, both ranks
    loss = df[(df.run == df.run.max()) & (df.name == "loss")]
    assert {rank: sorted(g.step) for rank, g in loss.groupby("rank")} == {
        0: list(range(32)),
        1: list(range(32)),
    }


_FIT_KERAS3 = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np, tensorflow as tf, keras
assert keras.__version__.startswith("3."), keras.__version__
strategy = tf.distribute.MultiWorkerMirroredStrategy()
X = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
model.fit(X, X.sum(1), batch_size=16, epochs=1, verbose=0)
"""


@needs_tf_keras
def test_keras3_fit_under_multiworker_mirrored_names_the_fix(shell, dist2):
    shell.run_line_magic("dist", "restart")  # fresh ranks: the test above made tf.keras Keras 2
    cluster = hvdnb.current()
    assert cluster is not None and cluster.running
    with pytest.raises(DistributedCellError) as e:  # if Keras 3 fixes #20585, drop the hint
        hvdnb.run_cell(cluster, _FIT_KERAS3, stream=False, quiet=True, timeout=240)
    assert e.value.failed_ranks == [0, 1]
    text = str(e.value)  # each rank's batch differs: one group, and one hint, per rank
    assert text.count("with an unsupported type") == text.count(KERAS3_FIT_HINT) == 2, text[-3000:]


# ------------------------------------------------------------------ ParameterServerStrategy
@pytest.fixture(scope="module")
def ps_cluster(shell):
    """``%dist start -n 3 --tf-ps 1``: rank 0 a parameter server, ranks 1-2 workers, and
    this process (the notebook kernel's stand-in) the coordinator."""
    running = hvdnb.current()
    if running is not None and running.running:
        running.stop()
    shell.run_line_magic("dist", "start -n 3 --tf-ps 1 --oversubscribe --timeout 240")
    cluster = hvdnb.current()
    assert cluster is not None and cluster.running
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def coordinated(ps_cluster):
    """The strategy, built once: TensorFlow keeps one cluster per process."""
    return _coordinate(ps_cluster)


def _coordinate(cluster):
    """A linear model on ParameterServerStrategy, coordinated from this process: the
    strategy, the coordinator and a scheduled step that says which worker ran it."""
    import tensorflow as tf

    strategy = tf.distribute.ParameterServerStrategy(hvdnb.tf_cluster_resolver(cluster))
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        w, b = tf.Variable(tf.zeros([4, 1])), tf.Variable(0.0)
    true_w = tf.constant([[1.0], [-2.0], [0.5], [3.0]])

    def dataset_fn():
        x = tf.random.stateless_normal([1024, 4], seed=[1, 2])
        return tf.data.Dataset.from_tensor_slices((x, x @ true_w)).repeat().batch(32)

    batches = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def step(it):
        x, y = next(it)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((x @ w + b - y) ** 2)
        gw, gb = tape.gradient(loss, [w, b])
        w.assign_sub(0.05 * gw)  # asynchronous SGD: each worker updates the ps as it goes
        b.assign_sub(0.05 * gb)
        # which process ran this step: the pid in its /proc/self/stat (read on the worker)
        return loss, tf.strings.split(tf.io.read_file("/proc/self/stat"))[0]

    return coordinator, step, batches


@needs_tf_keras
def test_parameter_server_strategy_from_the_notebook_trains_on_both_workers(
    ps_cluster, coordinated
):
    cfg = json.loads(ps_cluster.client[1].apply_sync(os.getenv, "TF_CONFIG"))
    assert cfg["task"] == {"type": "worker", "index": 0}
    assert [len(cfg["cluster"][k]) for k in ("ps", "worker", "chief")] == [1, 2, 1]
    coordinator, step, batches = coordinated
    results = [coordinator.schedule(step, args=(batches,)) for _ in range(200)]
    coordinator.join()
    out = [(float(loss), int(pid)) for loss, pid in (r.fetch() for r in results)]
    losses = [loss for loss, _ in out]
    assert np.mean(losses[-20:]) < 0.1 * np.mean(losses[:20]), losses[:5] + losses[-5:]
    pids = ps_cluster.client[:].apply_sync(os.getpid)  # rank order
    steps = {rank: sum(1 for _, pid in out if pid == pids[rank]) for rank in (1, 2)}
    assert steps[1] > 0 and steps[2] > 0 and sum(steps.values()) == 200, (steps, pids)


@needs_tf_keras
def test_the_panel_shows_each_workers_steps_and_loss_and_the_servers_memory(
    ps_cluster, coordinated
):
    """hvdnb.ClusterCoordinator against an independent count: the pid each step returned
    itself (the test's step reads it); the store holds, per worker rank, exactly the steps
    that worker ran, with their losses, and the ps rank's heartbeat brings its RSS."""
    tf_coordinator, step, batches = coordinated
    coordinator = hvdnb.ClusterCoordinator(tf_coordinator.strategy, ps_cluster)
    assert coordinator.coordinator is tf_coordinator  # TensorFlow keeps one per strategy
    results = [coordinator.schedule(step, args=(batches,)) for _ in range(120)]
    coordinator.join()
    pids = ps_cluster.client[:].apply_sync(os.getpid)  # rank order
    ran = [(r.step, float(loss), int(pid)) for r, (loss, pid) in ((r, r.fetch()) for r in results)]
    assert [s for s, _, _ in ran] == list(range(120))
    fetched = coordinator.fetch({"first": results[:2], "last": results[-1]})  # TF's nests
    assert [float(loss) for loss, _ in fetched["first"]] == [loss for _, loss, _ in ran[:2]]
    assert float(fetched["last"][0]) == ran[-1][1]
    own = {rank: [(s, loss) for s, loss, pid in ran if pid == pids[rank]] for rank in (1, 2)}
    assert sum(map(len, own.values())) == 120 and coordinator.unplaced == 0, (pids, ran[:5])
    assert coordinator.steps == {rank: len(own[rank]) for rank in (1, 2)}
    store = get_store()
    for rank in (1, 2):
        steps, losses, _ = store.series("loss", rank)
        assert steps == [s for s, _ in own[rank]]  # the steps it ran, in schedule order
        assert losses == pytest.approx([loss for _, loss in own[rank]])
        assert store.series("ps/steps", rank)[1] == [float(i + 1) for i in range(len(own[rank]))]
        assert store.rank_info[rank]["tf_role"] == "worker"
        assert store.rank_info[rank]["ps_steps"] == len(own[rank])

    def server_rss():  # read since the ps took its role: not an earlier cluster's rank 0
        since = store.rank_info.get(0, {}).get("tf_since")
        _, values, times = store.series("mem/rss", 0, last=1, run=-1)
        return values[-1] if since is not None and values and times[-1] >= since else None

    deadline = time.monotonic() + 30  # the server's heartbeat: every 4 flush intervals
    while server_rss() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (server_rss() or 0) > 10e6, store.rank_info.get(0)
    assert store.rank_info[0]["tf_role"] == "ps" and store.rank_info[0]["tf_index"] == 0
    html = tables_html(store)
    assert "parameter-server cluster" in html, html
    for rank in (1, 2):
        assert f"<td>{rank}</td><td>worker {rank - 1}</td><td>{len(own[rank])}</td>" in html
    assert re.search(r"<td>0</td><td>ps 0</td><td></td><td></td><td>\d+ MB</td>", html), html


@needs_tf_keras
def test_a_parameter_server_killed_mid_run_is_named_like_a_rank_death(ps_cluster, coordinated):
    import tensorflow as tf

    coordinator, step, batches = coordinated
    ps_pid = ps_cluster.client[0].apply_sync(os.getpid)
    results = [coordinator.schedule(step, args=(batches,)) for _ in range(20)]
    os.kill(ps_pid, signal.SIGKILL)  # mid-run: steps scheduled, the ps gone under them
    # the coordinator's own error is TensorFlow's, as is: its variables' server is gone
    with pytest.raises((tf.errors.UnavailableError, tf.errors.AbortedError)):
        for _ in range(200):
            results.append(coordinator.schedule(step, args=(batches,)))
        coordinator.join()
    deadline = time.monotonic() + 60  # the controller notices a dead engine (nanny)
    while 0 not in ps_cluster.dead_ranks() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert 0 in ps_cluster.dead_ranks()
    note = health.died_note(ps_cluster)
    assert note is not None and "died" in note and "%dist restart" in note, note
    rows = {row["rank"]: row for row in health.status_rows(ps_cluster)}
    assert "dead" in str(rows[0]), rows[0]


@needs_tf_keras
def test_restart_brings_the_servers_back_and_a_new_strategy_trains(shell, ps_cluster):
    shell.run_line_magic("dist", "restart")  # after the kill above: every rank anew, new ports
    cluster = hvdnb.current()
    assert cluster is not None and cluster.running and cluster.dead_ranks() == []
    cfg = json.loads(cluster.client[0].apply_sync(os.getenv, "TF_CONFIG"))
    assert cfg["task"] == {"type": "ps", "index": 0}
    coordinator, step, batches = _coordinate(cluster)  # a second strategy in this process
    results = [coordinator.schedule(step, args=(batches,)) for _ in range(50)]
    coordinator.join()
    losses = [float(r.fetch()[0]) for r in results]
    assert np.mean(losses[-10:]) < np.mean(losses[:10]), losses


def test_restart_tf_ps_0_makes_a_plain_cluster_again(shell, ps_cluster):
    """``%dist restart --tf-ps 0``: the same ranks without parameter-server roles (a
    refused value first leaves the ps cluster running as it was)."""
    cluster = hvdnb.current()
    assert cluster is not None and cluster.spec.tf_ps == 1
    pids = cluster.pids()
    with pytest.raises(UsageError, match=r"--tf-ps 3 leaves no worker.*left as it was"):
        shell.run_line_magic("dist", "restart --tf-ps 3")
    assert cluster.running and cluster.pids() == pids and cluster.spec.tf_ps == 1
    shell.run_line_magic("dist", "restart --tf-ps 0")
    assert cluster.running and cluster.spec.tf_ps == 0 and cluster.n == 3
    env = cluster.client[:].apply_sync(os.getenv, "HVDNB_TF_PS")
    assert env == [None] * 3
    shell.run_cell_magic("distributed", "-q", "import torch.distributed as d\nd.barrier()")
