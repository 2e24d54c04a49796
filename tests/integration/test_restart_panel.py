"""``%dist restart`` applies its options, and a new cluster's panel is its own: on real
clusters under mpiexec (1 and 2 ranks)."""

from __future__ import annotations

import re

import pytest
from IPython.core.error import UsageError

import hvdnb
from hvdnb.notebook.panel import get_panel
from hvdnb.notebook.panel.charts import runs_chart

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(240)]

LOOP = """
import hvdnb
for step in range(30):
    hvdnb.log(step, 1.0 / (step + 1))
hvdnb.metrics.get_recorder().flush()
"""


@pytest.fixture
def fresh(shell):
    c = hvdnb.current()
    if c is not None:
        c.stop()
    yield shell
    c = hvdnb.current()
    if c is not None:
        c.stop()


def _ranks(cluster) -> int:
    """Ranks that answer a cell (the world size each rank reports, checked equal)."""
    res = hvdnb.run_cell(cluster, "import torch.distributed as d; d.get_world_size()", quiet=True)
    sizes = set(res.values.values())
    assert len(sizes) == 1
    return len(res.values) if sizes == {len(res.values)} else -1


def test_restart_applies_n_and_a_refused_one_loses_nothing(fresh, capsys):
    fresh.run_line_magic("dist", "start -n 1 --timeout 120")
    c = hvdnb.current()
    assert c is not None and c.n == 1
    fresh.run_line_magic("dist", "restart -n 2")
    out = capsys.readouterr().out
    assert "hvdnb: 2 fresh ranks ready" in out and "(was 1 rank" in out, out
    assert hvdnb.current() is c and c.running and c.n == 2
    assert _ranks(c) == 2
    pids = c.pids()
    with pytest.raises(UsageError, match="-n must be at least 1.*left as it was"):
        fresh.run_line_magic("dist", "restart -n 0")
    assert c.running and c.n == 2 and c.pids() == pids
    assert _ranks(c) == 2


def _header(panel) -> str:
    panel.render(force=True)
    head = panel.view.value.split("</div>", 1)[0]
    return re.sub(r"<[^>]+>", "", head).replace("&middot;", "|")


def test_a_new_start_shows_the_new_cluster_and_marks_earlier_runs(fresh):
    fresh.run_line_magic("dist", "start -n 1 --timeout 120")
    fresh.run_cell_magic("distributed", "-q", LOOP)
    panel = get_panel()
    assert panel is not None
    head = _header(panel)
    old_step = re.search(r"step \d+", head)
    assert head.startswith("hvdnb 1 rank | ") and old_step is not None, head
    fresh.run_line_magic("dist", "stop")
    fresh.run_line_magic("dist", "start -n 2 --timeout 120")
    head = _header(panel)
    assert head.startswith("hvdnb 2 ranks | "), head
    assert "no steps yet" in head and not re.search(r"step \d+", head), head
    chart = runs_chart(panel.store)
    # every run drawn so far ran on an earlier cluster (the 1-rank one last; runs of earlier
    # tests in this process may come before it)
    assert chart.lines and chart.earlier == list(range(len(chart.lines))), chart.earlier
    assert "(earlier cluster: 1 rank" in chart.lines[-1][0]
    fresh.run_cell_magic("distributed", "-q", LOOP)
    head = _header(panel)
    assert head.startswith("hvdnb 2 ranks | Gloo") and old_step.group() in head, head
    chart = runs_chart(panel.store)
    assert chart.earlier == list(range(len(chart.lines) - 1)), chart.earlier
    assert "earlier" not in chart.lines[-1][0]
