"""Configuration overrides and the cluster's input checks (nothing is started)."""

from __future__ import annotations

import sys

import pytest

from hvdnb.config import get_config
from hvdnb.notebook.cluster import lifecycle as cl


def test_env_overrides_are_typed(monkeypatch):
    monkeypatch.setenv("HVDNB_START_TIMEOUT", "12.5")
    monkeypatch.setenv("HVDNB_RANKS", "3")
    cfg = get_config()
    assert cfg.start_timeout == 12.5 and cfg.ranks == 3


def test_bad_env_override_says_which_variable(monkeypatch):
    monkeypatch.setenv("HVDNB_HEARTBEAT_MS", "fast")
    with pytest.raises(ValueError, match="HVDNB_HEARTBEAT_MS='fast'"):
        get_config()


@pytest.mark.parametrize("n", [0, -1, 2.5, "2", True])
def test_bad_rank_counts_are_refused(n):
    with pytest.raises(cl.ClusterError, match="-n"):
        cl.Cluster(n=n)


def test_more_ranks_than_cores_needs_oversubscribe():
    too_many = cl.cores() + 1
    with pytest.raises(cl.ClusterError, match="--oversubscribe"):
        cl.Cluster(n=too_many)
    assert cl.Cluster(n=too_many, oversubscribe=True).n == too_many


def test_default_ranks_come_from_config(monkeypatch):
    monkeypatch.setenv("HVDNB_RANKS", "1")
    assert cl.Cluster().n == 1


@pytest.mark.parametrize(
    "kw", [{"backend": "tcp"}, {"timeout": 0}, {"timeout": -5}, {"launcher": ""}]
)
def test_bad_options_are_refused(kw):
    with pytest.raises(cl.ClusterError):
        cl.Cluster(n=1, **kw)


def test_missing_mpiexec_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(cl.ClusterError, match="pip install mpich"):
        cl.find_mpiexec()
    with pytest.raises(cl.ClusterError, match="pip install mpich"):
        cl.Cluster(n=1).start()


def test_a_start_is_tried_again_only_for_failures_a_second_try_clears():
    from hvdnb.notebook.cluster.launch import ClusterError, transient_start_failure

    grpc = ClusterError("rank 1 ... UnknownError: Could not start gRPC server. Is the port taken?")
    mpi = ClusterError("Fatal error in internal_Init_thread: Other MPI error")
    assert "TensorFlow" in transient_start_failure(grpc, multi_host=False)
    assert "TensorFlow" in transient_start_failure(grpc, multi_host=True)  # new ports anywhere
    assert "MPI_Init" in transient_start_failure(mpi, multi_host=False)
    assert transient_start_failure(mpi, multi_host=True) == ""  # another host's setup: reported
    assert transient_start_failure(ClusterError("mpiexec not found"), multi_host=False) == ""
    assert transient_start_failure(RuntimeError("Could not start gRPC server"), False) == ""
