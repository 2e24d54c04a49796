"""The run store on disk: every run of every session, in one SQLite file under ``$HVDNB_HOME``.

Owns: the file (``runs.sqlite``, created 0600, WAL so that two kernels write at once), its
schema, opening it (a corrupt or locked file is left in place, named in one warning, and a
fresh file beside it is used: ``runs-2.sqlite``, ...), writing a batch of points and run
records in one transaction, reading runs and points back, deleting runs, and the size
bound (the oldest finished runs go first, each deletion said in a warning).

Why SQLite from the standard library, not trackio: trackio 0.43 (a 3.1 MB wheel) declares
gradio-client, huggingface-hub, httpx, uvicorn[standard], starlette, pillow, orjson and
brotli: a web stack in every notebook kernel, for a store ``sqlite3`` already gives.

Never: run on the panel's or the cell's path (``runlog``'s writer thread calls the writes;
reads are the user's own calls), delete a file, or raise into training: a fault is a
warning and the run store steps aside.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import warnings
from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hvdnb.config import get_config

__all__ = ["Batch", "RunStore", "StoreUnavailable", "home"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY, session TEXT, run INTEGER, notebook TEXT, cell INTEGER,
    started REAL, ended REAL, ranks INTEGER, backend TEXT, device TEXT,
    knobs TEXT, changes TEXT, steps INTEGER, last_loss REAL, outcome TEXT,
    points INTEGER DEFAULT 0, source TEXT
);
CREATE TABLE IF NOT EXISTS points (
    run TEXT, name TEXT, n INTEGER, ranks BLOB, steps BLOB, times BLOB, vals BLOB
);
CREATE INDEX IF NOT EXISTS points_run ON points (run, name);
"""

#: the columns of ``runs``, in order (``hvdnb.runs()``'s columns)
RUN_FIELDS = (
    "id",
    "session",
    "run",
    "notebook",
    "cell",
    "started",
    "ended",
    "ranks",
    "backend",
    "device",
    "knobs",
    "changes",
    "steps",
    "last_loss",
    "outcome",
    "points",
    "source",
)


class StoreUnavailable(RuntimeError):
    """No run store could be opened (``HVDNB_HOME`` unwritable, every candidate file bad)."""


def home() -> Path:
    """``$HVDNB_HOME``, default ``~/.hvdnb``."""
    h = get_config().home
    return Path(h).expanduser() if h else Path.home() / ".hvdnb"


class Batch:
    """The points of one commit: per run and metric, the ranks, steps, times and values of
    every message in typed columns, written as one row of four blobs. At 1,024 ranks a row
    per point (or per message) cost the writer thread a Python object per point and
    slowed the panel's redraws; a row per metric and commit costs a few C-speed appends
    per message."""

    def __init__(self) -> None:
        self.cols: dict[tuple[str, str], tuple[array[int], array[int], array[float], array[float]]]
        self.cols = {}

    def __bool__(self) -> bool:
        return bool(self.cols)

    def add(self, run: str, rank: int, name: str, steps: Any, times: Any, values: Any) -> int:
        """Add one column of a rank's message; returns its points. ``ValueError`` /
        ``TypeError`` when it is not three columns of numbers of one length (None: NaN)."""
        st = steps if type(steps) is array and steps.typecode == "q" else array("q", steps)
        ti = times if type(times) is array and times.typecode == "d" else array("d", times)
        if type(values) is array and values.typecode == "d":
            va = values
        else:
            va = array("d", (math.nan if v is None else v for v in values))
        n = len(st)
        if not n == len(ti) == len(va):
            raise ValueError("columns of different lengths")
        c = self.cols.get((run, name))
        if c is None:
            c = self.cols[(run, name)] = (array("q"), array("q"), array("d"), array("d"))
        c[0].extend(array("q", [rank]) * n)
        c[1].extend(st)
        c[2].extend(ti)
        c[3].extend(va)
        return n

    def rows(self) -> list[tuple[str, str, int, bytes, bytes, bytes, bytes]]:
        return [
            (run, name, len(c[1]), *(a.tobytes() for a in c))  # type: ignore[misc]
            for (run, name), c in self.cols.items()
        ]


#: each table's columns as ``_SCHEMA`` makes them (a file made by another hvdnb version
#: may have others: "CREATE TABLE IF NOT EXISTS" keeps its old table)
_COLUMNS = {
    "runs": RUN_FIELDS,
    "points": ("run", "name", "n", "ranks", "steps", "times", "vals"),
}


