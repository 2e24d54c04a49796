"""Warm standby for ``%dist restart``: real standby processes, real hand-overs under a real
mpiexec, real gloo groups afterwards (``hvdnb/notebook/cluster/standby.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter

import psutil
import pytest

import hvdnb
from hvdnb import host
from hvdnb.notebook.cluster import spec as spec_mod
from hvdnb.notebook.cluster.sshslots import Placement
from hvdnb.notebook.cluster.standby import MEMORY_FACTOR, host_slots, on_hosts, policy
from tests.conftest import alive

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

HOW = "import os, torch.distributed as d; (os.getpid(), os.environ.get('HVDNB_STARTED', 'cold'), d.get_world_size())"


def _ready(c, k: int) -> list[int]:
    """Wait (not a timing assertion: a deadline for a broken standby) until ``k`` standby
    processes are ready; their pids."""
    deadline = time.monotonic() + 180
    while c.standby.ready() < k:
        assert time.monotonic() < deadline, c.standby.line()
        time.sleep(0.1)
    return [r["pid"] for r in c.standby.rows()]


def _ranks(shell) -> dict[int, tuple[int, str, int]]:
    shell.run_cell_magic("distributed", "-q -o r", HOW)
    return dict(shell.user_ns["r"])


@pytest.fixture
def standby_on(monkeypatch):
    monkeypatch.setenv("HVDNB_STANDBY", "auto")


def test_restart_hands_every_rank_to_a_standby_that_is_never_a_rank(
    shell, standby_on, monkeypatch, capsys
):
    running = hvdnb.current()
    if running is not None and running.running:
        running.stop()
    shell.run_line_magic("dist", "start -n 2 --timeout 120")
    c = hvdnb.current()
    try:
        waiting = _ready(c, 2)
        # not ranks: the controller and %%px see two engines, collectives two ranks
        assert sorted(c.client.ids) == [0, 1]
        assert not set(waiting) & {pid for pid, _, _ in _ranks(shell).values()}
        assert {w for _, _, w in _ranks(shell).values()} == {2}
        capsys.readouterr()
        shell.run_line_magic("dist", "status")
        status = capsys.readouterr().out
        rows = [line.split() for line in status.splitlines() if line.startswith("standby ")]
        assert sorted(int(r[2]) for r in rows) == sorted(waiting)  # listed, not numbered
        assert "standby: 2 of 2 ready" in status and "its own)" in status
        old = c.pids()

        # the spare controller's cluster file names its 0600 connection files: 0600 too
        # (ipyparallel wrote it 0644)
        spare_file = c.standby._spare.cluster_file
        assert os.stat(spare_file).st_mode & 0o777 == 0o600, oct(os.stat(spare_file).st_mode)

        shell.run_line_magic("dist", "restart")
        out = capsys.readouterr().out
        assert "warm (every rank from the standby)" in out, out
        assert c.warm_ranks == 2
        ranks = _ranks(shell)
        assert {pid for pid, _, _ in ranks.values()} == set(waiting)  # they became the ranks
        # back to back: the standby's refill is still importing torch; the ranks go to it
        # rather than to cold processes importing beside it (3.3 s against a cold 2.2 s)
        importing = [r["pid"] for r in c.standby.rows()]
        assert len(importing) == 2, c.standby.rows()
        shell.run_line_magic("dist", "restart")
        out = capsys.readouterr().out
        assert "warm (every rank from the standby)" in out, out
        ranks = _ranks(shell)
        assert {pid for pid, _, _ in ranks.values()} == set(importing)
        assert {how for _, how, _ in ranks.values()} == {"warm"}
        assert {how for _, how, _ in ranks.values()} == {"warm"}
        assert {w for _, _, w in ranks.values()} == {2}
        shell.run_cell_magic(
            "distributed",
            "-q -o s",
            "import torch, torch.distributed as d\nt = torch.ones(1) * (d.get_rank() + 1)\n"
            "d.all_reduce(t)\nint(t)",
        )
        assert shell.user_ns["s"] == {0: 3, 1: 3}
        assert alive(old) == []  # the old ranks, mpiexec and controller are gone

        # a restart with more ranks than the standby has: those it has are warm
        again = _ready(c, 2)
        shell.run_line_magic("dist", "restart -n 3 --oversubscribe")
        out = capsys.readouterr().out
        assert "2 of 3 ranks warm" in out, out
        ranks = _ranks(shell)
        hows = sorted(how for _, how, _ in ranks.values())
        assert hows[-1] == "warm" and hows.count("warm") == 2 and hows[0].startswith("cold")
        assert {pid for pid, how, _ in ranks.values() if how == "warm"} == set(again)
        assert {w for _, _, w in ranks.values()} == {3}

        # a rank imports a framework: the standby imports it too, before the next restart
        _ready(c, 3)
        shell.run_cell_magic("distributed", "-q", "import sklearn")
        deadline = time.monotonic() + 120
        while not all("sklearn" in r["modules"] for r in c.standby.rows()):
            assert time.monotonic() < deadline, c.standby.rows()
            time.sleep(0.2)
        # and the ranks it serves have it; they talk on the side channel as any rank (a
        # rank announcing an import during its bootstrap had connected it too early: a
        # restart after `import accelerate` failed waiting for the ranks' hello)
        _ready(c, 3)
        shell.run_line_magic("dist", "restart")
        assert "warm (every rank from the standby)" in capsys.readouterr().out
        shell.run_cell_magic("distributed", "-q -o m", "import sys\n'sklearn' in sys.modules")
        assert shell.user_ns["m"] == {0: True, 1: True, 2: True}
        _ready(c, 3)
        spare = c.standby.pids()

        # a variable the interpreter read at its start differs now: the standby refuses,
        # the ranks start cold, and their launcher's output says why
        was = os.environ.get("OMP_NUM_THREADS")
        monkeypatch.setenv("OMP_NUM_THREADS", "1" if was != "1" else "2")
        shell.run_line_magic("dist", "restart")
        out = capsys.readouterr().out
        assert "cold: no standby, because its processes started with other OMP_NUM_THREADS" in out
        assert c.warm_ranks == 0
        hows = [how for _, how, _ in _ranks(shell).values()]
        assert len(hows) == 3 and all(h.startswith("cold") for h in hows), hows
        assert alive(spare[:-1]) == []  # they could serve no rank: replaced by new ones
        fresh = [r["pid"] for r in c.standby.rows()]  # still importing: closed mid-import below
        assert len(fresh) == 3 and not set(fresh) & set(spare)

        monkeypatch.setenv("HVDNB_STANDBY", "0")
        shell.run_line_magic("dist", "restart")
        out = capsys.readouterr().out
        assert "cold: no standby, because HVDNB_STANDBY=0 turned it off" in out, out
        assert c.standby.rows() == [] and c.standby.pids() == []
        assert alive(fresh) == []
        shell.run_line_magic("dist", "status")
        assert "standby: off, because HVDNB_STANDBY=0" in capsys.readouterr().out
    finally:
        shell.run_line_magic("dist", "stop")
    assert alive(c.standby.taken_pids()) == []
    assert c.standby.rows() == [] and c.standby.path is None


def test_an_elastic_restart_finds_its_store_serving(standby_on):
    """An elastic cluster's rendezvous store is a process that imports torch before it
    serves: the standby starts the next one after each start, and the restart takes it."""
    from hvdnb.notebook.cellout.cells import run_cell

    c = hvdnb.Cluster(n=2, min_np=1, oversubscribe=True)
    c.start()
    seen: list[int] = []
    try:
        for _ in range(2):
            _ready(c, 2)
            spare = c.store_host.spare_pid
            assert spare is not None and spare != c.store_host.pid
            seen += [spare, c.store_host.pid]
            c.restart()
            assert c.store_host.pid == spare  # the spare serves the new cluster
            assert c.warm_ranks == 2
            r = run_cell(
                c,
                "import torch, torch.distributed as d; t = torch.ones(1); "
                "d.all_reduce(t); (d.get_world_size(), t.item())",
                quiet=True,
            )
            assert r.values == {0: (2, 2.0), 1: (2, 2.0)}
        seen += [c.store_host.spare_pid or 0, *c.pids()]
    finally:
        c.stop()
    assert not alive([p for p in seen if p])  # the spare store goes with the stop too


def test_a_killed_kernel_takes_its_standby_with_it(tmp_path):
    code = textwrap.dedent(
        """
        import os, sys, time
        os.environ["HVDNB_STANDBY"] = "on"
        import hvdnb
        c = hvdnb.Cluster(n=2, timeout=120).start()
        while c.standby.ready() < 2:
            time.sleep(0.1)
        print(*c.pids(), *c.standby.pids(), flush=True)
        time.sleep(600)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) >= 7  # controller, mpiexec, 2 ranks, 2 standby, spare controller
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        assert alive(pids, within=20) == []
    finally:
        if p.poll() is None:
            p.kill()


