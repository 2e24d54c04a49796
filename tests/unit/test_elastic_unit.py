"""The elastic pieces that need no cluster: the lines a person reads, the cell's wait when
a rank is lost, the commit's membership check, the sampler's bookkeeping, the options."""

from __future__ import annotations

import queue

import pytest

from hvdnb.notebook.cellout.cellwait import CellWait, Finish, Interrupt
from hvdnb.notebook.cluster.elastic import Event
from hvdnb.notebook.cluster.spec import ClusterError, check
from hvdnb.rank.elastic import HostCheck, HostsUpdatedInterrupt, ObjectState, run_fn


def test_event_lines_name_the_rank_its_generation_and_the_new_size():
    died = Event(0.0, 1, (1,), 2, "died")
    assert died.line(1) == (
        "hvdnb: rank 1 of generation 0 died; training goes on with 2 ranks (generation 1)"
    )
    left = Event(0.0, 3, (0, 2), 1, "left")
    assert "ranks 0,2 of generation 2 left (their code raised)" in left.line(1)
    assert "with 1 rank (generation 3)" in left.line(1)
    hung = Event(0.0, 2, (0,), 1, "hung")
    assert "stopped answering (no heartbeat for 3 s) and was stopped" in hung.line(1)
    below = Event(0.0, 1, (1,), 0, "died")
    assert "fewer than --min-np 2" in below.line(2) and "`%dist scale N`" in below.line(2)
    assert Event(0.0, 4, (), 3, "scaled").line(1) == (
        "hvdnb: the cluster now has 3 ranks (generation 4)"
    )
    assert Event(0.0, 5, (1, 2), 1, "scaled").line(1).endswith("now has 1 rank (generation 5)")


def test_a_lost_rank_interrupts_nobody_unless_below_min_np():
    w = CellWait([0, 1, 2], 0.0, None, 0, elastic=True)
    assert w.lost(1, 0.1, below=False) == []
    assert not w.interrupted and w.failed_at is None
    w.rank_done(0, 0.2)
    w.rank_done(2, 0.3)
    assert any(isinstance(a, Finish) for a in w.tick(0.4))
    w = CellWait([0, 1, 2], 0.0, None, 0, elastic=True)
    acts = w.lost(2, 0.1, below=True)
    assert acts == [Interrupt((0, 1), "dead-peer")]


class _Echo:
    """A broadcast of a world of one: rank 0's view is everyone's."""

    def __call__(self, obj):
        return obj


def test_the_membership_check_raises_once_per_change_and_says_whether_only_removals():
    check_ = HostCheck()
    q: queue.Queue = queue.Queue()
    assert check_.check(0.0, q, _Echo()) is None
    q.put((5.0, True))
    assert check_.check(0.0, q, _Echo()) == (5.0, True)
    assert check_.check(5.0, q, _Echo()) is None  # acted on: not again
    q.put((7.0, True))
    q.put((8.0, False))  # a rank was added: the survivors' states must sync
    assert check_.check(5.0, q, _Echo()) == (8.0, False)


@pytest.fixture
def group_of_one(tmp_path):
    """A real gloo default group of one rank (the broadcast path of ``HostCheck``)."""
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


class _Clock:
    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _commits(check_, q, n, change_at=None):
    """Run ``n`` commits; return the commits that started a broadcast and those that
    acted on a change (put in the queue before commit ``change_at``)."""
    started, acted, last = [], [], 0.0
    for k in range(n):
        if k == change_at:
            q.put((100.0 + k, True))
        got = check_.check(last, q, None)
        if check_.pending is not None and check_.skip <= 0:
            started.append(k)
        if got is not None:
            acted.append(k)
            last = got[0]
    return started, acted


def test_fast_commits_share_one_broadcast_per_period_and_still_act_on_a_change(group_of_one):
    q: queue.Queue = queue.Queue()
    check_ = HostCheck(clock=_Clock(1 / 64))  # a commit every 1/64 s: gap = 0.5 * 64
    started, acted = _commits(check_, q, 200, change_at=60)
    assert started == [0, 1, 33, 65, 97, 129, 161, 193]
    # heard before commit 60: carried by the broadcast of commit 65, acted on at 66, once
    assert acted == [66]


def test_slow_commits_broadcast_at_every_commit_and_act_at_the_next(group_of_one):
    q: queue.Queue = queue.Queue()
    check_ = HostCheck(clock=_Clock(1.0))  # longer than PERIOD: Horovod's cadence
    started, acted = _commits(check_, q, 10, change_at=4)
    assert started == list(range(10))
    assert acted == [5]


