"""Where a rank's main thread is, as the stall detector reads it (``engine.where``): a
function of torch.distributed's files is a collective, a module of them being imported is not
(CI saw the first ``torch.optim.SGD`` import torch._dynamo, which imports torch.distributed
modules, reported as "waits in <module>")."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path
from typing import Any

from hvdnb.rank import engine


def _look_while(tmp_path: Path, module_body: str, cell_line: str) -> dict[str, Any]:
    """Run a one-line "<cell 1>" on this (the main) thread that imports a module kept under a
    ``torch/distributed/`` folder, and read ``where()`` from another thread meanwhile."""
    folder = tmp_path / "torch" / "distributed"
    folder.mkdir(parents=True)
    path = folder / "hvdnb_where_probe.py"
    path.write_text(module_body)
    inside, seen = threading.Event(), {}

    def look() -> None:
        assert inside.wait(30)
        time.sleep(0.2)
        seen.update(engine.where())

    spec = importlib.util.spec_from_file_location("hvdnb_where_probe", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    module.inside = inside  # type: ignore[attr-defined]  the probe's module body sets it
    watcher = threading.Thread(target=look)
    watcher.start()
    cell = compile(cell_line, "<cell 1>", "exec")
    exec(cell, {"load": lambda: spec.loader.exec_module(module), "inside": inside, "m": module})
    watcher.join(30)
    return seen


def test_a_torch_distributed_module_being_imported_is_not_a_collective(tmp_path):
    seen = _look_while(tmp_path, "import time\ninside.set()\ntime.sleep(0.8)\n", "load()")
    assert seen["cell"] == "<cell 1>" and seen["line"] == 1, seen
    assert seen["collective"] is None, seen


def test_a_torch_distributed_function_is_a_collective(tmp_path):
    body = "import time\ndef all_reduce(event):\n    event.set()\n    time.sleep(0.8)\n"
    seen = _look_while(tmp_path, body, "load(); m.all_reduce(inside)")
    assert seen["collective"] == "all_reduce", seen