def test_a_containers_limit_is_the_memory_available(tmp_path, monkeypatch):
    """Binder gives a notebook 2 GB while the host has far more: the cgroup's limit counts."""
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text(f"{2 * 2**30}\n")
    usage.write_text(f"{int(1.5 * 2**30)}\n")
    monkeypatch.setattr(host, "_CGROUP_FILES", ((str(limit), str(usage)),))
    assert host.available_memory() == min(psutil.virtual_memory().available, 2**29)
    limit.write_text("max\n")  # cgroup v2 without a limit: the host's figure
    got = host.available_memory()
    assert abs(got - psutil.virtual_memory().available) < 2**28


def test_the_memory_rule(monkeypatch):
    s = spec_mod.check(n=2)
    avail = host.available_memory()
    big = avail // (MEMORY_FACTOR * 2) + 2**30  # what 2 such standby need is not free
    monkeypatch.setenv("HVDNB_STANDBY", "auto")
    count, why = policy(s, [big])
    assert count == 0 and "HVDNB_STANDBY=on overrides" in why
    count, why = policy(s, [avail // (MEMORY_FACTOR * 2 * 4)])
    assert count == 2
    monkeypatch.setenv("HVDNB_STANDBY", "sometimes")
    count, why = policy(s, [1])
    assert count == 0 and "none of auto, on, 0 or a count" in why


def test_the_rule_across_hosts(monkeypatch, tmp_path):
    """A ``--hosts`` cluster, elastic or not, keeps one standby per rank on each host
    (hydra's order of slots, which an elastic cluster's slots follow too); a Slurm cluster
    keeps none, and says why."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1:2\nh2 slots=3\n")
    monkeypatch.setenv("HVDNB_STANDBY", "auto")
    s = spec_mod.check(n=4, hosts=str(hostfile), ip="203.0.113.1")
    assert on_hosts(s) and host_slots(s) == {"h1": 2, "h2": 2}
    count, why = policy(s, [2**40])  # another host's memory is not read: no memory rule
    assert count == 4 and "each host" in why, why
    assert host_slots(spec_mod.check(n=7, hosts=str(hostfile), ip="203.0.113.1")) == {
        "h1": 4,
        "h2": 3,
    }  # past its last slot, hydra goes round again
    for n in (4, 7):  # the hosts its slots take are those the standby waits on
        elastic = spec_mod.check(n=n, hosts=str(hostfile), ip="203.0.113.1", min_np=2)
        slots = Placement(spec_mod.hostfile_entries(str(hostfile))).first(n)
        assert on_hosts(elastic) and host_slots(elastic) == dict(Counter(slots)), slots
    count, why = policy(elastic, [2**40])
    assert count == 7 and "each host" in why, why
    slurm = spec_mod.check(n=4, launcher="slurm")
    count, why = policy(slurm, [1])
    assert count == 0 and "Slurm" in why and "--hosts FILE" in why, why
