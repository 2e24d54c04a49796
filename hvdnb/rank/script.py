"""What an exported script (``%dist export``) calls first: set this process up as
``%dist start`` sets up an engine, without Jupyter.

Owns: joining the job under mpiexec, torchrun or srun (``rendezvous.init_process_group``:
rank, size, the torchrun variables, the default process group, device and thread count;
then TensorFlow's ``TF_CONFIG``, ``tfconfig.setup``),
the knob values a script starts from, and where ``hvdnb.log`` points go outside a
notebook: nowhere (a bounded in-memory ring, about a microsecond a call) unless
``HVDNB_METRICS_DIR`` names a directory, where each rank appends its flushes as JSON lines
to ``rank<N>.jsonl``: one line per message the rank would send the notebook, in the
protocol's file form (``hvdnb.protocol.jsonl``; a ``metrics`` line per flush with ``seq``,
``t``, ``step`` and ``cols``, the columns the panel receives), read back by
``hvdnb.metrics.load(dir)``.

Never: import IPython, ipyparallel or widgets, or start processes.
"""

from __future__ import annotations

import atexit
import os
import threading
from pathlib import Path
from typing import Any

from hvdnb.protocol.jsonl import dumps_line
from hvdnb.protocol.kinds import Kind, outgoing
from hvdnb.rank import frameworks, rendezvous, tfconfig
from hvdnb.rank.metrics import knobs as knobset
from hvdnb.rank.metrics import recorder

__all__ = ["JsonlChannel", "init", "rank", "size"]

_WORLD: Any = None


class JsonlChannel:
    """A stand-in for the notebook's side channel: each message becomes one line of
    ``path`` in the protocol's file form (``hvdnb.protocol.jsonl.dumps_line``)."""

    def __init__(self, path: str | Path, rank: int) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._f = self.path.open("a")
        self._lock = threading.Lock()

    def send(self, kind: Kind, **payload: Any) -> None:
        line = dumps_line({**outgoing(kind, payload), "rank": self.rank})
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()

    def on(self, kind: Kind, fn: Any) -> None:
        """Nothing arrives from a file: knob changes come from the script's own values."""

    def close(self) -> None:
        with self._lock:
            self._f.close()


def init(backend: str | None = None, knobs: dict[str, Any] | None = None) -> Any:
    """Join the job as a rank: what ``%dist start`` does for an engine. Collective.

    Parameters
    ----------
    backend : torch.distributed backend (None: NCCL with GPUs, else Gloo)
    knobs : starting values for ``hvdnb.knobs(...)`` calls in the script, by name (the
        values in force when the notebook exported it); a name the script's knobs do not
        have is ignored

    Returns
    -------
    hvdnb.rank.rendezvous.World
    """
    global _WORLD

    _WORLD = rendezvous.init_process_group(backend)
    tfconfig.setup(_WORLD)
    frameworks.install(rendezvous.place(_WORLD, rendezvous.setup_device(_WORLD)))
    knobset.DEFAULTS.update(knobs or {})
    out = os.environ.get("HVDNB_METRICS_DIR")
    if out:
        rec = recorder.get_recorder()
        rec.channel = JsonlChannel(Path(out) / f"rank{_WORLD.rank}.jsonl", _WORLD.rank)
        atexit.register(rec.close)  # the last points, then the file
    return _WORLD


def rank() -> int:
    """This process's rank (after ``init``)."""
    if _WORLD is None:
        raise RuntimeError("hvdnb.rank.script.init() has not run: it is the script's first call")
    return int(_WORLD.rank)


def size() -> int:
    """The number of ranks (after ``init``)."""
    if _WORLD is None:
        raise RuntimeError("hvdnb.rank.script.init() has not run: it is the script's first call")
    return int(_WORLD.size)