def test_a_reset_starts_the_new_groups_schedule_at_its_first_commit(group_of_one):
    q: queue.Queue = queue.Queue()
    check_ = HostCheck(clock=_Clock(1 / 64))
    _commits(check_, q, 5)
    assert check_.skip > 0  # between two broadcasts
    check_.drop()
    assert check_.pending is None and check_.skip == 0
    started, _ = _commits(check_, q, 3)
    assert started[:1] == [0]


def test_an_object_state_commits_restores_and_interrupts_at_a_commit():
    st = ObjectState(_Echo(), lambda: 0, epoch=0, batch=3)
    st.batch = 7
    st.restore()
    assert st.batch == 3
    st.batch = 9
    st.commit()
    st.batch = 11
    st.restore()
    assert st.batch == 9
    st.on_hosts_updated(10.0, True)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        st.commit()
    assert info.value.skip_sync is True


def test_outside_an_elastic_cluster_the_loop_reraises_the_training_codes_error():
    calls = []

    def train(state):
        calls.append(1)
        raise RuntimeError("Connection closed by peer")

    st = ObjectState(_Echo(), lambda: 0, step=0)
    with pytest.raises(RuntimeError, match="closed by peer"):
        run_fn(train, lambda: None, lambda: 0)(st)
    assert calls == [1]


def test_the_elastic_sampler_shares_out_what_the_epoch_left():
    torch = pytest.importorskip("torch")
    from hvdnb.torch.elastic import ElasticSampler, _snapshot

    s = ElasticSampler(list(range(10)), shuffle=False)
    assert list(s) == list(range(10)) and len(s) == 10
    s.record_batch(0, 4)
    s.load_state_dict(s.state_dict())  # as a restore does
    assert list(s) == list(range(4, 10))
    s.set_epoch(1)
    assert s.processed_num == 0 and len(s) == 10
    shuffled = ElasticSampler(list(range(10)), shuffle=True, seed=3)
    again = ElasticSampler(list(range(10)), shuffle=True, seed=3)
    assert list(shuffled) == list(again) and sorted(shuffled) == list(range(10))
    # a commit's copy: tensors cloned into the last commit's, nothing shared with the model
    t = torch.ones(3)
    snap = _snapshot({"w": t, "n": 2, "v": [t]})
    t.add_(1)
    assert snap["w"].tolist() == [1.0, 1.0, 1.0] and snap["v"][0].tolist() == [1.0] * 3
    again_snap = _snapshot({"w": t}, snap)
    assert again_snap["w"] is snap["w"] and snap["w"].tolist() == [2.0] * 3


def test_elastic_options_are_checked_before_anything_starts():
    with pytest.raises(ClusterError, match="--min-np <= -n <= --max-np"):
        check(n=2, min_np=3, oversubscribe=True)
    with pytest.raises(ClusterError, match="add `--min-np M`"):
        check(n=2, max_np=3, oversubscribe=True)
    with pytest.raises(ClusterError, match="no MPI job"):
        check(n=2, min_np=1, backend="mpi", oversubscribe=True)
    with pytest.raises(ClusterError, match="across hosts over ssh with `--hosts FILE`"):
        check(n=2, min_np=1, launcher="slurm")
    spec = check(n=2, min_np=1, oversubscribe=True)
    assert spec.elastic and spec.max_np == 2


def test_an_elastic_cluster_across_hosts_takes_a_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1:2\nh2 slots=2\n")
    spec = check(hosts=str(hostfile), min_np=2, ip="10.0.0.1")
    assert spec.elastic and spec.multi_host and (spec.n, spec.min_np, spec.max_np) == (4, 2, 4)
    with pytest.raises(ClusterError, match="engine sets"):
        check(engine_sets=[{"n": 1}, {"n": 1}], min_np=1, ip="10.0.0.1")


def test_hvdnb_run_gives_a_script_what_follows_its_path_and_a_notebook_its_options():
    from hvdnb.notebook.headless.cli import _split_script

    assert _split_script(["run", "nb.ipynb", "-n", "2", "-o", "out.ipynb"]) == (
        ["run", "nb.ipynb", "-n", "2", "-o", "out.ipynb"],
        [],
    )
    assert _split_script(
        ["run", "-n", "2", "--min-np", "1", "train.py", "--epochs", "3", "-n", "5"]
    ) == (
        ["run", "-n", "2", "--min-np", "1", "train.py"],
        ["--epochs", "3", "-n", "5"],
    )
    assert _split_script(["demo", "-n", "2"]) == (["demo", "-n", "2"], [])
