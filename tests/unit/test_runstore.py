"""The run store (``hvdnb/notebook/metrics/runstore.py``, ``runlog.py``, ``history.py``):
runs written by the writer thread, read back from a fresh store, across processes, past
faults; each test with its own ``HVDNB_HOME``."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import stat
import warnings
from pathlib import Path
from typing import Any

import pytest

from hvdnb.notebook.metrics.runlog import outcome_of, stored_rows
from hvdnb.notebook.metrics.runstore import RunStore, StoreUnavailable
from hvdnb.notebook.metrics.store import MetricsStore
from hvdnb.protocol import jsonl

pytestmark = [pytest.mark.timeout(60)]

KNOBS = {
    "lr": {"kind": "float", "min": 0.0, "max": 1.0, "value": 0.1},
    "batch_size": {"kind": "int", "min": 1, "max": 4096, "value": 32},
}


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    monkeypatch.setenv("HVDNB_HOME", str(h))
    return h


def _log_run(st: MetricsStore, cell: int, steps: int, ranks: int = 2, pid: int = 1) -> None:
    """A cell whose loop logs ``steps`` losses on each rank, in messages of 10 steps, and
    changes batch_size at step 20."""
    st.knob_spec = {k: dict(v) for k, v in KNOBS.items()}
    st.begin_cell(cell)
    seq = {r: 0 for r in range(ranks)}
    for a in range(0, steps, 10):
        if a == 20:
            for r in range(ranks):
                st.on_applied({"rank": r, "step": 20, "values": {"batch_size": 64}})
        for r in range(ranks):
            seq[r] += 1
            b = min(a + 10, steps)
            cols = {
                "loss": [
                    list(range(a, b)),
                    [1000.0 + s for s in range(a, b)],
                    [1.0 / (s + 1) for s in range(a, b)],
                ],
                "samples": [list(range(a, b)), [1000.0 + s for s in range(a, b)], [32.0] * (b - a)],
            }
            st.ingest({"rank": r, "seq": seq[r], "pid": pid * 100 + cell, "cols": cols})
    st.end_cell("done")


def test_a_run_is_on_disk_with_its_knobs_and_points(home):
    st = MetricsStore(keep_runs=True)
    _log_run(st, cell=1, steps=50)
    store = st.run_log.store()  # flushes the writer thread's queue first
    assert store.path == home / "runs.sqlite"
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600
    for side in ("-wal", "-shm"):  # SQLite gives its side files the database's mode
        f = Path(f"{store.path}{side}")
        assert not f.exists() or stat.S_IMODE(os.stat(f).st_mode) == 0o600
    con = sqlite3.connect(store.path)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    con.close()
    # a fresh store (another kernel) reads what this one wrote
    other = RunStore()
    (run,) = other.runs()
    assert run["id"] == st.run_log.key(1) and run["run"] == 1 and run["cell"] == 1
    assert run["knobs"] == {"lr": 0.1, "batch_size": 32}
    assert [c[:2] for c in run["changes"]] == [[20, {"batch_size": 64}]] * 2
    assert (run["steps"], run["points"], run["outcome"]) == (49, 200, "done")
    assert run["last_loss"] == pytest.approx(1 / 50)
    rows = stored_rows(other, run["id"], "loss")
    assert len(rows) == 100 and [r.step for r in rows if r.rank == 1] == list(range(50))
    assert {r.segment for r in rows if r.step < 20} == {0}
    assert {(r.segment, r.knobs["batch_size"]) for r in rows if r.step >= 20} == {(1, 64)}
    # the same rows as this session's own hvdnb.metrics() gives
    live = [(r.rank, r.step, r.value, r.segment, r.knobs) for r in st.rows("loss", run=1)]
    assert [(r.rank, r.step, r.value, r.segment, r.knobs) for r in rows] == live


def test_runs_newest_last_delete_and_pins(home):
    st = MetricsStore(keep_runs=True)
    for cell in (1, 2, 3):
        _log_run(st, cell, steps=30)
    store = st.run_log.store()
    ids = [r["id"] for r in store.runs()]
    assert ids == [st.run_log.key(i) for i in (1, 2, 3)]
    assert store.delete([ids[0], "nope-1"]) == [ids[0]]
    assert [r["id"] for r in store.runs()] == ids[1:]
    v = st.version
    assert st.run_log.pin([ids[1]]) == [ids[1]] and st.version > v
    (c,) = st.pinned_curves()
    assert c["earlier"] and c["label"].startswith(ids[1]) and "batch_size=32" in c["label"]
    assert c["xs"] == [float(s) for s in range(30)]
    assert c["ys"] == pytest.approx([1.0 / (s + 1) for s in range(30)])  # mean of 2 ranks
    (cs,) = st.pinned_curves(x="samples")
    assert cs["xs"][-1] == 30 * 2 * 32.0
    with pytest.raises(KeyError, match="hvdnb.runs"):
        st.run_log.pin(["nope-1"])


def test_outcome_of_a_cell():
    assert outcome_of({}) == "done"
    assert outcome_of({1: {"ename": "KeyboardInterrupt", "interrupted": True}}) == "interrupted"
    assert outcome_of({0: {"ename": "TrainingStopped"}, 1: {"ename": "X"}}) == "stopped"
    assert outcome_of({0: {"ename": "ValueError"}}) == "error"


def _log_beside_a_bad_file() -> tuple[MetricsStore, Any, list[str]]:
    """Log a run of 20 steps on 4 ranks while runs.sqlite is unusable: the live store, the
    run store it fell back to, and the warnings' texts."""
    st = MetricsStore(keep_runs=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _log_run(st, cell=1, steps=20)
        store = st.run_log.store()
    return st, store, [str(w.message) for w in caught]


def test_a_corrupt_file_is_left_and_a_fresh_one_used(home):
    home.mkdir()
    bad = home / "runs.sqlite"
    junk = b"this is not a database, but somebody's notes" * 100
    bad.write_bytes(junk)
    st, store, texts = _log_beside_a_bad_file()
    assert any("runs.sqlite" in t and "left in place" in t and "runs-2.sqlite" in t for t in texts)
    assert bad.read_bytes() == junk  # nothing deleted or rewritten
    assert store.path == home / "runs-2.sqlite"
    assert [r["points"] for r in store.runs()] == [80]
    assert st.points == 80  # the live store went on


def test_a_store_of_another_hvdnb_version_is_left_and_a_fresh_one_used(home):
    """A file whose tables have other columns (the points table was once a row per point)
    is never written with rows that do not fit: it is left as it is, runs-2 is used."""
    import sqlite3

    home.mkdir()
    old = home / "runs.sqlite"
    con = sqlite3.connect(old)
    con.execute(
        "CREATE TABLE points (run TEXT, rank INTEGER, step INTEGER, name TEXT, t REAL, v REAL)"
    )
    con.execute("INSERT INTO points VALUES ('abc-1', 0, 0, 'loss', 0.0, 1.0)")
    con.commit()
    con.close()
    before = old.read_bytes()
    _, store, texts = _log_beside_a_bad_file()
    assert any("another hvdnb version" in t and "runs-2.sqlite" in t for t in texts), texts
    assert old.read_bytes() == before
    assert store.path == home / "runs-2.sqlite"
    assert [r["points"] for r in store.runs()] == [80]


def test_an_unwritable_home_warns_once_and_keeps_runs_in_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("HVDNB_HOME", str(blocker / "home"))  # a directory under a file
    st = MetricsStore(keep_runs=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _log_run(st, cell=1, steps=20)
        with pytest.raises(StoreUnavailable, match="HVDNB_HOME"):
            st.run_log.store()
        _log_run(st, cell=2, steps=20)
        with pytest.raises(StoreUnavailable):
            st.run_log.store()
    assert sum("memory only" in str(w.message) for w in caught) == 1
    assert st.points == 160 and [r["id"] for r in st.runs] == [1, 2]  # today's behaviour


def test_the_size_bound_deletes_the_oldest_runs(home):
    st = MetricsStore(keep_runs=True)
    _log_run(st, cell=1, steps=20)
    store = st.run_log.store()
    store.max_bytes = 1  # any run is past it: all but the live ones go, oldest first
    con = store.connect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.prune(con, keep=set()) == [st.run_log.key(1)]
    con.close()
    assert any("HVDNB_RUNS_MAX_MB" in str(w.message) for w in caught)
    assert store.runs() == []


def _writer(home: str, n: int) -> None:  # another process: its own kernel's store
    os.environ["HVDNB_HOME"] = home
    st = MetricsStore(keep_runs=True)
    for cell in range(1, n + 1):
        _log_run(st, cell, steps=200, pid=os.getpid())
    st.run_log.store()


def test_two_processes_write_at_once(home):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(home), 5)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(50)
        assert p.exitcode == 0
    runs = RunStore().runs()
    assert len(runs) == 10 and len({r["session"] for r in runs}) == 2
    assert [r["points"] for r in runs] == [800] * 10
    con = sqlite3.connect(home / "runs.sqlite")
    assert con.execute("SELECT sum(n) FROM points").fetchone()[0] == 8000
    con.close()


def test_to_tensorboard_reads_back(home, tmp_path):
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from hvdnb.notebook.metrics.tboard import RunRows

    st = MetricsStore(keep_runs=True)
    _log_run(st, cell=1, steps=30)
    rid = st.run_log.key(1)
    out = RunRows(st.stored_rows(rid)).to_tensorboard(tmp_path / "tb")
    for rank in (0, 1):
        ea = ea_mod.EventAccumulator(str(out / "run1" / f"rank{rank}"))
        ea.Reload()
        loss = ea.Scalars("loss")
        assert [e.step for e in loss] == list(range(30))
        assert loss[5].value == pytest.approx(1 / 6)
        assert len(ea.Scalars("samples")) == 30
    ea = ea_mod.EventAccumulator(str(out / "run1" / "rank0"))
    ea.Reload()
    content = ea.PluginTagToContent("hparams")
    assert content and b"batch_size" in b"".join(content.values())


def test_import_a_batch_run(home, tmp_path):
    from hvdnb.notebook.metrics import history

    d = tmp_path / "out"
    d.mkdir()
    for rank in (0, 1):
        with (d / f"rank{rank}.jsonl").open("w") as f:
            for seq, a in enumerate(range(0, 40, 10), 1):
                msg = {
                    "kind": "metrics",
                    "rank": rank,
                    "seq": seq,
                    "pid": 4242 + rank,
                    "t": 1000.0 + a,
                    "cols": {"loss": [list(range(a, a + 10)), [1.0] * 10, [float(a)] * 10]},
                }
                f.write(jsonl.dumps_line(msg) + "\n")
    ids = history.import_runs(d)
    assert len(ids) == 1 and ids == history.import_runs(d)  # again: replaced, not copied
    # the session's run store, where import_runs wrote: it was opened when the session's
    # store first kept a run, so in a whole suite under the session's HVDNB_HOME, not this
    # test's (other tests' runs may be there too)
    from hvdnb.notebook.metrics.store import get_store

    store = get_store().run_log.store()
    (run,) = [r for r in store.runs() if r["source"] == f"batch {d.resolve()}"]
    assert run["id"] == ids[0]
    assert (run["ranks"], run["steps"], run["points"]) == (2, 39, 80)
    assert len(stored_rows(store, ids[0], "loss")) == 80


def test_no_store_for_stores_that_do_not_keep_runs(home):
    st = MetricsStore()  # tests, benches, hvdnb.metrics.load
    _log_run(st, cell=1, steps=20)
    with pytest.raises(StoreUnavailable):
        st.run_log.store()
    assert not Path(home).exists()


def test_a_locked_file_is_left_and_a_fresh_one_used(home):
    """Another program holds runs.sqlite locked (a rollback-journal database in an
    exclusive transaction): past the 5 s busy timeout this session writes beside it."""
    home.mkdir()
    other = sqlite3.connect(home / "runs.sqlite", isolation_level=None)
    other.execute("CREATE TABLE mine (x)")
    other.execute("BEGIN EXCLUSIVE")
    other.execute("INSERT INTO mine VALUES (1)")
    try:
        st = MetricsStore(keep_runs=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _log_run(st, cell=1, steps=20)
            store = st.run_log.store()
        assert store.path == home / "runs-2.sqlite"
        assert any("locked" in str(w.message) and "left in place" in str(w.message) for w in caught)
        assert [r["points"] for r in store.runs()] == [80]
    finally:
        other.execute("COMMIT")
        other.close()
    con = sqlite3.connect(home / "runs.sqlite")
    assert con.execute("SELECT x FROM mine").fetchall() == [(1,)]  # untouched
    con.close()


def _crasher(home: str) -> None:  # a kernel killed mid-run (an out-of-memory kill)
    import signal
    import time

    os.environ["HVDNB_HOME"] = home
    st = MetricsStore(keep_runs=True)
    st.knob_spec = {k: dict(v) for k, v in KNOBS.items()}
    st.begin_cell(1)
    for s in range(5):
        st.ingest({"rank": 0, "seq": s + 1, "pid": 7, "cols": {"loss": [[s], [1.0 * s], [0.5]]}})
    time.sleep(4 * 0.5)  # a few commits of the writer thread; the cell never ends
    os.kill(os.getpid(), signal.SIGKILL)


def test_what_was_written_survives_a_kill(home):
    p = multiprocessing.get_context("spawn").Process(target=_crasher, args=(str(home),))
    p.start()
    p.join(50)
    assert p.exitcode == -9
    (run,) = RunStore().runs()
    assert (run["points"], run["steps"], run["outcome"], run["ended"]) == (5, 4, None, None)
    assert run["knobs"] == {"lr": 0.1, "batch_size": 32}
    assert [r.step for r in stored_rows(RunStore(), run["id"])] == [0, 1, 2, 3, 4]


def test_dist_runs_delete_and_compare(shell, home, capsys):
    from IPython.core.error import UsageError

    from hvdnb.notebook.metrics.store import get_store

    st = get_store()
    _log_run(st, cell=901, steps=20)
    rid = st.run_log.key(st.run_id)
    shell.run_line_magic("dist", "runs")
    assert rid in capsys.readouterr().out
    shell.run_line_magic("dist", f"compare {rid}")
    assert f"pinned to the runs chart: {rid}" in capsys.readouterr().out
    assert [c["id"] for c in st.pinned_curves()] == [rid]
    shell.run_line_magic("dist", "compare")
    assert st.pinned_curves() == []
    with pytest.raises(UsageError, match="no run 'nope-1'"):
        shell.run_line_magic("dist", "compare nope-1")
    with pytest.raises(UsageError, match="expected at least one"):
        shell.run_line_magic("dist", "runs --delete")
    shell.run_line_magic("dist", f"runs --delete {rid}")
    assert f"deleted 1 run: {rid}" in capsys.readouterr().out
    with pytest.raises(UsageError, match="no run nope-2"):
        shell.run_line_magic("dist", "runs --delete nope-2")


def test_to_trackio_writes_trackios_schema(home, tmp_path):
    """The export read back with sqlite3 against trackio 0.43.0's schema (version 2,
    ``sqlite_storage.py``): one metrics row per step holding every rank's values, the
    knobs as the run's config; a second export replaces the run, other runs stay."""
    import json
    from datetime import datetime

    from hvdnb.notebook.metrics.tboard import RunRows

    st = MetricsStore(keep_runs=True)
    _log_run(st, cell=1, steps=30)
    _log_run(st, cell=2, steps=10)
    rid, rid2 = st.run_log.key(1), st.run_log.key(2)
    rows = RunRows(st.stored_rows(rid))
    assert rows.record is not None and rows.record["id"] == rid
    db = rows.to_trackio("my.tuning", dir=tmp_path / "tk")
    assert db == tmp_path / "tk" / "mytuning.db"  # trackio's canonical project name
    assert stat.S_IMODE(db.stat().st_mode) == 0o600
    rows.to_trackio("my.tuning", dir=tmp_path / "tk")  # again: replaces, no copies
    RunRows(st.stored_rows(rid2)).to_trackio("my.tuning", dir=tmp_path / "tk")
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA user_version").fetchone()[0] == 2
    got = con.execute(
        "SELECT run_id, run_name, step, timestamp, metrics FROM metrics WHERE run_name = ? "
        "ORDER BY timestamp, id",
        (rid,),
    ).fetchall()
    assert [g[2] for g in got] == list(range(30))
    assert {g[0] for g in got} == {f"hvdnb-{rid}"}
    for step, ts, m in ((g[2], g[3], json.loads(g[4])) for g in got):
        assert datetime.fromisoformat(ts).timestamp() == pytest.approx(1000.0 + step)
        assert sorted(m) == ["loss/rank0", "loss/rank1", "samples/rank0", "samples/rank1"]
        assert m["loss/rank1"] == pytest.approx(1.0 / (step + 1))
    names = [r[0] for r in con.execute("SELECT run_name FROM configs ORDER BY id")]
    assert names == [rid, rid2]
    (cfg,) = con.execute("SELECT config FROM configs WHERE run_name = ?", (rid,)).fetchone()
    cfg = json.loads(cfg)
    assert (cfg["lr"], cfg["batch_size"], cfg["hvdnb/ranks"]) == (0.1, 32, 2)
    assert cfg["hvdnb/knob_changes"][0][:2] == [20, {"batch_size": 64}]
    assert cfg["_Group"] == st.run_log.session
    assert con.execute("SELECT count(*) FROM metrics WHERE run_name = ?", (rid2,)).fetchone() == (
        10,
    )
    con.close()


def test_to_trackio_nan_names_and_empty_rows(tmp_path, monkeypatch):
    """NaN as trackio writes it ("NaN": its orjson reader refuses a bare NaN), this
    session's rows named run<N>, TRACKIO_DIR as the default place, bad names refused."""
    import json
    import math

    from hvdnb.notebook.metrics.rows import MetricRow
    from hvdnb.notebook.metrics.tboard import RunRows

    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "td"))
    rows = RunRows(
        [
            MetricRow(0, 0, "loss", math.nan, 5.0, 3, 0, {"lr": 0.5}),
            MetricRow(0, 1, "loss", math.inf, 6.0, 3, 0, {"lr": 0.5}),
        ]
    )
    db = rows.to_trackio("p")
    assert db == tmp_path / "td" / "p.db"
    con = sqlite3.connect(db)
    got = con.execute("SELECT run_name, metrics FROM metrics ORDER BY step").fetchall()
    assert got == [("run3", '{"loss/rank0": "NaN"}'), ("run3", '{"loss/rank0": "Infinity"}')]
    assert json.loads(con.execute("SELECT config FROM configs").fetchone()[0])["lr"] == 0.5
    con.close()
    with pytest.raises(ValueError, match="reserves the project name"):
        rows.to_trackio("registry-x")
    with pytest.raises(ValueError, match="no points to export"):
        RunRows().to_trackio("p")
    old = sqlite3.connect(tmp_path / "td" / "old.db")  # trackio < 0.24: runs by name only
    old.execute("CREATE TABLE metrics (id INTEGER PRIMARY KEY, timestamp TEXT, run_name TEXT)")
    old.close()
    with pytest.raises(ValueError, match="before 0.24 .* migrate it"):
        rows.to_trackio("old")
    old = sqlite3.connect(tmp_path / "td" / "old.db")
    assert [r[0] for r in old.execute("SELECT name FROM sqlite_master")] == ["metrics"]
    old.close()


