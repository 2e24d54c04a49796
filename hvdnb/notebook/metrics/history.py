"""Runs across sessions: ``hvdnb.runs()``, ``hvdnb.import_runs()`` and ``%dist runs`` /
``%dist compare``.

Owns: the user's view of the run store (``runstore``) through the notebook's store's run
log (``runlog``): the runs as a DataFrame and as printed lines, deleting runs, pinning
them to the runs chart, and importing an exported script's ``HVDNB_METRICS_DIR`` (read
by ``files``) as runs of the store.

Never: hold the store's lock or touch the file on the panel's path.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

from hvdnb.notebook.metrics.files import load_store
from hvdnb.notebook.metrics.runstore import RUN_FIELDS, Batch
from hvdnb.notebook.metrics.store import MetricsStore, get_store
from hvdnb.protocol.errors import InputTypeError

__all__ = ["compare", "delete", "import_runs", "runs", "runs_text"]


def runs() -> Any:
    """Every run in the run store, from every session and imported batch job, newest last.

    Returns
    -------
    pandas.DataFrame
        One row per run: ``id`` (for ``hvdnb.metrics(run=ID)`` and ``%dist compare``),
        ``session``, ``run`` (its number in its session), ``notebook``, ``cell``,
        ``started``, ``ended`` (datetimes; ``ended`` NaT: still running, or its kernel
        died), ``ranks``, ``backend``, ``device``, ``knobs`` (at its start),
        ``changes`` ((step, values, rank) of each knob change), ``steps``, ``last_loss`` (mean
        over ranks), ``outcome`` (``done``, ``interrupted``, ``error``, ``stopped`` by a
        watcher; None: unfinished), ``points``, ``source`` (``notebook`` or the imported
        directory), and a ``knob.<name>`` column per knob.

    Raises
    ------
    RuntimeError
        ``StoreUnavailable``: the run store could not be opened this session (the
        warning said why).

    Examples
    --------
    >>> df = hvdnb.runs()                                          # doctest: +SKIP
    >>> df[df.outcome == "done"].sort_values("last_loss").head()   # doctest: +SKIP
    """
    import pandas as pd  # noqa: PLC0415  pandas is optional

    recs = get_store().run_log.store().runs()
    df = pd.DataFrame(recs, columns=list(RUN_FIELDS))
    for col in ("started", "ended"):
        df[col] = pd.to_datetime(df[col], unit="s")
    names = sorted({k for r in recs for k in r["knobs"]})
    for k in names:
        df[f"knob.{k}"] = [r["knobs"].get(k) for r in recs]
    return df


def runs_text(last: int = 20) -> str:
    """The newest ``last`` runs, one line each (``%dist runs``)."""
    store = get_store().run_log.store()
    recs = store.runs()
    if not recs:
        return f"no runs in the run store yet ({store.path})"
    lines = [f"{len(recs)} run{'s' if len(recs) != 1 else ''} in {store.path}:"]
    if len(recs) > last:
        lines.append(f"  ... {len(recs) - last} older (hvdnb.runs() has them all)")
    for r in recs[-last:]:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["started"] or 0))
        knobs = " ".join(f"{k}={v}" for k, v in r["knobs"].items())
        loss = f"{r['last_loss']:.4g}" if r["last_loss"] is not None else "n/a"
        where = r["notebook"] or r["source"] or ""
        lines.append(
            f"  {r['id']:<12} {when}  {r['ranks'] or '?'} ranks {r['backend'] or ''} "
            f"{r['device'] or ''}  steps {r['steps'] if r['steps'] is not None else 'n/a'}"
            f"  loss {loss}  {r['outcome'] or 'unfinished'}  {knobs}  {where}".rstrip()
        )
    return "\n".join(lines)


def delete(ids: list[str]) -> str:
    """Delete runs from the run store (``%dist runs --delete ID ...``); says what it did."""
    log = get_store().run_log
    store = log.store()
    gone = store.delete(ids)
    missing = [i for i in ids if i not in gone]
    text = f"deleted {len(gone)} run{'s' if len(gone) != 1 else ''}: {' '.join(gone)}"
    if missing:
        raise ValueError(
            f"{text}; no run {' '.join(missing)} in {store.path}: `%dist runs` lists the ids"
        )
    return text


def compare(ids: list[str], store: MetricsStore | None = None) -> str:
    """Pin runs of the run store to the panel's runs chart (``%dist compare ID ...`` and
    the panel's pin control; no id: unpin them all). ``store``: default ``get_store()``."""
    log = (store if store is not None else get_store()).run_log
    if not ids:
        log.unpin()
        return "no earlier runs pinned to the runs chart"
    pinned = log.pin(ids)
    return f"pinned to the runs chart: {' '.join(pinned)}"


def import_runs(path: str | Path) -> list[str]:
    """Add an exported script's runs to the run store, beside the notebook's.

    Parameters
    ----------
    path : the directory the script ran with as ``HVDNB_METRICS_DIR`` (its
        ``rank<N>.jsonl`` files); each time the script ran into it is one run. Importing
        the same directory again replaces its runs, it does not add copies.

    Returns
    -------
    list of the ids the runs have in the store (``hvdnb.runs()``, ``hvdnb.metrics(run=ID)``)

    Raises
    ------
    FileNotFoundError
        no such directory, or no ``rank<N>.jsonl`` in it (see ``hvdnb.metrics.load``)

    Examples
    --------
    >>> hvdnb.import_runs("out")            # HVDNB_METRICS_DIR=out srun python train.py
    ['b1c9e2-1']
    """
    __tracebackhide__ = True
    if not isinstance(path, (str, os.PathLike)):
        raise InputTypeError(
            f"hvdnb.import_runs: path must be a directory (a str or a Path), "
            f"not {type(path).__name__} ({path!r})"
        )
    src = Path(path).resolve()
    batch = load_store(src)
    tag = "b" + hashlib.sha1(str(src).encode()).hexdigest()[:5]
    info = batch.rank_info
    backends = {v.get("backend") for v in info.values() if v.get("backend")}
    backend = next(iter(backends)) if len(backends) == 1 else None
    records: list[dict[str, Any]] = []
    points = Batch()
    ids: list[str] = []
    for rec in batch.runs:
        rid = f"{tag}-{rec['id']}"
        rows = batch.rows(run=rec["id"])
        for r in rows:
            points.add(rid, r.rank, r.name, (r.step,), (r.time,), (r.value,))
        losses: dict[int, float] = {r.rank: r.value for r in rows if r.name == "loss"}
        finite = [v for v in losses.values() if v == v]
        records.append(
            {
                "id": rid,
                "session": tag,
                "run": rec["id"],
                "notebook": str(src),
                "started": rec["started"] if not rows else min(r.time for r in rows),
                "ended": max((r.time for r in rows), default=None),
                "ranks": len({r.rank for r in rows}) or None,
                "backend": backend,
                "knobs": rec["knobs"],
                "changes": rec["changes"],
                "steps": max((r.step for r in rows if r.name == "loss"), default=None),
                "last_loss": sum(finite) / len(finite) if finite else None,
                "outcome": "done",
                "points": len(rows),
                "source": f"batch {src}",
            }
        )
        ids.append(rid)
    store = get_store().run_log.store()
    store.delete(ids)
    con = store.connect()
    try:
        store.write(con, points, records)
    finally:
        con.close()
    return ids
