"""Metrics at scale, quick: 128 simulated ranks on 4 hosts over the real side channel into
the real store and panel (``bench/bench_scale.py --quick``; the full run is 1,024 ranks)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# counts only (its render and main-loop times are the bench's figures, in
# bench/results/scale.json): a test beside it in the other lane changes nothing it checks
pytestmark = [pytest.mark.timeout(120)]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def test_no_point_lost_and_the_panel_redraws_while_points_arrive():
    import bench_scale

    r = bench_scale.main(["--quick"])
    assert r["rows_stored"] == r["rows_sent"] > 0
    assert r["messages_stored"] == r["messages_sent"]
    assert r["lost_messages"] == 0 and r["bad_signatures"] == 0
    assert r["hosts_seen"] == 4 and r["band_drawn"]
    assert r["panel_renders"] > 0, r  # drawn during the run, not only at its end
