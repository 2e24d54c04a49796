"""The ssh check before an MPI job across hosts (hvdnb.notebook.cluster.sshcheck), with the
real ssh client; the hosts that do answer are in tests/multihost/test_hosts_ssh.py."""

from __future__ import annotations

import shutil

import pytest

from hvdnb.notebook.cluster import sshcheck


def test_only_the_ssh_launcher_is_checked(monkeypatch):
    monkeypatch.delenv("HYDRA_LAUNCHER", raising=False)
    monkeypatch.delenv("HYDRA_BOOTSTRAP", raising=False)
    assert sshcheck._uses_ssh([])
    assert sshcheck._uses_ssh(["-launcher", "ssh"])
    assert not sshcheck._uses_ssh(["-launcher", "slurm"])
    monkeypatch.setenv("HYDRA_LAUNCHER", "fork")
    assert not sshcheck._uses_ssh([])
    # a launcher that is not ssh: nothing is run, nothing is named
    assert sshcheck.unreachable(["nowhere.invalid"], timeout=1) == {}


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the ssh client")
def test_a_host_that_does_not_resolve_is_named_with_sshs_reason(monkeypatch):
    monkeypatch.delenv("HYDRA_LAUNCHER", raising=False)
    monkeypatch.delenv("HYDRA_LAUNCHER_EXEC", raising=False)
    bad = sshcheck.unreachable(["localhost", "nowhere.invalid"], timeout=10)
    assert list(bad) == ["nowhere.invalid"]  # this host itself is never checked
    assert "nowhere.invalid" in bad["nowhere.invalid"], bad  # ssh's own words
    line = sshcheck.verdict(bad, "hosts.txt")
    assert line.startswith("host nowhere.invalid did not answer ssh (")
    assert "\n" not in line and "`ssh nowhere.invalid true`" in line and "hosts.txt" in line
