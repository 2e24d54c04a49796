"""``devices="auto"`` on a rank, without a cluster: ``auto_devices`` (the ranks on this host,
the hosts; more ranks than GPUs refused in one line) and the patched connector method, on
subclasses of Lightning's own connectors (Trainer's and Fabric's), so Lightning's classes
stay as they are in this process. On real ranks: tests/integration/test_lightning_defaults.py.
"""

from __future__ import annotations

import pytest

from hvdnb.rank.frameworks import lightning_hooks
from hvdnb.rank.frameworks.common import Place
from hvdnb.rank.frameworks.lightning_hooks import auto_devices


def place(size: int, local_size: int, rank: int = 0) -> Place:
    return Place(rank, size, rank % local_size, local_size, size // local_size, "cpu", "gloo")


@pytest.mark.parametrize(
    ("size", "local_size", "want"),
    [(1, 1, (1, 1)), (2, 2, (2, 1)), (3, 3, (3, 1)), (4, 2, (2, 2)), (8, 1, (1, 8))],
)
def test_auto_is_the_ranks_on_this_host_and_the_hosts(size, local_size, want):
    assert auto_devices(place(size, local_size), 1, None, "Trainer(devices='auto')") == want


def test_a_num_nodes_the_user_gave_is_kept_for_lightning_to_check():
    assert auto_devices(place(4, 2), 3, None, "Fabric(devices='auto')") == (2, 3)


def test_gpus_enough_for_the_hosts_ranks_fit():
    assert auto_devices(place(4, 2), 1, 8, "Trainer(devices='auto')") == (2, 2)
    assert auto_devices(place(2, 2), 1, 2, "Trainer(devices='auto')") == (2, 1)


def test_more_ranks_than_gpus_on_a_host_is_one_clear_error():
    with pytest.raises(ValueError) as e:
        auto_devices(place(6, 3, rank=4), 1, 2, "Trainer(devices='auto')")
    msg = str(e.value)
    assert msg.startswith("Trainer(devices='auto') on rank 4: this host runs 3 ranks")
    assert "sees 2 device(s)" in msg and "%dist restart -n 4" in msg
    assert "accelerator='cpu'" in msg


@pytest.fixture(params=["trainer", "fabric"])
def connector(request):
    """A subclass of the Trainer's or Fabric's connector with hvdnb's method in it."""
    if request.param == "trainer":
        pytest.importorskip("lightning")
        from lightning.pytorch.trainer.connectors.accelerator_connector import (
            _AcceleratorConnector as base,
        )
    else:
        pytest.importorskip("lightning")
        from lightning.fabric.connector import _Connector as base

    own = base._set_devices_flag_if_auto_passed
    cls = type("Patched", (base,), {})
    lightning_hooks._auto_is_the_cluster(cls, request.param.title())
    lightning_hooks._auto_is_the_cluster(cls, request.param.title())  # once is enough
    assert base._set_devices_flag_if_auto_passed is own
    assert cls._set_devices_flag_if_auto_passed.__hvdnb__
    return cls


def devices_of(conn) -> tuple[int, int, str]:
    return len(conn._parallel_devices), conn._num_nodes_flag, type(conn.strategy).__name__


def test_outside_a_rank_auto_is_lightnings(connector, monkeypatch):
    monkeypatch.setattr(lightning_hooks, "installed", lambda: None)
    assert devices_of(connector(accelerator="cpu", devices="auto")) == (
        1,
        1,
        "SingleDeviceStrategy",
    )


def _not_interactive(monkeypatch) -> None:
    """Lightning reads ``sys.ps1`` once, at import (``_IS_INTERACTIVE``): after another test
    made an IPython shell, it refuses 'ddp' as an interactive session. A rank's own
    launch is not what this file tests: its connectors are made as a script's would be."""
    import lightning.fabric.connector as fabric_connector
    import lightning.pytorch.trainer.connectors.accelerator_connector as trainer_connector

    for mod in (fabric_connector, trainer_connector):
        monkeypatch.setattr(mod, "_IS_INTERACTIVE", False)


def test_on_a_rank_auto_is_the_cluster(connector, monkeypatch):
    _not_interactive(monkeypatch)
    monkeypatch.setattr(lightning_hooks, "installed", lambda: place(4, 2))
    assert devices_of(connector(accelerator="cpu")) == (2, 2, "DDPStrategy")
    assert devices_of(connector(accelerator="cpu", devices="auto", num_nodes=3)) == (
        2,
        3,
        "DDPStrategy",
    )
    monkeypatch.setattr(lightning_hooks, "installed", lambda: place(1, 1))
    assert devices_of(connector(accelerator="cpu")) == (1, 1, "SingleDeviceStrategy")


def test_on_a_rank_a_count_is_lightnings(connector, monkeypatch):
    _not_interactive(monkeypatch)
    monkeypatch.setattr(lightning_hooks, "installed", lambda: place(4, 2))
    assert devices_of(connector(accelerator="cpu", devices=1)) == (1, 1, "SingleDeviceStrategy")
    assert devices_of(connector(accelerator="cpu", devices=3)) == (3, 1, "DDPStrategy")
