"""TensorFlow pieces without processes or TensorFlow: the TF_CONFIG JSON each rank gets,
the worker address and port, a user's own TF_CONFIG left alone, and the Keras callback's
calls to ``hvdnb.log`` (driven by a stand-in ``keras`` module)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import types

import pytest

import hvdnb
from hvdnb import host
from hvdnb.rank import keras as hkeras
from hvdnb.rank import tfconfig
from hvdnb.rank.rendezvous import World


def _world(rank: int = 0, size: int = 2, local_size: int = 2) -> World:
    return World(rank, size, rank % local_size, local_size, rank // local_size, 1, "h", "env")


def test_tf_config_names_every_worker_in_rank_order_and_this_index():
    workers = ["127.0.0.1:4001", "127.0.0.1:4002", "10.0.0.7:4001"]
    for i in range(3):
        cfg = json.loads(tfconfig.tf_config(workers, i))
        assert cfg == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}


def test_tf_config_refuses_a_bad_index_or_a_shared_address():
    with pytest.raises(ValueError, match="outside"):
        tfconfig.tf_config(["127.0.0.1:1"], 1)
    with pytest.raises(ValueError, match="share"):
        tfconfig.tf_config(["127.0.0.1:1", "127.0.0.1:1"], 0)


def test_resolve_gives_none_to_every_rank_when_one_rank_has_no_entry():
    assert json.loads(tfconfig.resolve(["a:1", "a:2"], 1))["task"]["index"] == 1
    assert tfconfig.resolve(["a:1", None], 0) is None
    assert tfconfig.resolve([None, "a:2"], 1) is None


def test_worker_address_is_loopback_on_one_host_and_the_route_to_rank_0_across_hosts(
    monkeypatch,
):
    assert tfconfig.worker_addr(_world(1, 2, 2), "10.1.2.3") == "127.0.0.1"
    monkeypatch.setattr(host, "route_addr", lambda peer: f"route-to-{peer}")
    assert tfconfig.worker_addr(_world(2, 4, 2), "10.1.2.3") == "route-to-10.1.2.3"
    # no usable MASTER_ADDR across hosts: this host's own name
    monkeypatch.setattr(host.socket, "gethostbyname", lambda name: "10.9.9.9")
    assert tfconfig.worker_addr(_world(2, 4, 2), "127.0.0.1") == "10.9.9.9"
    assert tfconfig.worker_addr(_world(2, 4, 2), None) == "10.9.9.9"


def test_free_port_is_free_and_left_closed():
    port = tfconfig.free_port("127.0.0.1")
    assert port and 0 < port < 65536
    with socket.socket() as s:  # nothing holds it: it binds again at once
        s.bind(("127.0.0.1", port))
    # not an address of this host (no test puts .254 on an interface: tests/multihost
    # puts 203.0.113.1 on a bridge of this host while it runs, in the other lane too)
    assert tfconfig.free_port("203.0.113.254") is None


def test_setup_on_a_world_of_one_sets_tf_config_and_the_thread_counts(monkeypatch):
    for k in ("TF_CONFIG", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TF_NUM_INTEROP_THREADS", "7")  # the user's wins
    value = tfconfig.setup(World(0, 1, 0, 1, 0, 1, "h", "single"))
    cfg = json.loads(value)
    assert json.loads(tfconfig.os.environ["TF_CONFIG"]) == cfg
    (worker,) = cfg["cluster"]["worker"]
    assert worker.startswith("127.0.0.1:") and int(worker.rsplit(":", 1)[1]) > 0
    assert cfg["task"] == {"type": "worker", "index": 0}
    assert int(tfconfig.os.environ["TF_NUM_INTRAOP_THREADS"]) >= 1
    assert tfconfig.os.environ["TF_NUM_INTEROP_THREADS"] == "7"


def test_setup_uses_the_exchanged_list_and_its_own_index(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    seen = []

    def exchange(w, entry):
        seen.append(entry)
        return ["127.0.0.1:5000", entry]

    monkeypatch.setattr(tfconfig, "_exchange", exchange)
    cfg = json.loads(tfconfig.setup(_world(1, 2, 2)))
    assert cfg["cluster"]["worker"] == ["127.0.0.1:5000", seen[0]]
    assert cfg["task"]["index"] == 1


def test_ranks_handed_one_port_probe_again_until_no_two_and_not_the_chief_share(monkeypatch):
    """A probed port is closed at once, so the kernel can hand it to two processes on one
    host (seen at a ``%dist restart`` of a ps cluster: a rank got the chief's port). Three
    ranks in threads, exchanging as an allgather does, with scripted probes."""
    probes = {0: [5000], 1: [5000, 5001], 2: [6000, 5001, 5002]}  # 6000: the chief's
    monkeypatch.setattr(tfconfig, "free_port", lambda addr: probes[threading_rank()].pop(0))
    local = threading.local()

    def threading_rank() -> int:
        return int(local.rank)

    board: dict[int, str | None] = {}
    barrier = threading.Barrier(3)

    def exchange(w, entry):
        board[w.rank] = entry
        barrier.wait()
        out = [board[r] for r in range(3)]
        barrier.wait()
        return out

    monkeypatch.setattr(tfconfig, "_exchange", exchange)
    results: dict[int, list] = {}

    def rank(r: int) -> None:
        local.rank = r
        results[r] = tfconfig._distinct_entries(_world(r, 3, 3), "127.0.0.1", "127.0.0.1:6000")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    want = ["127.0.0.1:5000", "127.0.0.1:5001", "127.0.0.1:5002"]
    assert results == {0: want, 1: want, 2: want}
    assert probes == {0: [], 1: [], 2: []}  # rank 0 kept its first port; the others probed


def test_a_users_tf_config_is_kept_and_then_no_rank_gets_ours(monkeypatch, capsys):
    mine = '{"cluster": {"worker": ["node7:2222"]}, "task": {"type": "worker", "index": 0}}'
    monkeypatch.setenv("TF_CONFIG", mine)
    entries = []
    monkeypatch.setattr(tfconfig, "_exchange", lambda w, e: entries.append(e) or [e, "x:1"])
    assert tfconfig.setup(_world(0)) is None
    assert entries == [None]  # still joins the exchange (collective), with no entry
    assert tfconfig.os.environ["TF_CONFIG"] == mine
    # the other rank, without one: left unset too, and says why
    monkeypatch.delenv("TF_CONFIG")
    monkeypatch.setattr(tfconfig, "_exchange", lambda w, e: [None, e])
    assert tfconfig.setup(_world(1)) is None
    assert "TF_CONFIG" not in tfconfig.os.environ
    assert "TF_CONFIG left unset" in capsys.readouterr().err


def test_importing_hvdnb_imports_neither_keras_nor_tensorflow():
    code = "import sys, hvdnb; hvdnb.keras_callback; print('keras' in sys.modules, 'tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.fixture
def fake_keras(monkeypatch):
    """A ``keras`` module whose Callback is a plain class, and ``hvdnb.log`` recorded."""

    class Callback:
        def __init__(self):
            self.params = {}

    mod = types.ModuleType("keras")
    mod.callbacks = types.SimpleNamespace(Callback=Callback)
    monkeypatch.setitem(sys.modules, "keras", mod)
    monkeypatch.setitem(sys.modules, "tf_keras", None)  # else its Callback is the base
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    hkeras._callback_class.cache_clear()
    calls = []
    monkeypatch.setattr(
        hkeras.recorder, "log", lambda step, loss=None, **m: calls.append((step, loss, m))
    )
    yield Callback, calls
    hkeras._callback_class.cache_clear()


def test_keras_callback_logs_each_batch_with_steps_across_epochs(fake_keras):
    base, calls = fake_keras
    cb = hvdnb.keras_callback(samples=32)
    assert isinstance(cb, base)
    cb.params = {"steps": 3, "epochs": 2}
    cb.on_train_begin()
    for epoch in range(2):
        cb.on_epoch_begin(epoch)
        for batch in range(3):
            cb.on_train_batch_end(batch, {"loss": 1.0 / (batch + 1), "accuracy": 0.5, "v": [1, 2]})
    assert [c[0] for c in calls] == [0, 1, 2, 3, 4, 5]
    assert calls[1] == (1, 0.5, {"accuracy": 0.5, "samples": 32, "total_steps": 6})
    # a second fit with the same callback goes on counting
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    cb.on_train_batch_end(0, {"loss": 0.1})
    assert calls[-1][0] == 6 and calls[-1][2]["total_steps"] == 12


def test_keras_callback_with_steps_per_execution_and_unknown_sizes(fake_keras):
    _, calls = fake_keras
    cb = hvdnb.keras_callback(metrics=False)
    cb.on_train_begin()  # no params: no total_steps
    cb.on_epoch_begin(0)
    for batch in (3, 7):  # one call per 4 steps
        cb.on_train_batch_end(batch, {"loss": 2.0, "accuracy": 0.1})
    cb.on_epoch_begin(1)
    cb.on_train_batch_end(3, {"loss": 1.0})
    assert calls == [(3, 2.0, {}), (7, 2.0, {}), (11, 1.0, {})]


def test_keras_callback_without_keras_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "keras", None)  # import keras raises ImportError
    monkeypatch.setitem(sys.modules, "tf_keras", None)  # else its Callback is the base
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    hkeras._callback_class.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"\[tf\]"):
            hvdnb.keras_callback()
    finally:
        hkeras._callback_class.cache_clear()
