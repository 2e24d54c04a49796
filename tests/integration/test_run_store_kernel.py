"""Runs outlive the kernel: a run logged in one real kernel (the "Python 3 (hvdnb)"
kernelspec), read back in a fresh kernel after the first one shut down: ``hvdnb.runs()``
with its knobs, ``hvdnb.metrics(run=ID)`` with every loss point, the TensorBoard export
read back with TensorBoard's reader, the trackio export read back against trackio's schema,
and the runs chart pinning it (``%dist compare``, then the panel's pin control)."""

from __future__ import annotations

import json
import sqlite3

import pytest

from hvdnb.notebook.headless.runner import Kernel

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

STEPS = 300

TRAIN = f"""%%distributed -q
import hvdnb
knobs = hvdnb.knobs(batch_size=16, warmup_steps=5)
for s in range({STEPS}):
    knobs.step(s)
    hvdnb.log(s, 1.0 / (s + 1), samples=knobs.batch_size)
"""


def _json(r) -> dict:
    assert r.error is None, r
    return json.loads(r.text.strip().splitlines()[-1])


@pytest.mark.timeout(420)
def test_a_run_is_there_in_the_next_kernel(tmp_path):
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    env = {"HVDNB_PANEL": "off", "HVDNB_HOME": str(tmp_path / "home")}
    with Kernel(env) as k:
        r = k.run("%dist start -n 2 --timeout 120", timeout=180)
        assert r.error is None and "2 ranks ready" in r.text, r
        r = k.run(TRAIN)
        assert r.error is None, r
        first = _json(
            k.run(
                "import hvdnb, json\n"
                "print(json.dumps({'ids': hvdnb.runs().id.tolist(), "
                "'live': len(hvdnb.metrics('loss'))}))"
            )
        )
        assert first["live"] == 2 * STEPS
        (rid,) = first["ids"]
        r = k.run("%dist stop", timeout=60)
        assert r.error is None, r
    tb, tk = tmp_path / "tb", tmp_path / "trackio"
    with Kernel(env) as k:  # a fresh kernel: nothing in memory, no cluster
        got = _json(
            k.run(
                "import hvdnb, json\n"
                "from hvdnb.notebook.metrics.store import get_store\n"
                "from hvdnb.notebook.panel.charts import runs_chart\n"
                f"rid = {rid!r}\n"
                "df = hvdnb.runs()\n"
                "run = df[df.id == rid].iloc[0]\n"
                "rows = hvdnb.metrics('loss', run=rid)\n"
                f"hvdnb.metrics(run=rid).to_tensorboard({str(tb)!r})\n"
                "get_ipython().run_line_magic('dist', f'compare {rid}')\n"
                "chart = runs_chart(get_store())\n"
                f"db = str(hvdnb.metrics(run=rid).to_trackio('tuning', dir={str(tk)!r}))\n"
                "get_ipython().run_line_magic('dist', 'compare')\n"  # unpinned: the panel pins
                "from hvdnb.notebook.panel.layout import Panel\n"
                "p = Panel(get_store())\n"
                "p.pins.list.click(); p.render()\n"
                "options = list(p.pins.runs.options)\n"
                "p.pins.runs.value = (rid,); p.pins.pin.click(); p.render()\n"
                "chart2 = runs_chart(get_store())\n"
                "print(json.dumps({'knobs': run.knobs, 'outcome': run.outcome, "
                "'ranks': int(run.ranks), 'steps': int(run.steps), "
                "'loss': sorted((r.rank, r.step, r.value) for r in rows), "
                "'lines': [(l[0], len(l[1])) for l in chart.lines], "
                "'earlier': chart.earlier, 'live': len(hvdnb.metrics('loss')), 'db': db, "
                "'options': options, 'lines2': [(l[0], len(l[1])) for l in chart2.lines], "
                "'earlier2': chart2.earlier, 'note': p.pins.status.value}))"
            )
        )
    assert got["knobs"] == {"batch_size": 16, "warmup_steps": 5}
    assert (got["outcome"], got["ranks"], got["steps"]) == ("done", 2, STEPS - 1)
    assert got["loss"] == [[r, s, 1.0 / (s + 1)] for r in (0, 1) for s in range(STEPS)]
    assert got["live"] == 0  # this kernel logged nothing: its own metrics are empty
    ((label, n),) = got["lines"]
    assert label.startswith(rid) and "batch_size=16" in label and n > 1
    assert got["earlier"] == [0]
    for rank in (0, 1):
        ea = ea_mod.EventAccumulator(str(tb / "run1" / f"rank{rank}"))
        ea.Reload()
        assert [e.step for e in ea.Scalars("loss")] == list(range(STEPS))
        assert len(ea.Scalars("samples")) == STEPS
    # the panel's pin control pins the same run, with the same label, as %dist compare
    assert got["options"] == [[label, rid]]
    assert got["lines2"] == got["lines"] and got["earlier2"] == [0]
    assert got["note"] == f"pinned to the runs chart: {rid}"
    # the trackio export, read against trackio 0.43.0's schema (see trackio_export)
    con = sqlite3.connect(got["db"])
    rows = con.execute(
        "SELECT run_name, step, metrics FROM metrics WHERE run_id = ? ORDER BY timestamp, id",
        (f"hvdnb-{rid}",),
    ).fetchall()
    (config,) = con.execute("SELECT config FROM configs WHERE run_name = ?", (rid,)).fetchone()
    con.close()
    assert {r[0] for r in rows} == {rid}
    losses = [(s, m) for s, m in ((r[1], json.loads(r[2])) for r in rows) if "loss/rank0" in m]
    assert [s for s, _ in losses] == list(range(STEPS))  # other series may log past them
    for s, m in losses:
        assert (m["loss/rank0"], m["loss/rank1"]) == (1.0 / (s + 1), 1.0 / (s + 1))
    config = json.loads(config)
    assert (config["batch_size"], config["warmup_steps"], config["hvdnb/ranks"]) == (16, 5, 2)
