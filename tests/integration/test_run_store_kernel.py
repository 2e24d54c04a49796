"""Runs outlive the kernel: a run logged in one real kernel (the "Python 3 (hvdnb)"
kernelspec), read back in a fresh kernel after the first one shut down: ``hvdnb.runs()``
with its knobs, ``hvdnb.metrics(run=ID)`` with every loss point, the TensorBoard export
read back with TensorBoard's reader, and the runs chart pinning it (``%dist compare``)."""

from __future__ import annotations

import json

import pytest

from hvdnb.notebook.runner import Kernel

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
    tb = tmp_path / "tb"
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
                "print(json.dumps({'knobs': run.knobs, 'outcome': run.outcome, "
                "'ranks': int(run.ranks), 'steps': int(run.steps), "
                "'loss': sorted((r.rank, r.step, r.value) for r in rows), "
                "'lines': [(l[0], len(l[1])) for l in chart.lines], "
                "'earlier': chart.earlier, 'live': len(hvdnb.metrics('loss'))}))"
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
