"""``hvdnb.metrics(run=ID).to_trackio(PROJECT)``: rows as a trackio project database.

Owns: the export to trackio's on-disk format, written with ``sqlite3`` (trackio itself is
not a dependency: 13 more distributions in this project's environment, a web stack;
``bench/bench_trackio_deps.py``, ``bench/results/trackio_deps.json``). The format is trackio
0.43.0's ``trackio/sqlite_storage.py`` at schema version 2 (``PRAGMA user_version``): one file per
project, ``$TRACKIO_DIR/<project>.db`` (default ``$HF_HOME/trackio``, i.e.
``~/.cache/huggingface/trackio``); a run is a ``run_id`` (unique) and a ``run_name``
(shown); ``metrics`` holds one row per logged step with every value of that step in one
JSON object (``{"loss/rank0": 0.5, ...}``, NaN and infinities as the strings trackio
writes: ``"NaN"``, ``"Infinity"``, ``"-Infinity"``), its ``step`` and an ISO-8601 UTC
``timestamp``; ``configs`` holds one JSON object per run (the knobs at its start, the
knob changes, where and how it ran, and trackio's own ``_Created`` and ``_Group``).

Never: import trackio, write into a database trackio has not brought to schema 2, or
touch other runs of the project (exporting a run again replaces only that run's rows).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sqlite3
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["SCHEMA_VERSION", "project_db", "trackio_dir", "write_trackio"]

#: trackio's schema version this export writes (``PRAGMA user_version``; trackio 0.43.0)
SCHEMA_VERSION = 2

# trackio 0.43.0 sqlite_storage._RUN_ID_TABLES, verbatim but for IF NOT EXISTS; trackio's
# own init_db adds its other tables (traces, artifacts, ...) when it opens the file.
_DDL = """
CREATE TABLE IF NOT EXISTS metrics (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, timestamp TEXT NOT NULL,
    run_name TEXT NOT NULL, step INTEGER NOT NULL, metrics TEXT NOT NULL,
    log_id TEXT, space_id TEXT
);
CREATE INDEX IF NOT EXISTS idx_metrics_run_step ON metrics(run_id, step);
CREATE INDEX IF NOT EXISTS idx_metrics_run_timestamp ON metrics(run_id, timestamp);
CREATE UNIQUE INDEX IF NOT EXISTS idx_metrics_log_id ON metrics(log_id)
    WHERE log_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS idx_metrics_pending ON metrics(space_id)
    WHERE space_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS configs (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, run_name TEXT NOT NULL,
    config TEXT NOT NULL, created_at TEXT NOT NULL, UNIQUE(run_id)
);
CREATE INDEX IF NOT EXISTS idx_configs_run_name ON configs(run_name);
CREATE TABLE IF NOT EXISTS system_metrics (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, timestamp TEXT NOT NULL,
    run_name TEXT NOT NULL, metrics TEXT NOT NULL, log_id TEXT, space_id TEXT
);
CREATE INDEX IF NOT EXISTS idx_system_metrics_run_timestamp
    ON system_metrics(run_id, timestamp);
CREATE TABLE IF NOT EXISTS alerts (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, timestamp TEXT NOT NULL,
    run_name TEXT NOT NULL, title TEXT NOT NULL, text TEXT,
    level TEXT NOT NULL DEFAULT 'warn', step INTEGER, alert_id TEXT
);
CREATE INDEX IF NOT EXISTS idx_alerts_run ON alerts(run_id);
"""

# trackio refuses these project names: they would share its parquet sidecar files
_RESERVED_SUFFIXES = (
    "_system",
    "_configs",
    "_traces",
    "_artifacts",
    "_artifact_versions",
    "_artifact_aliases",
    "_run_artifact_links",
    "_external_run_artifact_links",
)


def trackio_dir() -> Path:
    """Where trackio keeps its projects: ``$TRACKIO_DIR``, else ``$HF_HOME/trackio``
    (``HF_HOME`` defaulting to ``$XDG_CACHE_HOME/huggingface``, ``~/.cache/huggingface``),
    as trackio and huggingface_hub resolve them."""
    if os.environ.get("TRACKIO_DIR"):
        return Path(os.environ["TRACKIO_DIR"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    hf_home = os.environ.get("HF_HOME") or os.path.join(cache, "huggingface")
    return Path(os.path.expandvars(os.path.expanduser(hf_home))) / "trackio"


def project_db(project: str, directory: str | Path | None = None) -> Path:
    """The database file of trackio project ``project``; ``ValueError`` for a name
    trackio would refuse."""
    safe = "".join(c for c in str(project) if c.isalnum() or c in "-_").rstrip() or "default"
    if safe.startswith("registry-") or any(
        len(safe) > len(s) and safe.endswith(s) for s in _RESERVED_SUFFIXES
    ):
        raise ValueError(
            f"trackio reserves the project name {project!r} (names starting with "
            f"'registry-' or ending with {', '.join(_RESERVED_SUFFIXES)}): choose another"
        )
    base = Path(directory).expanduser() if directory is not None else trackio_dir()
    return base / f"{safe}.db"


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="microseconds")


def _jsonable(v: Any) -> Any:
    """A value as trackio's ``serialize_values`` writes it (orjson, which trackio reads
    with, refuses a bare NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def _open(path: Path) -> sqlite3.Connection:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    except OSError as exc:
        raise OSError(
            f"cannot write the trackio project {path} ({exc}): pass dir= a writable "
            "directory, or set TRACKIO_DIR"
        ) from None
    con = sqlite3.connect(path, timeout=30.0, isolation_level=None)
    try:
        con.execute("PRAGMA journal_mode = WAL")  # what trackio opens its files with
        version = con.execute("PRAGMA user_version").fetchone()[0]
        for table in ("metrics", "configs"):  # checked before any change to the file
            cols = {r[1] for r in con.execute(f"PRAGMA table_info({table})")}
            if cols and "run_id" not in cols:
                raise ValueError(
                    f"{path} was written by trackio before 0.24 (no run ids): open it once "
                    "with a newer trackio (`trackio show`) to migrate it, or export to "
                    "another project"
                )
        con.executescript(_DDL)
        if version == 0:
            con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except BaseException:
        con.close()
        raise
    return con


