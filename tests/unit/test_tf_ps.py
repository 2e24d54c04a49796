"""ParameterServerStrategy's pieces that need no cluster: the roles in ``TF_CONFIG``, the
start checks of ``--tf-ps`` (each a clear error, before anything starts), the chief's
address in the engines' environment, and ``%dist start --tf-ps`` refused by other actions."""

from __future__ import annotations

import importlib.util
import json

import pytest
from IPython.core.error import UsageError

from hvdnb.notebook.cluster import launch, spec
from hvdnb.notebook.cluster.spec import ClusterError
from hvdnb.rank import tfconfig

ADDRS = ["127.0.0.1:1001", "127.0.0.1:1002", "127.0.0.1:1003"]


def test_ps_config_gives_ps_worker_and_chief_roles_in_rank_order():
    cfgs = [json.loads(tfconfig.ps_config(ADDRS, r, 1, "127.0.0.1:999")) for r in range(3)]
    cluster = {"ps": ADDRS[:1], "worker": ADDRS[1:], "chief": ["127.0.0.1:999"]}
    assert all(c["cluster"] == cluster for c in cfgs)
    assert [c["task"] for c in cfgs] == [
        {"type": "ps", "index": 0},
        {"type": "worker", "index": 0},
        {"type": "worker", "index": 1},
    ]
    two_ps = json.loads(tfconfig.ps_config(ADDRS, 1, 2, "127.0.0.1:999"))
    assert two_ps["task"] == {"type": "ps", "index": 1} and two_ps["cluster"]["worker"] == ADDRS[2:]


@pytest.mark.parametrize(
    ("n_ps", "chief", "match"),
    [(3, "127.0.0.1:999", "leave no worker"), (1, ADDRS[0], "share an address")],
)
def test_ps_config_refuses_a_cluster_without_workers_or_with_a_shared_address(n_ps, chief, match):
    with pytest.raises(ValueError, match=match):
        tfconfig.ps_config(ADDRS, 0, n_ps, chief)


@pytest.mark.parametrize(
    ("tf_ps", "match"),
    [
        (0, r"--tf-ps must be the number of parameter servers, 1 or more, not 0"),
        (-1, r"1 or more, not -1"),
        (3, r"--tf-ps 3 leaves no worker among 3 ranks.*`-n 4` or more"),
        (5, r"--tf-ps 5 leaves no worker among 3 ranks.*`-n 6`"),
    ],
)
def test_bad_tf_ps_is_refused_before_anything_starts(tf_ps, match):
    with pytest.raises(ClusterError, match=match):
        spec.check(3, oversubscribe=True, tf_ps=tf_ps)


def test_tf_ps_without_tensorflow_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorflow" else real(name)
    )
    with pytest.raises(ClusterError, match=r"needs TensorFlow.*pip install .*\[tf\]"):
        spec.check(3, oversubscribe=True, tf_ps=1)


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow")
def test_the_engines_learn_their_ps_count_and_the_chief_address():
    s = spec.check(3, oversubscribe=True, tf_ps=1)
    env = launch.tf_ps_env(s)
    assert env["HVDNB_TF_PS"] == "1"
    host, port = env["HVDNB_TF_CHIEF"].rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    assert launch.tf_ps_env(spec.check(3, oversubscribe=True)) == {}  # not a ps cluster


def test_tf_ps_at_start_and_restart(shell):
    # restart takes it too (the same ranks with new roles): here there is nothing to restart
    with pytest.raises(UsageError, match=r"no cluster to restart"):
        shell.run_line_magic("dist", "restart --tf-ps 1")
    with pytest.raises(UsageError, match=r"--tf-ps 0 ranks|1 or more, not 0"):
        shell.run_line_magic("dist", "start -n 3 --oversubscribe --tf-ps 0")


def test_keras3_per_replica_error_gets_one_line_naming_the_fix():
    from hvdnb.extras import KERAS3_FIT_HINT, hint_for_error

    evalue = (
        "Attempt to convert a value (PerReplica:{\n  0: <tf.Tensor: shape=(8, 4)>\n}) with an "
        "unsupported type (<class 'tensorflow.python.distribute.values.PerReplica'>) to a Tensor."
    )
    assert hint_for_error("ValueError", evalue) == KERAS3_FIT_HINT
    assert "TF_USE_LEGACY_KERAS" in KERAS3_FIT_HINT and "20585" in KERAS3_FIT_HINT
    assert hint_for_error("ValueError", "unsupported type <class 'set'> to a Tensor") is None
