"""Bad input gets one clear message (no internal traceback) and leaves nothing running."""

from __future__ import annotations

import stat
import sys

import pytest
from IPython.core.error import UsageError

import hvdnb

pytestmark = [pytest.mark.timeout(240)]

# (line for %dist, regex the message must match); no cluster is started by any of these
BEFORE_START = [
    ("start -n 0", "-n must be at least 1"),
    ("start -n -1", "-n must be at least 1"),
    ("start -n 999", "add `--oversubscribe`"),
    ("start -n two", "invalid int value: 'two'"),
    ("start -n 1.5", "invalid int value: '1.5'"),
    ("launch", "unknown %dist action 'launch'"),
    ("start --frobnicate", "unrecognized arguments: --frobnicate"),
    ("start --backend tcp", "unknown backend 'tcp'"),
    ("start --timeout 0", "timeout must be a positive number"),
    ("start --timeout -3", "timeout must be a positive number"),
    ("start --timeout soon", "invalid float value: 'soon'"),
    ("start --launcher=", "launcher must be a name"),
    ("restart", "no cluster to restart"),
]


@pytest.fixture
def no_cluster():
    c = hvdnb.current()
    if c is not None:
        c.stop()
    yield
    assert hvdnb.current() is None, "a failed start left a cluster registered"


@pytest.mark.parametrize("line, message", BEFORE_START)
def test_dist_line_errors(shell, no_cluster, line, message):
    with pytest.raises(UsageError, match=message):
        shell.run_line_magic("dist", line)


@pytest.mark.parametrize(
    "line, message",
    [
        ("", "no cluster is running: run `%dist start -n 2` first"),
        ("--bogus", "unrecognized arguments: --bogus"),
        ("--timeout abc", "invalid float value: 'abc'"),
        ("--targets", "expected one argument"),
    ],
)
def test_distributed_before_start(shell, no_cluster, line, message):
    with pytest.raises(UsageError, match=message):
        shell.run_cell_magic("distributed", line, "print(1)")


@pytest.mark.parametrize("action", ["status", "stop"])
def test_status_and_stop_without_a_cluster_just_say_so(shell, no_cluster, capsys, action):
    shell.run_line_magic("dist", action)
    assert "no cluster is running" in capsys.readouterr().out


@pytest.mark.parametrize(
    "var, value, message",
    [
        ("HVDNB_RANKS", "abc", "HVDNB_RANKS='abc' is not a valid int"),
        ("HVDNB_START_TIMEOUT", "soon", "HVDNB_START_TIMEOUT='soon' is not a valid float"),
        ("HVDNB_IP", "203.0.113.7", "HVDNB_IP must be an address of this host"),
    ],
)
def test_bad_environment_overrides(shell, no_cluster, monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(UsageError, match=message):
        shell.run_line_magic("dist", "start -n 2")


def test_mpiexec_missing(shell, no_cluster, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UsageError, match="mpiexec not found: .*pip install mpich"):
        shell.run_line_magic("dist", "start -n 2")


@pytest.mark.mpi
@pytest.mark.alone  # /dev/shm is the host's: the other lane's MPI ranks add segments to it
def test_the_wrong_mpi_is_named(no_cluster, tmp_path):
    """An mpiexec of another MPI (here a stand-in that starts the ranks the way Open MPI's
    does) leaves every rank in a world of 1: refused, named, nothing left running."""
    fake = tmp_path / "mpiexec"
    fake.write_text(
        "#!/bin/bash\nn=$2; shift 2; pids=()\n"
        'for i in $(seq 0 $((n-1))); do OMPI_COMM_WORLD_SIZE=$n OMPI_COMM_WORLD_RANK=$i "$@" & pids+=($!); done\n'
        'rc=0; for p in "${pids[@]}"; do wait $p || rc=$?; done; exit $rc\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    import glob

    segments = set(glob.glob("/dev/shm/mpich_shm_*"))
    c = hvdnb.Cluster(n=2, timeout=60, launcher_config={"mpi_cmd": [str(fake)]})
    with pytest.raises(hvdnb.ClusterError, match="belongs to another MPI"):
        c.start()
    assert not c.running and c.pids() == []
    # each singleton rank made its own MPICH segment: gone with the rank
    assert set(glob.glob("/dev/shm/mpich_shm_*")) - segments == set()


@pytest.mark.mpi
class TestWithACluster:
    @pytest.mark.parametrize(
        "line, message",
        [
            ("--targets 5", r"--targets names rank\(s\) 5 but the cluster has ranks 0,1"),
            ("--targets x", "--targets 'x' is not understood"),
            ("--targets 1:2:3:4", "--targets '1:2:3:4' is not understood"),
            ("-o 1x", "-o needs a variable name"),
            ("--timeout 0", "--timeout must be a positive number"),
        ],
    )
    def test_cell_options(self, dist2, shell, line, message):
        with pytest.raises(UsageError, match=message):
            shell.run_cell_magic("distributed", line, "print(1)")
        assert dist2.running

    @pytest.mark.parametrize("line", ["start -n 2", "start --oversubscribe -n 3"])
    def test_second_start(self, dist2, shell, line):
        with pytest.raises(UsageError, match="already running: `%dist stop` first"):
            shell.run_line_magic("dist", line)
        assert hvdnb.current() is dist2 and dist2.running

    def test_syntax_error_is_shown_once_with_its_line(self, dist2, shell):
        with pytest.raises(hvdnb.DistributedCellError) as info:
            shell.run_cell_magic("distributed", "", "x = (1,\nprint(x)")
        text = "\n".join(info.value._render_traceback_())
        assert "ranks 0,1 raised SyntaxError" in text and text.count("SyntaxError") == 2
        shell.run_cell_magic("distributed", "-q -o fine", "1 + 1")
        assert shell.user_ns["fine"] == {0: 2, 1: 2}