def _check_columns(con: sqlite3.Connection) -> None:
    """Raise ``sqlite3.DatabaseError`` when a table's columns are not this version's: a
    store written by another hvdnb version is left alone (a fresh file is used beside
    it), never written with rows that do not fit (the points table once changed from a
    row per point to a row per run and metric)."""
    for table, want in _COLUMNS.items():
        have = tuple(r[1] for r in con.execute(f"PRAGMA table_info({table})"))
        if have and have != want:  # none: a new file, the schema makes the table
            raise sqlite3.DatabaseError(
                f"its {table} table has the columns ({', '.join(have)}) of another hvdnb "
                f"version, not ({', '.join(want)})"
            )


def _connect(path: Path) -> sqlite3.Connection:
    """Open (creating 0600) and check ``path``; raises ``sqlite3.DatabaseError`` when it
    is not a usable run store (corrupt, locked past the busy timeout, not SQLite)."""
    # create it 0600, but never open and close an existing file by hand: closing any
    # descriptor of a file drops every POSIX lock this process holds on it, the session's
    # open connection's too; another process closing its own last connection then took
    # itself for the last one and removed the -wal and -shm files from under ours, and
    # the next statement here failed with "disk I/O error" (seen in a whole suite run)
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    con = sqlite3.connect(path, timeout=5.0, isolation_level=None, check_same_thread=False)
    try:
        con.execute("PRAGMA busy_timeout = 5000")
        _check_columns(con)  # before anything is changed in a file of another version
        mode = con.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.DatabaseError(f"journal mode is {mode}, not wal")
        con.execute("PRAGMA synchronous = NORMAL")
        con.executescript(_SCHEMA)
        con.execute("SELECT count(*) FROM runs").fetchone()
    except BaseException:
        con.close()
        raise
    return con


