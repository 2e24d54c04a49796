"""An elastic cluster loses ranks and keeps training: real engines, real gloo groups.

Each fault is made by the rank itself at a chosen step (it kills or stops its own
process, raises, or dies inside ``commit``), so where it lands is never luck. After each
fault the cluster is brought back with ``scale`` (a rejoin), so the next test starts at
full size again. What is checked: the cell ends normally, with one line naming the lost
ranks and the new size; the survivors finish every step at the new size with equal
parameters; the next cell runs on them.
"""

from __future__ import annotations

import pytest

import hvdnb
from hvdnb.notebook.cellout.cells import DistributedCellError, run_cell
from tests.conftest import alive

# alone (make test's lanes): the 3-rank cases oversubscribe the box already, and with the
# other lane's load on top a killed rank's survivors missed heartbeats ("stopped answering"
# where the test expects "died"): the elastic timeout is tuned for one run on the box
pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.alone]

STEPS = 24

#: a Horovod-style elastic loop; ``{fault}`` runs at the top of every step, with ``slot``
#: (the rank's engine, fixed for its life) and ``state.step`` in scope
TRAIN = """
import os, signal, time, torch, hvdnb.torch as hvd
hvd.init()
slot = int(os.environ["HVDNB_SLOT"])
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
)
state = hvd.elastic.TorchState(model, opt, step=0)
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])
{setup}
@hvd.elastic.run
def train(state):
    while state.step < {steps}:
        {fault}
        x = torch.randn(8, 4)
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        state.step += 1
        if state.step % 4 == 0:
            state.commit()
        time.sleep(0.01)
train(state)
out = (hvd.rank(), hvd.size(), state.step, resets,
       [round(float(p.detach().sum()), 5) for p in model.parameters()])
out
"""


def _train(cluster, fault: str = "pass", setup: str = ""):
    """Train on ``cluster``; ``{r0}``, ``{r1}``, ... in ``fault`` and ``setup`` are the slots
    (engines) of ranks 0, 1, ... now: a fault is tied to an engine, not to a rank number,
    which the survivors' renumbering would hand to another rank mid-loop."""
    slots = {f"r{r}": cluster.membership.slot_of(r) for r in range(cluster.n)}
    fault, setup = fault.format(**slots), setup.format(**slots)
    code = TRAIN.format(fault=fault, setup=setup, steps=STEPS)
    return run_cell(cluster, code, quiet=True)


def _check_survivors(result, size: int) -> None:
    outs = list(result.values.values())
    assert len(outs) == size, result.values
    assert sorted(o[0] for o in outs) == list(range(size))  # renumbered 0..size-1
    assert {o[1] for o in outs} == {size}
    assert {o[2] for o in outs} == {STEPS}  # every step done at the new size
    assert all(o[3] and o[3][-1] == size for o in outs)  # the reset callbacks ran
    assert len({tuple(o[4]) for o in outs}) == 1  # the same parameters on every rank


def _back_to(cluster, n: int) -> None:
    guard = cluster._watchdog
    ev = cluster.scale(n)
    assert cluster.n == n and ev.size == n
    # the watchdog a scale replaced has ended and is reaped (no zombie of the kernel's)
    assert guard is not None and guard.returncode is not None
    assert cluster._watchdog is not guard
    r = run_cell(
        cluster, "import torch.distributed as d; (d.get_rank(), d.get_world_size())", quiet=True
    )
    assert sorted(r.values.values()) == [(i, n) for i in range(n)]


def _elastic(n: int):
    c = hvdnb.Cluster(n=n, min_np=1, oversubscribe=True)
    c.start()
    yield c
    pids = c.pids()
    c.stop()
    assert not alive(pids)  # nothing left behind


@pytest.fixture(scope="module")
def three():
    yield from _elastic(3)


@pytest.fixture(scope="module")
def two():
    yield from _elastic(2)


def test_a_rank_killed_by_a_signal_costs_a_step_at_3(three, capsys):
    dead = three.membership.slot_of(1)
    r = _train(
        three,
        # its points sent before it dies (a flush now, and time for the socket to deliver
        # them), so that the panel has something of it to leave out
        "hvdnb.log(state.step, loss=1.0); slot == {r1} and state.step == 9 and "
        "(get_recorder().flush() or time.sleep(1.5) or os.kill(os.getpid(), signal.SIGKILL))",
        setup="import hvdnb\nfrom hvdnb.rank.metrics.recorder import get_recorder",
    )
    err = capsys.readouterr().err
    assert "rank 1 of generation 0 died; training goes on with 2 ranks (generation 1)" in err
    _check_survivors(r, 2)
    assert list(r.lost) == [1] and r.ok
    _panel_shows_the_survivors_only(three, dead)
    _back_to(three, 3)