def _open_write_close(path: str) -> None:
    """Another process (a notebook kernel, a batch import): open the store, write, close."""
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA journal_mode = WAL")
    con.execute("CREATE TABLE IF NOT EXISTS other (x)")
    con.execute("INSERT INTO other VALUES (1)")
    con.close()


def test_opening_the_store_again_keeps_the_open_connections_locks(home):
    """A session keeps one connection open (its writer); opening the same store again in
    the same process (``%dist runs``, ``import_runs``) must not drop that connection's
    POSIX locks: closing any descriptor of the file drops all of them, and another process
    closing its last connection then removed the -wal and -shm files from under ours ("disk
    I/O error" on the next statement; seen in a whole suite run)."""
    store = RunStore()
    kept = store.connect()  # the session's writer connection
    kept.execute("SELECT count(*) FROM runs").fetchone()
    ctx = multiprocessing.get_context("spawn")
    for _ in range(2):
        again = store.connect()  # %dist runs, import_runs: a second connection, closed
        again.close()
        p = ctx.Process(target=_open_write_close, args=(str(store.path),))
        p.start()
        p.join(50)
        assert p.exitcode == 0
        assert kept.execute("SELECT count(*) FROM runs").fetchone() == (0,)
    assert (home / "runs.sqlite-wal").exists() and (home / "runs.sqlite-shm").exists()
    kept.close()
