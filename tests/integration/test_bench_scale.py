"""Metrics at scale, quick: 128 simulated ranks on 4 hosts over the real side channel into
the real store and panel (``bench/bench_scale.py --quick``; the full run is 1,024 ranks)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# render and main-loop times are its figures: never beside another test (make test's lanes)
pytestmark = [pytest.mark.timeout(120), pytest.mark.alone]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def test_no_point_lost_and_panel_stays_responsive():
    import bench_scale

    r = bench_scale.main(["--quick"])
    assert r["rows_stored"] == r["rows_sent"] > 0
    assert r["messages_stored"] == r["messages_sent"]
    assert r["lost_messages"] == 0 and r["bad_signatures"] == 0
    assert r["hosts_seen"] == 4 and r["band_drawn"]
    # generous bounds: 2 shared cores; the full run's numbers are in bench/results/scale.json
    assert r["render_ms_p95"] < 1000, r
    assert r["main_loop_gap_ms_max"] < 2000, r