def _panel_shows_the_survivors_only(cluster, dead: int) -> None:
    """The panel's "now" (header, step-time bars, memory, allreduce lines, the cell's line)
    leaves out the engine ``dead``, which the cell trained on before it died (the loss
    chart and ``hvdnb.metrics()`` keep its points)."""
    import time

    from hvdnb.notebook.metrics.store import get_store
    from hvdnb.notebook.panel.charts import allreduce_chart, breakdown_chart
    from hvdnb.notebook.panel.liveline import LiveLine
    from hvdnb.notebook.panel.tables import header_html

    store = get_store()
    live = list(cluster.membership.members)
    assert dead in store.ranks() and store.count("loss", dead) > 0  # it logged, then died
    assert store.live_ranks() == sorted(live)
    assert set(store.breakdown()) == set(live) and set(store.memory()) == set(live)
    assert f"rank {dead} exposed" not in [name for name, *_ in allreduce_chart(store).lines]
    assert f"rank {dead}" not in breakdown_chart(store).labels()
    line = LiveLine(store).text(store.current_run() or {"id": 0}, final=True)
    assert f"r{dead} " not in line and all(f"r{s} " in line for s in live), line
    deadline = time.monotonic() + 30  # the survivors' idle arrives after their last reply
    while "training" in header_html(store)[0] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "idle" in header_html(store)[0]


def test_a_raised_error_leaves_with_its_traceback_shown_once_at_3(three, capsys):
    r = _train(three, "if slot == {r2} and state.step == 6: raise ValueError('bad shard')")
    err = capsys.readouterr().err
    assert err.count("ValueError: bad shard") == 1
    assert "rank 2 raised ValueError and left the cluster" in err
    assert "rank 2 of generation" in err and "left (its code raised)" in err
    assert "elastic.py" not in err  # the loop's own frames are not the user's
    _check_survivors(r, 2)
    _back_to(three, 3)


def test_a_rank_that_stops_answering_is_caught_and_retired_at_3(three, capsys):
    r = _train(three, "if slot == {r0} and state.step == 5: os.kill(os.getpid(), signal.SIGSTOP)")
    err = capsys.readouterr().err
    assert "rank 0 of generation" in err and "stopped answering" in err
    _check_survivors(r, 2)  # rank 0's death is survivable: the store is not on a rank
    _back_to(three, 3)


def test_a_death_inside_commit_at_3(three, capsys):
    setup = (
        "if slot == {r1}:\n"
        "    _save = state.save\n"
        "    def save():\n"
        "        if state.step == 12: os.kill(os.getpid(), signal.SIGKILL)\n"
        "        _save()\n"
        "    state.save = save\n"
    )
    r = _train(three, setup=setup)
    assert "died; training goes on with 2 ranks" in capsys.readouterr().err
    _check_survivors(r, 2)
    _back_to(three, 3)


def test_two_deaths_in_one_step_at_3(three, capsys):
    r = _train(three, "if slot != {r0} and state.step == 7: os.kill(os.getpid(), signal.SIGKILL)")
    err = capsys.readouterr().err
    assert "died; training goes on with 1 rank" in err
    _check_survivors(r, 1)
    assert three.n == 1  # the last test on this cluster: the rejoins above brought it back


def test_kill_and_raise_at_2_then_rejoin(two, capsys):
    r = _train(two, "if slot == {r1} and state.step == 9: os.kill(os.getpid(), signal.SIGKILL)")
    assert "goes on with 1 rank (generation 1)" in capsys.readouterr().err
    _check_survivors(r, 1)
    _back_to(two, 2)
    # rank 0 this time: the first rank's death is survivable too
    r = _train(two, "if slot == {r0} and state.step == 5: raise RuntimeError('exit')")
    assert "left (its code raised)" in capsys.readouterr().err
    _check_survivors(r, 1)
    _back_to(two, 2)


def test_outside_a_loop_the_cell_fails_and_the_next_runs_on_the_survivors(two, capsys):
    code = (
        "import os, signal, time, torch, torch.distributed as dist\n"
        "if os.environ['HVDNB_SLOT'] == os.environ['VICTIM']: os.kill(os.getpid(), 9)\n"
        "time.sleep(0.5)\n"
        "dist.all_reduce(torch.ones(1))\n"
    )
    run_cell(two, f"import os; os.environ['VICTIM'] = '{two.membership.slot_of(1)}'", quiet=True)
    with pytest.raises(DistributedCellError) as info:
        run_cell(two, code, quiet=True)
    assert "rank 1 of generation" in str(info.value) and "died" in str(info.value)
    capsys.readouterr()
    r = run_cell(two, "import torch.distributed as d; d.get_world_size()", quiet=True)
    assert r.values == {0: 1}  # the next test restarts the cluster


