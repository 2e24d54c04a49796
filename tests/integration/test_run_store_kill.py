"""No run is lost when the notebook kernel dies (a crash, the OOM killer: SIGKILL, no atexit).

- A run whose cell has ended is in the run store by the time ``%dist stop`` returns: ten
  real kernels (the hvdnb kernelspec; one rank each, two kernels at a time), each logging a
  short run and SIGKILLed right after ``%dist stop``; a fresh kernel lists all ten runs,
  each with every point.
- A run still training when its kernel is SIGKILLed keeps what reached the notebook up to
  the writer's interval before the kill (``runlog.INTERVAL``, 0.5 s): its last stored point
  is within a second of the kill.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hvdnb.notebook.headless.runner import Kernel

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

SHORT = """%%distributed -q
import hvdnb
for s in range(40):
    hvdnb.log(s, 1.0 / (s + 1))
"""


def _kill(k: Kernel) -> None:
    """SIGKILL the kernel process (nothing of it runs after), then drop the client."""
    pid = k.km.provisioner.process.pid
    os.kill(pid, signal.SIGKILL)
    k.kc.stop_channels()
    try:
        k.km.shutdown_kernel(now=True)
    except Exception:
        pass
    k._td.cleanup()


def _stored(env: dict[str, str]) -> dict:
    with Kernel(env) as k:
        r = k.run(
            "import hvdnb, json\ndf = hvdnb.runs()\n"
            "print(json.dumps({r.id: [int(r.steps), r.outcome] for r in df.itertuples()}))"
        )
        assert r.error is None, r
        return json.loads(r.text.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_ten_kernels_killed_after_dist_stop_lose_no_run(tmp_path):
    env = {"HVDNB_PANEL": "off", "HVDNB_HOME": str(tmp_path / "home")}

    def one_try(_: int) -> None:
        k = Kernel(env)
        r = k.run("%dist start -n 1 --timeout 120", timeout=180)
        assert r.error is None, r
        r = k.run(SHORT)
        assert r.error is None, r
        r = k.run("%dist stop", timeout=60)
        assert r.error is None and "cluster stopped" in r.text, r
        _kill(k)

    # two kernels at a time, one rank each: the two cores both busy, the tries independent
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(one_try, range(10)))
    stored = _stored(env)
    assert len(stored) == 10, stored
    assert all(v == [39, "done"] for v in stored.values()), stored  # every point, ended


@pytest.mark.timeout(300)
def test_a_run_killed_mid_training_keeps_its_points_up_to_the_last_second(tmp_path):
    env = {"HVDNB_PANEL": "off", "HVDNB_HOME": str(tmp_path / "home")}
    k = Kernel(env)
    r = k.run("%dist start -n 2 --timeout 120", timeout=180)
    assert r.error is None, r
    k.kc.execute(
        "%%distributed -q\nimport hvdnb, time\n"
        "for s in range(100000):\n    hvdnb.log(s, 1.0 / (s + 1))\n    time.sleep(0.01)\n"
    )
    time.sleep(4.0)  # training, its points flowing to the notebook
    killed = time.time()
    _kill(k)
    time.sleep(1.0)  # the watchdog stops the orphaned ranks (polling at 10 Hz)
    with Kernel(env) as k2:
        r = k2.run(
            "import hvdnb, json\n(rid,) = hvdnb.runs().id.tolist()\n"
            "m = hvdnb.metrics('loss', run=rid).to_pandas()\n"
            "print(json.dumps({'n': len(m), 'last': float(m.time.max())}))"
        )
        assert r.error is None, r
        got = json.loads(r.text.strip().splitlines()[-1])
    assert got["n"] > 100, got  # seconds of training are there
    assert killed - got["last"] < 1.0, (killed - got["last"], got)
