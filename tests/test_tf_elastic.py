"""hvdnb.tensorflow.keras.elastic on 2 real ranks: a ``KerasState`` syncs rank 0's weights
to every rank, ``restore`` brings back the last commit (the model's weights and the
optimizer's slots), and ``CommitStateCallback`` commits at the batches it was given and at
each epoch's end while ``model.fit`` runs inside ``hvd.elastic.run``.

This file is also the rank script: pytest runs it under ``mpiexec -n 2`` (the helper of
``tests/spmd``), each rank runs ``_rank_main`` and prints ``OK test_tf_elastic``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":  # a rank: the project's root, for tests.spmd's preamble
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest

from tests.spmd.test_spmd import HANG_S, _report, mpiexec

NP = 2


def _rank_main() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow: tf.keras is tf-keras
    from tests.spmd import _spmd

    _spmd.setup()
    import numpy as np
    import tensorflow as tf

    import hvdnb.tensorflow.keras as hvd

    hvd.init()
    r = hvd.rank()
    tf.keras.utils.set_random_seed(7 + r)  # different initial weights on every rank
    model = tf.keras.Sequential(
        [tf.keras.layers.Dense(3, input_shape=(4,)), tf.keras.layers.Dense(1)]
    )
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.01)), loss="mse")
    state = hvd.elastic.KerasState(model, batch=0, epoch=0, tag=f"rank{r}")

    # sync: every rank ends with rank 0's weights and fields
    state.sync()
    every = hvd.allgather_object(model.get_weights())
    for mine, root in zip(every[r], every[0]):
        np.testing.assert_array_equal(mine, root)
    assert state.tag == "rank0", state.tag

    # commits counted through CommitStateCallback, with the batch each one saw
    commits: list[tuple[int, int]] = []
    plain_commit = state.commit

    def counting_commit() -> None:
        commits.append((state.epoch, state.batch))
        plain_commit()

    state.commit = counting_commit
    x = np.random.RandomState(r).rand(64, 4).astype("float32")  # 8 batches of 8 per epoch
    y = x.sum(axis=1, keepdims=True)

    @hvd.elastic.run
    def train(st: object) -> None:
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=2,
            verbose=0,
            callbacks=[
                hvd.elastic.UpdateBatchStateCallback(state),
                hvd.elastic.UpdateEpochStateCallback(state),
                hvd.elastic.CommitStateCallback(state, batches_per_commit=3),
            ],
        )

    train(state)
    # every 3rd of the 16 batches (the count runs on over the epoch's end), and each epoch's
    # end (after UpdateEpochStateCallback and UpdateBatchStateCallback moved on)
    want = [(0, 2), (0, 5), (1, 0), (1, 0), (1, 3), (1, 6), (2, 0)]
    assert commits == want, commits
    assert (state.epoch, state.batch) == (2, 0), (state.epoch, state.batch)
    assert len(state.optimizer.variables) > 1  # the slots exist now, and were committed

    # restore: the weights and the optimizer's slots of the last commit come back
    saved_w = model.get_weights()
    saved_opt = [v.numpy() for v in state.optimizer.variables]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # changes both
    assert not np.allclose(model.get_weights()[0], saved_w[0])
    state.epoch = 9
    state.restore()
    for now, then in zip(model.get_weights(), saved_w):
        np.testing.assert_array_equal(now, then)
    for var, then in zip(state.optimizer.variables, saved_opt):
        np.testing.assert_array_equal(var.numpy(), then)
    assert state.epoch == 2
    print(f"OK test_tf_elastic (rank {r})", flush=True)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_keras_state_sync_restore_and_commit_callback() -> None:
    pytest.importorskip("tensorflow", reason="TensorFlow is not installed: pip install 'hvdnb[tf]'")
    pytest.importorskip("tf_keras", reason="tf-keras is not installed: pip install 'hvdnb[tf]'")
    proc = mpiexec(Path(__file__).resolve(), NP, timeout=HANG_S + 60)
    assert proc.returncode == 0, _report(proc)
    assert proc.stdout.count("OK test_tf_elastic (rank") == NP, _report(proc)


if __name__ == "__main__":
    _rank_main()
