"""The ParameterServerStrategy panel's pieces without processes: what counts as a step's loss
(``hvdnb.notebook.tf.tfcoord.loss_of``) and the panel's parameter-server table, fed the
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
from hvdnb.notebook.tf.tfcoord import StepBook, loss_of

pytestmark = pytest.mark.timeout(30)


def test_the_loss_is_a_scalar_a_sequences_first_item_or_a_dicts_loss() -> None:
    assert loss_of(np.float32(0.5)) == 0.5
    assert loss_of((np.float32(2.0), b"1234")) == 2.0
    assert loss_of([np.array([[3.0]]), 1]) == 3.0  # one value, whatever its shape
    assert loss_of({"loss": np.float64(4.0), "acc": 0.9}) == 4.0
    assert loss_of(7) == 7.0
    for none in (np.array([1.0, 2.0]), b"text", None, (), {"acc": 0.9}, object()):
        assert loss_of(none) is None, none


def _ps_heartbeat(store: MetricsStore, seq: int, rss: float, at: float, since: float) -> None:
    store.ingest(
        {
            "rank": 0,
            "seq": seq,
            "pid": 100,
            "cols": {"mem/rss": [[0], [at], [rss]]},
            "step": 0,
            "idle": True,
            "meta": {"tf_role": "ps", "tf_index": 0, "tf_since": since},
        }
    )


def test_the_book_counts_each_workers_steps_by_pid_and_says_so_per_rank() -> None:
    book = StepBook([100, 101, 102], n_ps=1)  # rank 0 serves, ranks 1 and 2 work
    assert book.steps == {1: 0, 2: 0}
    assert book.rank_of(100) is None and book.rank_of(102) == 2  # a ps runs no step
    done = [(0, 0.9, 101), (1, (0.8, b"x"), 102), (2, {"loss": 0.7}, 101), (3, None, 101)]
    msgs = book.messages([*done, (4, 0.5, 999), (5, 0.4, 100)], 1.0, True, {1: {"backend": "gloo"}})
    assert book.steps == {1: 3, 2: 1} and book.unplaced == 2  # unknown pid, the server's
    by_rank = {m["rank"]: m for m in msgs}
    assert sorted(by_rank) == [1, 2]
    one = by_rank[1]
    assert one["cols"]["loss"] == [[0, 2], [1.0, 1.0], [0.9, 0.7]]  # step 3 returned no loss
    assert one["cols"]["ps/steps"] == [[0, 2, 3], [1.0] * 3, [1.0, 2.0, 3.0]]
    assert (one["step"], one["pid"], one["backend"], one["idle"]) == (3, 101, "gloo", True)
    assert one["meta"] == {"tf_role": "worker", "tf_index": 0, "ps_steps": 3}
    assert by_rank[2]["meta"] == {"tf_role": "worker", "tf_index": 1, "ps_steps": 1}
    # counts go on across collections
    (again,) = book.messages([(6, 0.3, 102)], 2.0, True, {})
    assert again["cols"]["ps/steps"][2] == [2.0] and book.steps == {1: 3, 2: 2}


def _worker_steps(store: MetricsStore, book: StepBook, done: list[tuple[int, float, int]]) -> None:
    for msg in book.messages(done, time.time(), True, store.rank_info):  # as _collect does
        store.ingest(msg)


def test_the_table_lists_roles_steps_loss_and_rss_and_says_na_when_missing() -> None:
    store = MetricsStore()
    assert ps_table(store) == ""  # no rank said a TensorFlow role: no table
    store.begin_cell(None)
    book = StepBook([100, 101, 102], n_ps=1)
    _worker_steps(store, book, [(0, 0.9, 101), (1, 0.8, 102), (2, 0.7, 101), (3, 0.5, 101)])
    _worker_steps(store, book, [(4, 0.6, 102)])
    html = ps_table(store)
    assert "parameter-server cluster" in html
    assert "<td>1</td><td>worker 0</td><td>3</td><td>0.5</td><td>n/a</td>" in html
    assert "<td>2</td><td>worker 1</td><td>2</td><td>0.6</td><td>n/a</td>" in html
    assert "ps 0" not in html  # the server has not reported yet
    since = time.time()
    _ps_heartbeat(store, 1, 256e6, since - 100, since)  # an earlier cluster's rank 0 (stale)
    html = ps_table(store)
    assert "<td>0</td><td>ps 0</td><td></td><td></td><td>n/a</td>" in html
    _ps_heartbeat(store, 2, 512e6, since + 1, since)
    html = ps_table(store)
    assert "<td>0</td><td>ps 0</td><td></td><td></td><td>512 MB</td>" in html
    assert html in tables_html(store)
    # the hint says where a ps cluster's numbers come from (no step-time breakdown there)
    assert store.hint().startswith("parameter-server cluster: hvdnb.ClusterCoordinator")
    assert store.progress()[0] == 4  # the header's step: the coordinator's latest
    # one run, the workers' losses at the coordinator's step numbers
    assert len(store.runs) == 1
    assert store.series("loss", 1)[0] == [0, 2, 3]
    assert store.series("loss", 2)[0] == [1, 4]


def test_without_a_ps_cluster_the_coordinator_says_how_to_start_one() -> None:
    assert hvdnb.current() is None
    with pytest.raises(ClusterError, match=r"`%dist start -n 3 --tf-ps 1` starts 1 parameter"):
        hvdnb.ClusterCoordinator(object())
