"""The live panel's data path on a real 2-rank cluster: points arrive while the cell runs,
and a knob change is applied on both ranks at the same step."""

from __future__ import annotations

import pytest

from hvdnb import cells
from hvdnb.metrics.store import attach

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(180)]

TRAIN = r"""
import time, torch, hvdnb
import hvdnb.torch as hvd
hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(32, 4)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
knobs = hvdnb.knobs(batch_size=16, warmup_steps=10, lr=0.1)
seen = []
for step in range(__STEPS__):
    knobs.step(step)
    seen.append((step, knobs.warmup_steps))
    with hvdnb.phase("data"):
        x, y = torch.randn(knobs.batch_size, 32), torch.randint(0, 4, (knobs.batch_size,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    hvdnb.log(step, loss, samples=knobs.batch_size, total_steps=__STEPS__)
    time.sleep(0.01)
hvdnb.metrics.get_recorder().flush()
changes = [(s, w) for (s, w), (_, w0) in zip(seen[1:], seen) if w != w0]
(changes, knobs.history)
"""


def test_points_arrive_while_the_cell_runs(dist2):
    store = attach(dist2)
    store.clear()
    during: list[int] = []

    def hook(final: bool) -> None:
        if not final:
            during.append(store.points)

    cells.add_wait_hook(hook)
    try:
        cells.run_cell(dist2, TRAIN.replace("__STEPS__", "150"), quiet=True)
    finally:
        cells.remove_wait_hook(hook)
    assert max(during) > 0, "no point reached the notebook before the cell ended"
    assert max(during) < store.points or during[-1] <= store.points
    loss = store.rows("loss")
    assert {r.rank for r in loss} == {0, 1}
    for rank in (0, 1):
        steps = [r.step for r in loss if r.rank == rank]
        assert steps == list(range(150)), "a point was lost or duplicated"
    assert store.lost_messages == 0 and store.lost_rows == 0
    names = store.names()
    assert any(n.startswith("comm/bucket") and n.endswith("/time") for n in names), names
    assert "mem/rss" in names and "time/data" in names
    # hvdnb.torch sends small CPU allreduces over MPI, larger ones over gloo
    assert {i.get("backend") for i in store.rank_info.values()} <= {"gloo", "mpi"}
    assert "bottleneck" in store.hint()


def test_a_cells_last_points_are_in_the_store_when_it_returns(dist2):
    """Points travel on the side channel, the cell's reply on ipyparallel's sockets: a
    cell that logs and ends at once (no flush of its own) must still find every point in
    hvdnb.metrics() and in its final panel redraw."""
    store = attach(dist2)
    for attempt in range(3):  # each cell ends a few ms after its last log()
        store.clear()
        cells.run_cell(
            dist2, f"import hvdnb\nfor s in range(5):\n    hvdnb.log(s, 0.5 * s + {attempt})",
            quiet=True,
        )
        loss = store.rows("loss")
        for rank in (0, 1):
            assert [r.step for r in loss if r.rank == rank] == list(range(5)), attempt
    assert store.lost_messages == 0


def test_knob_applied_at_the_same_step_on_every_rank(dist2):
    store = attach(dist2)
    store.clear()
    asked: list[tuple[bool, str]] = []

    def hook(final: bool) -> None:
        if not asked and store.knob_spec and len(store.rows("loss")) >= 40:
            asked.append(store.request_knobs(warmup_steps=42))

    cells.add_wait_hook(hook)
    try:
        res = cells.run_cell(dist2, TRAIN.replace("__STEPS__", "300"), quiet=True)
    finally:
        cells.remove_wait_hook(hook)
    assert asked and asked[0][0], asked
    changes = {r: v[0] for r, v in res.values.items()}
    history = {r: v[1] for r, v in res.values.items()}
    assert all(len(c) == 1 and c[0][1] == 42 for c in changes.values()), changes
    steps = {c[0][0] for c in changes.values()}
    assert len(steps) == 1, f"ranks applied the change at different steps: {changes}"
    assert all(not h[0][2] for h in history.values()), f"a rank heard too late: {history}"
    status = store.knob_status()
    assert status["plan"]["apply_at"] == steps.pop()
    assert sorted(status["applied"]) == [0, 1]


def test_bad_knob_value_is_refused_without_reaching_the_ranks(dist2):
    store = attach(dist2)
    store.knob_spec = {"lr": {"kind": "float", "min": 1e-8, "max": 10.0, "value": 0.1}}
    ok, msg = store.request_knobs(lr=-1.0)
    assert not ok and "out of range" in msg
    ok, msg = store.request_knobs(nope=1)
    assert not ok and "unknown knob" in msg
