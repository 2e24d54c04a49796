"""Start/stop/restart and leaving nothing behind (real processes, checked with psutil)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from IPython.core.error import UsageError

import hvdnb
from tests.conftest import alive

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


def test_cell_before_start_says_what_to_do(shell):
    c = hvdnb.current()
    if c is not None:
        c.stop()
    with pytest.raises(UsageError, match="%dist start -n 2"):
        shell.run_cell_magic("distributed", "", "print(1)")


def test_stop_and_restart_leave_no_process_behind(shell, capsys):
    shell.run_line_magic("dist", "start -n 2 --timeout 120")
    c = hvdnb.current()
    first = c.pids()
    assert len(first) >= 4  # controller, mpiexec, two engines (and helpers)
    shell.run_line_magic("dist", "restart")
    assert alive(first) == []
    assert c.running and set(c.pids()).isdisjoint(first)
    shell.run_cell_magic(
        "distributed", "-q -o r", "import torch.distributed as dist\ndist.get_world_size()"
    )
    assert shell.user_ns["r"] == {0: 2, 1: 2}
    second = c.pids()
    shell.run_line_magic("dist", "stop")
    assert alive(second, within=0) == []  # every process gone when the stop returns
    assert "cluster stopped" in capsys.readouterr().out


def test_engines_that_fail_to_start_give_a_clear_error_and_leave_nothing(tmp_path):
    segments = _mpich_segments()
    c = hvdnb.Cluster(n=2, backend="nccl", timeout=60)  # no GPU here: nccl cannot start
    with pytest.raises(hvdnb.ClusterError, match="could not initialise torch.distributed"):
        c.start()
    assert not c.running
    assert c.pids() == []
    # the ranks exit without MPI_Finalize: they unlink MPICH's segment themselves
    assert _mpich_segments() - segments == set()
    assert _files_of(c.cluster_id) == []


def test_forced_restart_leaves_no_file_of_the_old_cluster():
    c = hvdnb.Cluster(n=2, timeout=120).start()
    try:
        old = c.cluster_id
        assert _files_of(old)  # connection files, logs
        c.restart(force=True)  # what a rank ignoring interrupts gets: SIGKILL, no clean exit
        assert c.cluster_id != old and _files_of(c.cluster_id)
        assert _files_of(old) == []
    finally:
        c.stop()
    assert _files_of(c.cluster_id) == []


def _files_of(cluster_id: str) -> list[str]:
    import glob
    import os

    from IPython.paths import get_ipython_dir

    profile = os.path.join(get_ipython_dir(), "profile_default")
    return [
        p
        for sub in ("security", "log")
        for p in glob.glob(os.path.join(profile, sub, f"*{cluster_id}*"))
    ]


def test_interpreter_exit_leaves_no_orphans(tmp_path):
    script = textwrap.dedent(
        """
        import hvdnb
        c = hvdnb.Cluster(n=2, timeout=120).start()
        print(*c.pids(), flush=True)
        # exit without stopping: the atexit hook must clean up
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.strip().splitlines()[-1].split()]
    assert len(pids) >= 4
    assert alive(pids) == []


def _mpich_segments() -> set[str]:
    import glob

    return set(glob.glob("/dev/shm/mpich_shm_*"))


def _profile_files(c) -> set[str]:
    import glob
    import os

    return {
        p
        for sub in ("security", "log")
        for p in glob.glob(os.path.join(c._ipp.profile_dir, sub, f"*{c.cluster_id}*"))
    }


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/shm is Linux's")
@pytest.mark.alone  # /dev/shm is the host's: another test's MPI ranks add segments to it
def test_stopped_cluster_leaves_no_shared_memory_segment_or_profile_file():
    # engines never reach MPI_Finalize, which is where MPICH unlinks its segment: before
    # the fix each cluster left a 2 MB file in /dev/shm, and a later start whose segment
    # name collided with a leftover failed in MPI_Init
    before = _mpich_segments()
    c = hvdnb.Cluster(n=2, timeout=120).start()
    ipp = c._ipp
    files = _profile_files(c)
    assert files  # connection files, logs, the hub's engine-state file
    try:
        code = "import torch, torch.distributed as d\nt = torch.ones(1 << 16)\nd.all_reduce(t)\nfloat(t[0])"
        r = hvdnb.run_cell(c, code, stream=False)
        assert r.values == {0: 2.0, 1: 2.0}
        assert _mpich_segments() - before == set()  # unlinked once every rank mapped it
    finally:
        c.stop()
    assert _mpich_segments() - before == set()
    c._ipp = ipp  # (stop drops it; _profile_files only reads its profile_dir)
    assert _profile_files(c) == set()
    c._ipp = None


#: what an engine's bootstrap has left in /dev/shm when it starts importing torch (the slow
#: part): MPICH's segments it maps whose names still exist there
_SHM_PROBE = textwrap.dedent(
    """\
    import builtins, json, os, sys
    from hvdnb.rank import engine
    assert "torch" not in sys.modules
    real, named = builtins.__import__, []
    def probe(name, *args, **kwargs):
        if name == "torch" and not named:
            with open("/proc/self/maps") as maps:
                paths = {l.split()[-1] for l in maps if "/dev/shm/mpich_shm_" in l}
            named.append(sorted(p for p in paths if os.path.exists(p)))
        return real(name, *args, **kwargs)
    builtins.__import__ = probe
    engine.bootstrap(None)
    builtins.__import__ = real
    with open(os.path.join(sys.argv[1], os.environ["PMI_RANK"] + ".json"), "w") as f:
        json.dump(named[0], f)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/shm is Linux's")
def test_mpich_segment_is_unlinked_before_the_slow_imports(tmp_path):
    # a rank killed between MPI_Init and the unlink leaves the segment for good: a cluster
    # stopped while it starts (the runner's backstop after a timed-out cell) left one per
    # stop when the unlink came after import torch and the process group (~1 s)
    bin_ = Path(sys.executable).parent
    res = subprocess.run(
        [str(bin_ / "mpiexec"), "-n", "2", sys.executable, "-c", _SHM_PROBE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    # a file per rank: the two ranks' stdout lines can arrive interleaved ("[][]")
    named = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert named == [[], []], res.stdout


def test_mpi_init_failure_is_retried_once_then_reported(caplog):
    c = hvdnb.Cluster(n=2, timeout=60, engine_env={"UCX_TLS": "no-such-transport"})
    with caplog.at_level("WARNING", logger="hvdnb"):
        with pytest.raises(hvdnb.ClusterError, match="internal_Init_thread"):
            c.start()
    retries = [r for r in caplog.records if "starting again" in r.getMessage()]
    assert len(retries) == 1
    assert not c.running and c.pids() == []