def _runs_of(rows: Iterable[Any], record: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The rows per run: name, id, config and one metrics dict per step."""
    by: dict[int, list[Any]] = {}
    for r in rows:
        by.setdefault(r.run, []).append(r)
    out = []
    for run, rs in sorted(by.items()):
        start = min(r.time for r in rs)
        rec = record or {}
        name = rec.get("id") or f"run{run}"
        digest = hashlib.sha1(f"{run}:{start!r}".encode()).hexdigest()[:12]
        steps: dict[int, tuple[float, dict[str, Any]]] = {}
        for r in rs:
            t, vals = steps.get(r.step, (r.time, {}))
            vals[f"{r.name}/rank{r.rank}"] = _jsonable(float(r.value))
            steps[r.step] = (min(t, r.time), vals)
        first = min(rs, key=lambda r: (r.segment, r.time))
        knobs = rec.get("knobs") or (first.knobs if first.segment == 0 else {})
        config: dict[str, Any] = {k: _jsonable(v) for k, v in knobs.items()}
        config.update(
            {
                "hvdnb/run": name,
                "hvdnb/ranks": rec.get("ranks") or len({r.rank for r in rs}),
                "hvdnb/knob_changes": _jsonable(rec.get("changes")),
                "hvdnb/backend": rec.get("backend"),
                "hvdnb/device": rec.get("device"),
                "hvdnb/outcome": rec.get("outcome"),
                "hvdnb/notebook": rec.get("notebook"),
                "_Created": _iso(rec.get("started") or start),
                "_Group": rec.get("session"),
            }
        )
        out.append(
            {
                "name": name,
                "id": f"hvdnb-{rec['id']}" if rec.get("id") else f"hvdnb-{digest}",
                "config": config,
                "steps": sorted(steps.items()),
            }
        )
    return out


def write_trackio(
    rows: Iterable[Any],
    project: str,
    directory: str | Path | None = None,
    record: dict[str, Any] | None = None,
) -> Path:
    """Write ``rows`` (``MetricRow``) into trackio project ``project``; returns its file.

    ``record``: the run store's record of the one run the rows hold (its id names the run
    in trackio); without one each run is named ``run<N>``.
    """
    runs = _runs_of(rows, record)
    if not runs:
        raise ValueError(
            "no points to export to trackio: hvdnb.metrics() returned no rows (pick a run "
            "with points: hvdnb.runs() lists them with their point counts)"
        )
    path = project_db(project, directory)
    con = _open(path)
    try:
        con.execute("BEGIN IMMEDIATE")
        try:
            for run in runs:
                con.execute("DELETE FROM metrics WHERE run_id = ?", (run["id"],))
                con.executemany(
                    "INSERT INTO metrics (timestamp, run_id, run_name, step, metrics) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (
                        (_iso(t), run["id"], run["name"], step, json.dumps(vals, allow_nan=False))
                        for step, (t, vals) in run["steps"]
                    ),
                )
                con.execute(
                    "INSERT OR REPLACE INTO configs (run_id, run_name, config, created_at) "
                    "VALUES (?, ?, ?, ?)",
                    (
                        run["id"],
                        run["name"],
                        json.dumps(run["config"], allow_nan=False),
                        datetime.now(timezone.utc).isoformat(),
                    ),
                )
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
    finally:
        con.close()
    return path