class RunStore:
    """One open run store file; every method may be called from any thread (one
    connection each call site: the writer thread keeps its own)."""

    def __init__(self, directory: Path | None = None, max_mb: float | None = None) -> None:
        self.directory = directory if directory is not None else home()
        self.max_bytes = int((get_config().runs_max_mb if max_mb is None else max_mb) * 2**20)
        self.path = self._open_first()

    def _open_first(self) -> Path:
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(
                f"cannot create the run store directory {self.directory} ({exc}): set "
                "HVDNB_HOME to a writable directory"
            ) from None
        bad: list[str] = []
        for i in range(1, 10):
            path = self.directory / ("runs.sqlite" if i == 1 else f"runs-{i}.sqlite")
            try:
                _connect(path).close()
            except PermissionError as exc:
                raise StoreUnavailable(
                    f"cannot write the run store {path} ({exc}): set HVDNB_HOME to a "
                    "writable directory"
                ) from None
            except (sqlite3.DatabaseError, OSError) as exc:
                bad.append(f"{path.name} ({exc})")
                continue
            if bad:
                warnings.warn(
                    f"hvdnb: the run store {self.directory / 'runs.sqlite'} could not be used: "
                    f"{'; '.join(bad)}. It is left in place; this session's runs go to {path}. "
                    "Move the bad file away (or delete it) to go back to runs.sqlite.",
                    stacklevel=4,
                )
            return path
        raise StoreUnavailable(f"no usable run store in {self.directory}: {'; '.join(bad)}")

    def connect(self) -> sqlite3.Connection:
        """A new connection to the store in use."""
        return _connect(self.path)

    # ------------------------------------------------------------------ writes
    @staticmethod
    def write(con: sqlite3.Connection, points: Batch, runs: Iterable[dict[str, Any]]) -> None:
        """Append ``points`` and upsert ``runs`` (dicts of ``RUN_FIELDS``) in one
        transaction."""
        con.execute("BEGIN IMMEDIATE")
        try:
            if points:
                con.executemany("INSERT INTO points VALUES (?, ?, ?, ?, ?, ?, ?)", points.rows())
            for r in runs:
                row = [r.get(f) for f in RUN_FIELDS]
                for i in (RUN_FIELDS.index("knobs"), RUN_FIELDS.index("changes")):
                    row[i] = json.dumps(row[i] if row[i] is not None else {})
                con.execute(
                    f"INSERT OR REPLACE INTO runs VALUES ({', '.join('?' * len(RUN_FIELDS))})",
                    row,
                )
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise

    def delete(self, ids: Sequence[str]) -> list[str]:
        """Delete runs and their points; returns the ids that were there."""
        con = self.connect()
        try:
            found = [
                i for i in ids if con.execute("SELECT 1 FROM runs WHERE id = ?", (i,)).fetchone()
            ]
            con.execute("BEGIN IMMEDIATE")
            for i in found:
                con.execute("DELETE FROM points WHERE run = ?", (i,))
                con.execute("DELETE FROM runs WHERE id = ?", (i,))
            con.execute("COMMIT")
            return found
        finally:
            con.close()

    def used_bytes(self, con: sqlite3.Connection) -> int:
        """Bytes the store's pages hold (free pages, reused by later writes, not counted)."""
        size = con.execute("PRAGMA page_size").fetchone()[0]
        pages = con.execute("PRAGMA page_count").fetchone()[0]
        free = con.execute("PRAGMA freelist_count").fetchone()[0]
        return int(size * (pages - free))

    def prune(self, con: sqlite3.Connection, keep: set[str]) -> list[str]:
        """Past the size bound: delete the oldest finished runs (never those in ``keep``)
        until the store is under 90 % of it; returns the ids deleted."""
        if self.max_bytes <= 0 or self.used_bytes(con) <= self.max_bytes:
            return []
        gone: list[str] = []
        olds = [r[0] for r in con.execute("SELECT id FROM runs ORDER BY started")]
        for rid in olds:
            if rid in keep:
                continue
            con.execute("DELETE FROM points WHERE run = ?", (rid,))
            con.execute("DELETE FROM runs WHERE id = ?", (rid,))
            gone.append(rid)
            if self.used_bytes(con) <= 0.9 * self.max_bytes:
                break
        if gone:
            warnings.warn(
                f"hvdnb: the run store passed its bound of {self.max_bytes / 2**20:g} MB "
                f"(HVDNB_RUNS_MAX_MB): deleted the {len(gone)} oldest run(s): "
                f"{', '.join(gone[:10])}{' ...' if len(gone) > 10 else ''}",
                stacklevel=2,
            )
        return gone

    # ------------------------------------------------------------------ reads
    def runs(self) -> list[dict[str, Any]]:
        """Every run, oldest first, as dicts of ``RUN_FIELDS`` (knobs and changes
        decoded)."""
        con = self.connect()
        try:
            rows = con.execute(
                f"SELECT {', '.join(RUN_FIELDS)} FROM runs ORDER BY started, id"
            ).fetchall()
        finally:
            con.close()
        out = []
        for row in rows:
            r = dict(zip(RUN_FIELDS, row))
            r["knobs"] = json.loads(r["knobs"] or "{}")
            r["changes"] = json.loads(r["changes"] or "[]")
            out.append(r)
        return out

    def run(self, rid: str) -> dict[str, Any]:
        """One run's record; ``KeyError`` naming the known ids when there is none."""
        for r in self.runs():
            if r["id"] == rid:
                return r
        known = [r["id"] for r in self.runs()][-5:]
        raise KeyError(
            f"no run {rid!r} in the run store {self.path}: hvdnb.runs() lists them"
            + (f" (the newest: {', '.join(known)})" if known else " (it is empty)")
        )

    def points(
        self, rid: str, name: str | None = None, rank: int | None = None
    ) -> list[tuple[int, str, int, float, float]]:
        """(rank, name, step, time, value) of one run, by rank, name, arrival."""
        q = "SELECT name, ranks, steps, times, vals FROM points WHERE run = ?"
        args: list[Any] = [rid]
        if name is not None:
            q += " AND name = ?"
            args.append(name)
        con = self.connect()
        try:
            rows = con.execute(q + " ORDER BY rowid", args).fetchall()
        finally:
            con.close()
        out: list[tuple[int, str, int, float, float]] = []
        for n, rb, sb, tb, vb in rows:
            ranks, steps, times, vals = array("q"), array("q"), array("d"), array("d")
            ranks.frombytes(rb)
            steps.frombytes(sb)
            times.frombytes(tb)
            vals.frombytes(vb)
            out.extend(
                (r, n, st, t, v)
                for r, st, t, v in zip(ranks, steps, times, vals)
                if rank is None or r == rank
            )
        out.sort(key=lambda p: (p[0], p[1]))  # stable: arrival order within a series
        return out
