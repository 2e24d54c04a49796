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


@pytest.mark.parametrize("action", ["status", "stop", "status  # what is running?"])
def test_status_and_stop_without_a_cluster_just_say_so(shell, no_cluster, capsys, action):
    shell.run_line_magic("dist", action)  # a trailing comment is not an argument
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

    def test_a_trailing_comment_is_no_argument(self, dist2, shell):
        shell.run_cell_magic("distributed", "-q -o two  # both ranks", "1 + 1")
        assert shell.user_ns["two"] == {0: 2, 1: 2}
        shell.run_line_magic("dist", "knobs  # none yet")  # no values taken from the comment

    def test_syntax_error_is_shown_once_with_its_line(self, dist2, shell):
        with pytest.raises(hvdnb.DistributedCellError) as info:
            shell.run_cell_magic("distributed", "", "x = (1,\nprint(x)")
        text = "\n".join(info.value._render_traceback_())
        assert "ranks 0,1 raised SyntaxError" in text and text.count("SyntaxError") == 2
        shell.run_cell_magic("distributed", "-q -o fine", "1 + 1")
        assert shell.user_ns["fine"] == {0: 2, 1: 2}

    @pytest.mark.parametrize(
        "call, words",
        [
            ("hvdnb.log(s, 'low')", "TypeError: hvdnb.log: loss must be a number, not str"),
            ("hvdnb.log(s, torch.ones(3))", "ValueError: hvdnb.log: loss is Tensor of shape"),
            ("hvdnb.log(s, {'a': 1})", "TypeError: hvdnb.log: loss must be a number, not dict"),
            ("hvdnb.log(s, 0.5, acc='high')", "TypeError: hvdnb.log: acc must be a number"),
            ("hvdnb.log('s', 0.5)", "TypeError: hvdnb.log: step must be a whole number"),
            ("hvdnb.knobs(batch_size='big')", "TypeError: hvdnb.knobs: knob batch_size='big'"),
        ],
    )
    def test_a_bad_value_on_the_ranks_is_refused_at_the_users_line(self, dist2, shell, call, words):
        """The traceback ends at the cell's line (no frame of hvdnb's), the message says what
        was wrong and what is taken, and the points logged before it reach the notebook."""
        code = (
            "import hvdnb, torch\n"
            "for s in range(5):\n"
            "    hvdnb.log(s, 1.0 / (s + 1), total_steps=None)\n"  # None: length unknown
            f"s = 5\n{call}\n"
        )
        with pytest.raises(hvdnb.DistributedCellError) as info:
            shell.run_cell_magic("distributed", "", code)
        text = "\n".join(info.value._render_traceback_())
        assert words in text, text
        assert "hvdnb/" not in text and 'File "<cell' in text, text  # the user's frame only
        assert call in text, text  # ... and its line
        rows = hvdnb.metrics("loss")
        # this cell's run: the newest (the rows are in rank order, and an earlier, larger
        # cluster's rank 2 may come last)
        run = max(r.run for r in rows)
        for rank in (0, 1):  # the loop's points before the refusal were not lost
            got = [r.value for r in rows if r.rank == rank and r.run == run]
            assert got == [1.0 / (s + 1) for s in range(5)], got
        # no NaN was made of a bad value (this run's rows only: the store is the process's,
        # and a watcher test in the same worker logs NaN on purpose)
        assert not any(r.value != r.value for r in rows if r.run == run)

    def test_total_steps_none_in_the_first_loop_trains_and_the_step_moves(self, dist2, shell):
        """A loop of unknown length (``total_steps=None``) on its first log call raised
        TypeError deep in the drain and froze the panel at "step 1"."""
        shell.run_cell_magic(
            "distributed",
            "-q",
            "import hvdnb\nfor s in range(300):\n    hvdnb.log(s, 0.1, total_steps=None)\n",
        )
        store = hvdnb.metrics.get_store()
        step, total = store.progress()
        assert step >= 299 and not total, (step, total)  # not stuck at "step 1"


@pytest.mark.mpi
def test_a_loop_logging_as_fast_as_it_can_loses_no_point(dist2, shell):
    """Backpressure, not loss: 100,000 steps of ``hvdnb.log`` as fast as a rank calls it
    (each rank's ring holds 65,536 rows; before, 42-52 % of such points were lost between
    two flushes), at 2 ranks, twice. Every point reaches ``hvdnb.metrics()``, in order."""
    steps = 100_000
    code = f"import hvdnb\nfor s in range({steps}):\n    hvdnb.log(s, s * 0.5, samples=8)\n"
    for _ in range(2):
        shell.run_cell_magic("distributed", "-q", code)
        rows = hvdnb.metrics("loss")
        assert rows.lost_points == 0 and rows.lost_messages == 0
        run = max(r.run for r in rows)  # this cell's: the newest
        for rank in (0, 1):
            got = [r.step for r in rows if r.rank == rank and r.run == run]
            assert got == list(range(steps)), (rank, len(got))
