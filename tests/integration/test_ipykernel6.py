"""hvdnb on ipykernel 6 (hvdnb asks for ``ipykernel>=6.29``): the path without subshells.

ipykernel 7 runs the panel's controls on a subshell of their own, so a knob typed into the
panel while a training cell runs reaches the ranks during that cell
(``hvdnb.notebook.panel.kernel``). ipykernel 6 has no subshells: ``control_subshell()`` is
None, the front end's widget messages wait behind the running cell, and a change made
during a cell is applied when the cell ends. Checked in an environment of its own, built
once for this module (``python -m venv``; torch from ``constraints.txt``, hvdnb editable,
``ipykernel<7``; about 1.5 minutes with pip's cache), where the notebook kernel and the
ranks all run ipykernel 6: a driver run by that environment's Python starts the "Python 3
(hvdnb)" kernel over jupyter_client as JupyterLab does (``hvdnb.notebook.headless.runner.Kernel``),
starts 2 ranks, types a knob into the panel while a cell loops, and reports what happened.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hvdnb.notebook.cellout.output import per_rank_lines

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

#: run by the ipykernel 6 environment's Python; prints one JSON line last
DRIVER = r'''
import json, sys, time
from pathlib import Path
import ipykernel
from hvdnb.notebook.headless.runner import Kernel

work = Path(sys.argv[1])
started, release = work / "started", work / "release"
out = {"driver_ipykernel": ipykernel.__version__}
LOOP = f"""%%distributed
import os, time
seen = []
step = 0
if hvdnb_rank == 0:
    open({str(started)!r}, "w").close()
while not os.path.exists({str(release)!r}):
    knobs.step(step)
    seen.append(knobs.batch_size)
    step += 1
    time.sleep(0.01)
print("loop saw", sorted(set(seen)), "history", len(knobs.history))
"""


def until_idle(k, msg_id, timeout=120):
    text = []
    while True:
        msg = k.kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text.append(msg["content"]["text"])
        if msg["msg_type"] == "error":
            text.append("ERROR " + msg["content"]["ename"] + ": " + msg["content"]["evalue"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(text)


# a merge window far longer than any rank lags on a loaded box: a line both ranks print
# is "[0,1] ...", shown as soon as the second prints it
with Kernel({"HVDNB_PANEL": "inline", "HVDNB_COLLAPSE_WINDOW": "60"}) as k:
    r = k.run(
        "import ipykernel\nfrom hvdnb.notebook.panel import kernel as _k\n"
        "print(ipykernel.__version__, _k.control_subshell())"
    )
    out["kernel"] = r.text.strip()
    r = k.run("%dist start -n 2 --timeout 120", timeout=240)
    out["start"] = [r.error, r.displays, r.text[-300:]]
    text_boxes = [
        c["comm_id"]
        for c in r.comm_opens
        if c.get("data", {}).get("state", {}).get("placeholder", "").startswith("e.g. lr=")
    ]
    out["text_boxes"] = len(text_boxes)
    r = k.run(
        "%%distributed\nimport hvdnb, ipykernel, torch.distributed as d\n"
        "hvdnb_rank = d.get_rank()\nknobs = hvdnb.knobs(batch_size=16, lr=0.1)\n"
        "print('ranks on ipykernel', ipykernel.__version__)"
    )
    out["ranks"] = [r.error, r.text.strip()]
    msg_id = k.kc.execute(LOOP)
    deadline = time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    out["loop_started"] = started.exists()
    # what the front end sends when a person types into the panel's box and presses Enter
    k.send_comm(
        text_boxes[0], {"method": "update", "state": {"value": "batch_size=48"}, "buffer_paths": []}
    )
    # a subshell (ipykernel 7) would apply it within a fraction of this while the loop runs
    time.sleep(3)
    release.touch()
    out["loop"] = until_idle(k, msg_id)
    after = []
    for _ in range(50):  # the queued message is handled once the cell has ended
        r = k.run("%%distributed\nprint('now', knobs.batch_size)")
        after.append(r.text.strip())
        if "[0,1] now 48" in r.text:
            break
        time.sleep(0.2)
    out["after"] = after
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def ipykernel6_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh environment with hvdnb and ipykernel < 7 (built for real, as a user would:
    ``python -m venv``, then pip with this repository's constraints); its Python."""
    venv = tmp_path_factory.mktemp("ipykernel6") / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=120, env=env)
    py = venv / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q", "--no-compile", "-c", "constraints.txt"]
    res = subprocess.run(
        [*pip, "torch==2.13.0", "-e", ".", "ipykernel>=6.29,<7"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, f"pip failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return py


def _drive(py: Path, work: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{py.parent}{os.pathsep}{env['PATH']}"  # its mpiexec, as its user has
    proc = subprocess.run(
        [str(py), "-c", DRIVER, str(work)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.timeout(900)
def test_on_ipykernel_6_a_knob_typed_during_a_cell_is_applied_when_it_ends(
    ipykernel6_python: Path, tmp_path: Path
) -> None:
    got = _drive(ipykernel6_python, tmp_path)
    version = got["driver_ipykernel"]
    assert version.startswith("6."), got  # the environment is the one meant
    # the kernel runs ipykernel 6 and takes the path without a subshell
    assert got["kernel"] == f"{version} None", got
    error, displays, text = got["start"]
    assert error is None and displays >= 1 and "2 ranks ready" in text, got  # panel shown
    assert got["text_boxes"] == 1, got
    assert got["ranks"] == [None, f"[0,1] ranks on ipykernel {version}"], got
    assert got["loop_started"], got
    # typed while the loop ran: not applied during that cell, on any rank (ipykernel 7:
    # "loop saw [16, 48] history 1") ...
    assert per_rank_lines(got["loop"], r"loop saw \[16\] history (\d+)") == {0: [0], 1: [0]}, got
    # ... but once it ended, on every rank
    assert got["after"] and "[0,1] now 48" in got["after"][-1], got