def test_a_death_while_the_survivors_finish_outside_a_loop_fails_the_cell(two, capsys):
    """The survivors finish the cell (no collective after the death), but no elastic loop
    re-formed them: the cell fails naming the death (it ended normally, saying "training
    goes on", although nothing trained), and the next cell runs on the survivors."""
    _back_to(two, 2)
    victim = two.membership.slot_of(1)
    code = (
        "import os, time\n"
        f"if os.environ['HVDNB_SLOT'] == '{victim}': os.kill(os.getpid(), 9)\n"
        "time.sleep(5)\n"  # the death is seen (within 0.1 s idle, more under load) first
        "'finished'\n"
    )
    with pytest.raises(DistributedCellError) as info:
        run_cell(two, code, quiet=True)
    text = str(info.value)
    assert "rank 1 died while this cell ran outside an elastic loop" in text, text
    assert "The next cell runs on the 1 survivors" in text, text
    capsys.readouterr()
    r = run_cell(two, "import torch.distributed as d; d.get_world_size()", quiet=True)
    assert r.values == {0: 1}  # the next test restarts the cluster


def test_below_min_np_the_cell_fails_naming_it(two, capsys):
    two.restart(min_np=2)
    assert two.membership.min_np == 2
    with pytest.raises(DistributedCellError) as info:
        _train(two, "if slot == {r1} and state.step == 5: os.kill(os.getpid(), signal.SIGKILL)")
    text = str(info.value)
    assert "fewer than --min-np 2" in text and "rank 1" in text
    with pytest.raises(hvdnb.ClusterError, match="fewer than its --min-np 2"):
        run_cell(two, "1", quiet=True)
    _back_to(two, 2)


def test_scale_refuses_outside_the_bounds(two):
    with pytest.raises(hvdnb.ClusterError, match="takes 2 to 2 ranks"):
        two.scale(3)


#: a loop that trains until the cluster has ``{target}`` ranks and then ``{more}`` steps
#: more: it ends only after the scale happened, whenever that is (never timing luck)
GROW_TRAIN = """
import os, pathlib, torch, hvdnb.torch as hvd
hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
)
state = hvd.elastic.TorchState(model, opt, step=0, since=0)
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])

@hvd.elastic.run
def train(state):
    while state.since < {more}:
        if hvd.rank() == 0 and state.step == 4:
            pathlib.Path({flag!r}).touch()  # the test asks for the scale now
        x = torch.randn(8, 4)
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        state.step += 1
        state.since = state.since + 1 if hvd.size() == {target} else 0
        state.commit()
train(state)
(hvd.rank(), hvd.size(), resets, [round(float(p.detach().sum()), 5) for p in model.parameters()])
"""


def _scale_mid_loop(cluster, target: int, flag) -> object:
    """Run GROW_TRAIN; once rank 0 reaches step 4, ask for ``target`` ranks from another
    thread through the panel's controls, as its ``ranks=N`` does from its subshell.
    Returns the cell's result and the knob line: as asked, and after the cell."""
    import html
    import threading
    import time

    from hvdnb.notebook.metrics.store import get_store
    from hvdnb.notebook.panel.controls import Controls

    controls = Controls(get_store(), None, threading.RLock(), lambda: None)
    said: list[str] = []

    def ask() -> None:
        deadline = time.monotonic() + 120
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        controls.knob_text.value = f"ranks={target}"  # as typed in the panel's box
        said.append(html.unescape(controls.status_html()))

    t = threading.Thread(target=ask)
    t.start()
    try:
        code = GROW_TRAIN.format(target=target, more=6, flag=str(flag))
        r = run_cell(cluster, code, quiet=True)
    finally:
        t.join()
    return r, said + [html.unescape(controls.status_html())]


@pytest.fixture(scope="module")
def growing():
    c = hvdnb.Cluster(n=2, min_np=1, max_np=3, oversubscribe=True)
    c.start()
    yield c
    pids = c.pids()
    c.stop()
    assert not alive(pids)


