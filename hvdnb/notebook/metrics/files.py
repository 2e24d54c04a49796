"""``hvdnb.metrics.load``: a batch run's metrics files, back in a store.

An exported script run with ``HVDNB_METRICS_DIR=DIR`` (under mpiexec, torchrun, srun)
writes one ``DIR/rank<N>.jsonl`` per rank: the messages the rank would have sent to the
notebook, in the protocol's file form (``hvdnb.protocol.jsonl``). This module reads them
and feeds them through the same handlers the live side channel feeds (``ingest``,
``on_rank_info``, ``on_spec``), into a fresh ``MetricsStore``: rows, ``to_pandas()``,
``to_csv()`` and the views work as they do on a notebook's points.

Each time the script ran into the same directory is one run: a rank's file appended by
several processes (several pids) holds several runs, matched across ranks by order.

Owns: finding the rank files, reading them line by line, reporting what cannot be read
(file and line; the rest is kept). Never: touch the notebook's own store or a cluster.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

from hvdnb.notebook.metrics.store import MetricRows, MetricsStore
from hvdnb.protocol import jsonl, kinds

__all__ = ["load", "load_store"]

_RANK_FILE = re.compile(r"rank(\d+)\.jsonl")
_SHOWN = 3  # bad lines named per file; the rest are counted


def _rank_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: pass the directory the script ran with as "
            "HVDNB_METRICS_DIR (or one of its rank<N>.jsonl files)"
        )
    found = [(int(m.group(1)), p) for p in path.iterdir() if (m := _RANK_FILE.fullmatch(p.name))]
    if not found:
        raise FileNotFoundError(
            f"{path} holds no rank<N>.jsonl file: run the exported script with "
            f"HVDNB_METRICS_DIR={path} set, and each rank writes its rank<N>.jsonl there"
        )
    return [p for _, p in sorted(found)]


def _read(path: Path) -> list[list[dict[str, Any]]]:
    """The file's messages, one list per process that appended to it (in order); a line
    that cannot be read is skipped and reported in one warning per file."""
    runs: list[list[dict[str, Any]]] = []
    pending: list[dict[str, Any]] = []
    pid: Any = object()
    bad: list[str] = []
    nbad = 0
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                msg = jsonl.loads_line(line)
            except ValueError as exc:
                nbad += 1
                if len(bad) < _SHOWN:
                    bad.append(f"{path}:{lineno}: {exc}")
                continue
            pending.append(msg)
            if "pid" in msg:  # a message without one (a knob set) goes with the next one
                if msg["pid"] != pid:  # another run of the script
                    pid = msg["pid"]
                    runs.append([])
                runs[-1].extend(pending)
                pending.clear()
    if pending:
        if not runs:
            runs.append([])
        runs[-1].extend(pending)
    if nbad:
        more = f" (and {nbad - len(bad)} more)" if nbad > len(bad) else ""
        warnings.warn(
            f"skipped {nbad} line{'s' if nbad > 1 else ''} that could not be read; the rest "
            f"is loaded: " + "; ".join(bad) + more,
            stacklevel=3,
        )
    elif not runs:
        warnings.warn(
            f"{path} holds no message: that rank logged nothing, or its process ended "
            "before its first flush (hvdnb.log sends every flush interval and at exit)",
            stacklevel=3,
        )
    return runs


def load_store(path: str | Path) -> MetricsStore:
    """A new ``MetricsStore`` holding what the rank files under ``path`` recorded.

    Parameters
    ----------
    path : the directory an exported script ran with as ``HVDNB_METRICS_DIR`` (every
        ``rank<N>.jsonl`` in it), or one such file

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist, or holds no ``rank<N>.jsonl`` file. A line that cannot be
        read is skipped with a warning naming its file and line.
    """
    store = MetricsStore()
    handlers = {
        kinds.METRICS.name: store.ingest,
        kinds.RANK_INFO.name: store.on_rank_info,
        kinds.KNOBS_SPEC.name: store.on_spec,
        kinds.KNOBS_APPLIED.name: store.on_applied,
    }
    per_file = [_read(p) for p in _rank_files(Path(path))]
    for i in range(max((len(runs) for runs in per_file), default=0)):
        store.begin_cell()  # one run of the script: its first logged point starts a run
        for runs in per_file:
            for msg in runs[i] if i < len(runs) else ():
                fn = handlers.get(msg["kind"])
                if fn is not None:
                    fn(msg)
        store.end_cell()
    return store


def load(
    path: str | Path, name: str | None = None, rank: int | None = None, run: int | None = None
) -> MetricRows:
    """The points a batch run recorded with ``hvdnb.log``, as ``hvdnb.metrics()`` rows.

    Parameters
    ----------
    path : the directory an exported script ran with as ``HVDNB_METRICS_DIR``, or one of
        its ``rank<N>.jsonl`` files
    name, rank, run : only this metric, rank or run (each time the script ran into the
        directory is one run, numbered from 1)

    Returns
    -------
    MetricRows, a list of ``(rank, step, name, value, time, run, segment, knobs)`` with
    ``to_pandas()``, ``to_csv(path)`` and ``to_jsonl(path)``

    Raises
    ------
    FileNotFoundError
        no such path, or no ``rank<N>.jsonl`` under it (the script ran without
        ``HVDNB_METRICS_DIR``). A line that cannot be read is skipped with a warning
        naming its file and line; the rest is loaded.

    Examples
    --------
    >>> # HVDNB_METRICS_DIR=out mpiexec -n 2 python train.py
    >>> df = hvdnb.metrics.load("out").to_pandas()                # doctest: +SKIP
    >>> df[df.name == "loss"].groupby("step").value.mean()        # doctest: +SKIP
    """
    return load_store(path).rows(name, rank, run)
