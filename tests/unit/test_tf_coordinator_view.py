"""The ParameterServerStrategy panel's pieces without processes: what counts as a step's loss
(``hvdnb.notebook.tfcoord.loss_of``) and the panel's parameter-server table, fed the
messages a ps rank's heartbeat and ``hvdnb.ClusterCoordinator`` put into a store. The
whole path on real ranks is ``tests/integration/test_tf_strategies.py``."""

from __future__ import annotations

import time

import numpy as np
import pytest

import hvdnb
from hvdnb.notebook.cluster.spec import ClusterError
from hvdnb.notebook.metrics.store import MetricsStore
from hvdnb.notebook.panel.pstable import ps_table
from hvdnb.notebook.panel.tables import tables_html
from hvdnb.notebook.tfcoord import loss_of

pytestmark = pytest.mark.timeout(30)


def test_the_loss_is_a_scalar_a_sequences_first_item_or_a_dicts_loss() -> None:
    assert loss_of(np.float32(0.5)) == 0.5
    assert loss_of((np.float32(2.0), b"1234")) == 2.0
    assert loss_of([np.array([[3.0]]), 1]) == 3.0  # one value, whatever its shape
    assert loss_of({"loss": np.float64(4.0), "acc": 0.9}) == 4.0
    assert loss_of(7) == 7.0
    for none in (np.array([1.0, 2.0]), b"text", None, (), {"acc": 0.9}, object()):
        assert loss_of(none) is None, none


def _ps_heartbeat(store: MetricsStore, rss: float) -> None:
    store.ingest(
        {
            "rank": 0,
            "seq": 1,
            "pid": 100,
            "cols": {"mem/rss": [[0], [time.time()], [rss]]},
            "step": 0,
            "idle": True,
            "meta": {"tf_role": "ps", "tf_index": 0},
        }
    )


def _worker_steps(store: MetricsStore, rank: int, steps: list[int], losses: list[float]) -> None:
    now = time.time()
    store.ingest(  # as ClusterCoordinator._collect writes them
        {
            "rank": rank,
            "cols": {
                "loss": [steps, [now] * len(steps), losses],
                "ps/steps": [steps, [now] * len(steps), [float(i + 1) for i in range(len(steps))]],
            },
            "step": steps[-1],
            "idle": True,
            "pid": 100 + rank,
            "meta": {"tf_role": "worker", "tf_index": rank - 1, "ps_steps": len(steps)},
        }
    )


def test_the_table_lists_roles_steps_loss_and_rss_and_says_na_when_missing() -> None:
    store = MetricsStore()
    assert ps_table(store) == ""  # no rank said a TensorFlow role: no table
    store.begin_cell(None)
    _worker_steps(store, 1, [0, 2, 3], [0.9, 0.7, 0.5])
    _worker_steps(store, 2, [1, 4], [0.8, 0.6])
    html = ps_table(store)
    assert "parameter-server cluster" in html
    assert "<td>1</td><td>worker 0</td><td>3</td><td>0.5</td><td>n/a</td>" in html
    assert "<td>2</td><td>worker 1</td><td>2</td><td>0.6</td><td>n/a</td>" in html
    assert "ps 0" not in html  # the server has not reported yet
    _ps_heartbeat(store, 512e6)
    html = ps_table(store)
    assert "<td>0</td><td>ps 0</td><td></td><td></td><td>512 MB</td>" in html
    assert html in tables_html(store)
    assert store.progress()[0] == 4  # the header's step: the coordinator's latest
    # one run, the workers' losses at the coordinator's step numbers
    assert len(store.runs) == 1
    assert store.series("loss", 1)[0] == [0, 2, 3]
    assert store.series("loss", 2)[0] == [1, 4]


def test_without_a_ps_cluster_the_coordinator_says_how_to_start_one() -> None:
    assert hvdnb.current() is None
    with pytest.raises(ClusterError, match=r"`%dist start -n 3 --tf-ps 1` starts 1 parameter"):
        hvdnb.ClusterCoordinator(object())