def test_a_scale_asked_for_mid_loop_happens_at_a_commit(growing, tmp_path, capsys):
    # up: a third rank starts, joins at a commit and runs the cell from its top
    r, said = _scale_mid_loop(growing, 3, tmp_path / "up")
    err = capsys.readouterr().err
    # (either wording: that every rank is inside the loop may reach the notebook after the
    # flag does)
    assert "scaling to 3 ranks" in said[0], said
    assert r.ok and growing.n == 3
    # the panel's knob line says it happened, once it has
    assert "scaled to 3 ranks (generation" in said[1] and "scaling" not in said[1], said
    outs = sorted(r.values.values())
    assert [o[:2] for o in outs] == [(0, 3), (1, 3), (2, 3)], r.values
    assert outs[0][2] == [3] and outs[1][2] == [3]  # the first two re-formed once, at 3
    assert len({tuple(o[3]) for o in outs}) == 1  # the newcomer got rank 0's parameters
    assert "the cluster now has 3 ranks" in err
    # down: the highest rank leaves at a commit, its engine is stopped after it left
    leaving = growing.slot_processes()[growing.membership.slot_of(2)]
    r, said = _scale_mid_loop(growing, 2, tmp_path / "down")
    err = capsys.readouterr().err
    assert r.ok and growing.n == 2, r.errors
    assert "scaled to 2 ranks (generation" in said[1], said
    outs = sorted(r.values.values())
    assert [o[:2] for o in outs] == [(0, 2), (1, 2)]
    assert len({tuple(o[3]) for o in outs}) == 1
    assert list(r.lost) == [2] and r.lost[2]["ename"] == "RankRemoved"
    assert "the cluster now has 2 ranks" in err and "Traceback" not in err
    leaving.wait(10)  # retired: killed once its cell ended
    # and the next cell runs at the new size
    r = run_cell(growing, "import torch.distributed as d; d.get_world_size()", quiet=True)
    assert r.values == {0: 2, 1: 2}


def test_a_newcomers_ddp_timings_are_drawn_at_the_loops_steps(growing, tmp_path):
    # a rank that joins a running loop times its first DDP allreduce before its first
    # hvdnb.log: that point was drawn at step 0, far left of the loop's steps
    from hvdnb.notebook.metrics.store import get_store

    code = (
        GROW_TRAIN.replace("import os,", "import hvdnb, os,")
        .replace(
            "opt = hvd.DistributedOptimizer(\n    torch.optim.SGD(model.parameters(), lr=0.01), "
            "named_parameters=model.named_parameters()\n)",
            "opt = torch.optim.SGD(model.parameters(), lr=0.01)",
        )
        .replace(
            "    while state.since",
            "    ddp = torch.nn.parallel.DistributedDataParallel(model)\n    while state.since",
        )
        .replace("loss = model(x)", "loss = ddp(x)")
        .replace(
            "        state.step += 1\n", "        state.step += 1\n        hvdnb.log(state.step)\n"
        )
    )
    assert (
        "DistributedDataParallel" in code and "hvdnb.log" in code and "hvd.Distributed" not in code
    )
    flag = tmp_path / "up"
    import threading
    import time

    def ask() -> None:
        deadline = time.monotonic() + 120
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        growing.request_scale(3)

    t = threading.Thread(target=ask)
    t.start()
    try:
        r = run_cell(growing, code.format(target=3, more=6, flag=str(flag)), quiet=True)
    finally:
        t.join()
    assert r.ok and growing.n == 3, r.errors
    new = growing.membership.slot_of(2)
    steps = get_store().per_step("comm/", new, last_steps=1000, suffix="/exposed")
    assert steps and min(steps) > 4, sorted(steps)[:5]  # it joined after step 4
    growing.scale(2)


def test_a_rank_that_joins_and_fails_before_the_loop_leaves_and_the_rest_go_on(
    growing, tmp_path, capsys
):
    run_cell(growing, "EARLIER = 1", quiet=True)  # an earlier cell's variable
    flag = tmp_path / "up"
    # the newcomer fails at EARLIER; the others re-form twice (at 3 with it, then at 2
    # without it: their reset callbacks see both) and train 6 more steps
    code = (
        GROW_TRAIN.replace("hvd.init()\n", "hvd.init()\nEARLIER\n", 1)
        .replace("while state.since < {more}:", "while len(resets) < 2 or state.since < {more}:")
        .replace("state.since + 1 if hvd.size() == {target} else 0", "state.since + 1")
    )
    said: list[str] = []

    def ask() -> None:
        import time

        deadline = time.monotonic() + 120
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        said.append(growing.request_scale(3))

    import threading

    t = threading.Thread(target=ask)
    t.start()
    try:
        r = run_cell(growing, code.format(more=6, flag=str(flag)), quiet=True)
    finally:
        t.join()
    err = capsys.readouterr().err
    assert r.ok and growing.n == 2, r.errors
    outs = sorted(r.values.values())
    assert [o[:2] for o in outs] == [(0, 2), (1, 2)] and outs[0][2] == [3, 2], r.values
    assert err.count("NameError: name 'EARLIER' is not defined") == 1
    assert "joined while the cell ran" in err
    assert "the cluster now has 3 ranks" in err and "left (its code raised)" in err


def test_a_scale_asked_for_outside_a_loop_waits_for_the_next_cell(growing, capsys):
    said = growing.request_scale(3)
    assert "before the next cell" in said
    r = run_cell(growing, "import torch.distributed as d; d.get_world_size()", quiet=True)
    assert "the cluster now has 3 ranks" in capsys.readouterr().err
    assert r.values == {0: 3, 1: 3, 2: 3}
    with pytest.raises(hvdnb.ClusterError, match="takes 1 to 3 ranks"):
        growing.request_scale(4)
