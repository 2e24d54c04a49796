"""The notebook's metrics store: every point the ranks sent, and ``hvdnb.metrics()``.

``MetricsStore`` is a thin facade over the objects it owns, each handed only what it
needs and owning its own fields:

- ``PointStore`` (``points``): the points in typed columns, the one lock, ``version``;
- ``Link`` (``link``): the cluster and channel it is fed from, what each rank said of
  itself (``rank_info``), where plans go;
- ``Runs`` (``runs``): runs and knob segments, the current run, the cell running;
- ``KnobSpec`` and ``KnobRequests`` (``knobreq``): the announced knobs, requests, plans,
  applications;
- ``Alarms`` (``alarms``): the watchers, their lines and the stop they ask for;
- ``Ingest`` (``ingest``): the channel thread's messages in;
- ``Views`` (``views``): what the panel and ``%dist`` read (breakdown, hint, comm, hosts);
- ``build_rows`` (``rows``): the rows of ``hvdnb.metrics()`` with their exports;
- ``RunLog`` (``runlog``): the notebook's store only (``keep_runs``): every run written to
  the run store on disk (``runstore``) by a writer thread, and runs pinned from it.

This module wires them (who gets what is in ``MetricsStore.__init__``), clears them,
connects a cluster's side channel, and holds the notebook's one store (``get_store``,
``attach``), ``hvdnb.metrics``, ``hvdnb.set_knobs`` and ``hvdnb.watch``.

One-way with the cluster: ``hvdnb.notebook.cluster`` imports this module, never the
reverse. Its narrow interface is three calls: a cluster ``attach``es the store when it
starts, the cluster package hands ``follow`` the function that says which cluster is
current (so the store follows a restart's new channel), and health reads
``get_store().rank_info``. Of a cluster the store reads only ``channel``, ``client.ids``,
``hosts_seen`` and what it is (``n``, ``backend``, ``device``).

Never: import torch, widgets or the cluster's modules; block the
channel thread; invent a value: a reading a rank did not send is None (shown as "n/a") or
NaN, not 0; hold state of its own beyond its parts.
"""

from __future__ import annotations

import operator
import threading
import warnings
from collections.abc import Callable
from typing import Any

from hvdnb.notebook.metrics.alarms import Alarms
from hvdnb.notebook.metrics.ingest import Ingest
from hvdnb.notebook.metrics.knobreq import KnobRequests, KnobSpec
from hvdnb.notebook.metrics.link import Link
from hvdnb.notebook.metrics.points import PointStore
from hvdnb.notebook.metrics.rows import MetricRow, MetricRows, build_rows
from hvdnb.notebook.metrics.runlog import RunLog, stored_rows
from hvdnb.notebook.metrics.runs import Runs
from hvdnb.notebook.metrics.tboard import RunRows
from hvdnb.notebook.metrics.views import Views
from hvdnb.notebook.metrics.watchers import Alarm, WatchSettings
from hvdnb.protocol import kinds
from hvdnb.protocol.errors import InputTypeError, refusal

__all__ = [
    "MetricRow",
    "MetricRows",
    "MetricsStore",
    "attach",
    "follow",
    "get_store",
    "metrics",
    "set_knobs",
    "watch",
]


class MetricsStore:
    """Every point from every rank, plus runs, knob events and alarms; safe to feed from
    any thread. A facade: each call goes to the part that owns it (module docstring)."""

    def __init__(self, keep_runs: bool = False) -> None:
        self._points = points = PointStore()
        self._link = link = Link()
        self._spec = spec = KnobSpec()
        self._runs = runs = Runs(points, link, spec.values)
        self._knobs = KnobRequests(points, link, runs, spec)
        self._alarms = alarms = Alarms(points, link, runs)
        self._ingest = Ingest(points, link, runs, alarms)
        self._views = Views(points, runs, link)
        self._log = RunLog(points, runs, link, enabled=keep_runs)
        #: a line the panel's header shows now ("rank 1 paused in the debugger ..."), or ""
        self.notice = ""

    def set_notice(self, text: str) -> None:
        """Show ``text`` in the panel's header from its next draw ("" clears it)."""
        if text != self.notice:
            self.notice = text
            self._points.changed()

    # ------------------------------------------------------------ wiring and clearing
    def attach_current(self) -> None:
        """Follow ``hvdnb.current()`` (a restarted cluster has a new channel)."""
        c = _current()
        if c is not None and c.channel is not None and c.channel is not self._link.channel:
            self.attach(c)

    @property
    def cluster(self) -> Any:
        """The cluster this store is fed from (None: none yet)."""
        return self._link.cluster

    def attach(self, cluster: Any) -> None:
        """Feed this store from ``cluster.channel`` (again after a restart: idempotent).

        A new cluster (a start or a restart: a new channel): what the live views say
        (ranks, step, backend, knobs, lost messages) is of this cluster from now on, and no
        run is current until its first cell logs. The points of earlier clusters stay
        (``hvdnb.metrics()``, the runs chart)."""
        link = self._link
        ch = getattr(cluster, "channel", None)
        if ch is None or ch is link.channel:
            link.cluster = cluster
            return
        with self._points.lock:
            link.begin(cluster)
            self._ingest.reset()
            self._spec.reset()
            self._runs.begin_cluster()
            self._points.changed()
        link.cluster = cluster
        link.channel = ch
        ch.on(kinds.METRICS, self.ingest)
        ch.on(kinds.RANK_INFO, self._ingest.on_rank_info)
        ch.on(kinds.KNOBS_SPEC, self._knobs.on_spec)
        ch.on(kinds.KNOBS_PLAN, self._knobs.on_plan)
        ch.on(kinds.KNOBS_APPLIED, self._knobs.on_applied)
        ch.on(kinds.STOP_PLAN, self._alarms.on_stop_plan)

    @property
    def _channel(self) -> Any:
        """The side channel requests and plans go out on (tests and benches set a fake)."""
        return self._link.channel

    @_channel.setter
    def _channel(self, ch: Any) -> None:
        self._link.channel = ch

    def clear(self) -> None:
        """Forget every point, run, knob event and alarm."""
        with self._points.lock:
            self._points.clear()
            self._runs.clear()
            self._knobs.clear()
            self._alarms.clear()
            self._points.changed()

    # ------------------------------------------------------------ points (PointStore)
    @property
    def version(self) -> int:
        """Bumped on every change; the panel redraws when it moves."""
        return self._points.version

    @property
    def points(self) -> int:
        """How many points the store holds."""
        return self._points.points

    def names(self) -> list[str]:
        """Every metric's name."""
        return self._points.names()

    def series(
        self, name: str, rank: int, last: int | None = None, run: int | None = None
    ) -> tuple[list[int], list[float], list[float]]:
        """(steps, values, times) of one metric on one rank in ``run`` (default: the
        current run; -1: every run), the last ``last`` points (copies only those)."""
        return self._points.series(name, rank, self._run(run), last)

    def count(self, name: str, rank: int, run: int | None = None) -> int:
        """How many points of one metric on one rank ``run`` holds (as ``series``)."""
        return self._points.count(name, rank, self._run(run))

    def thinned(
        self, name: str, rank: int, n: int, run: int | None = None
    ) -> tuple[list[float], list[float], int]:
        """``series`` as a chart draws it: at most ~``n`` evenly spaced points (and the
        last); returns (steps, values, stride)."""
        return self._points.thinned(name, rank, n, self._run(run))

    def latest(self, name: str, rank: int) -> float | None:
        """The last value of one metric on one rank (None: none yet)."""
        return self._points.latest(name, rank)

    def rows(
        self, name: str | None = None, rank: int | None = None, run: int | None = None
    ) -> MetricRows:
        """Every point as ``(rank, step, name, value, time, run, segment, knobs)``, ordered
        by rank, name, arrival; ``run`` selects one run."""
        return build_rows(self._points, self._runs, name, rank, run)

    def _run(self, run: int | None) -> int:
        return self._runs.run_id if run is None else run

    # ------------------------------------------------------------ the cluster (Link)
    @property
    def rank_info(self) -> dict[int, dict[str, Any]]:
        """Per rank: what it said of itself (host, local_rank, pid) and of its loop
        (step, step_time, backend, idle, seen)."""
        return self._link.rank_info

    @property
    def cluster_no(self) -> int:
        """How many clusters were attached (0: none yet)."""
        return self._link.number

    @property
    def cluster_info(self) -> dict[str, Any]:
        """The cluster the live views describe: ``{"n", "backend", "device"}``."""
        return self._link.info

    # ------------------------------------------------------------ messages in (Ingest)
    def ingest(self, msg: dict[str, Any]) -> None:
        """Add one ``metrics`` message (and queue it for the run store)."""
        self._ingest.ingest(msg)
        self._log.note(msg)

    def on_rank_info(self, msg: dict[str, Any]) -> None:
        """A rank says where it runs (sent once when its channel connects)."""
        self._ingest.on_rank_info(msg)

    def wait_for(self, marks: dict[int, tuple[int, int]], timeout: float) -> bool:
        """Wait until every rank's message ``seq`` from process ``pid`` (``marks``: rank ->
        (pid, seq)) is here; see ``Ingest.wait_for``."""
        return self._ingest.wait_for(marks, timeout)

    @property
    def messages(self) -> int:
        """``metrics`` messages ingested."""
        return self._ingest.messages

    @property
    def lost_messages(self) -> int:
        """Sequence gaps of the attached cluster's ranks."""
        return self._ingest.lost_messages

    @property
    def lost_rows(self) -> int:
        """Rows the attached cluster's ranks' rings overwrote before they could flush."""
        return self._ingest.lost_rows

    @property
    def arrivals(self) -> list[tuple[float, float]]:
        """(time a loss row was logged on its rank, time it got here), with
        ``keep_arrivals``."""
        return self._ingest.arrivals

    @property
    def keep_arrivals(self) -> bool:
        """Record ``arrivals`` (off by default)."""
        return self._ingest.keep_arrivals

    @keep_arrivals.setter
    def keep_arrivals(self, on: bool) -> None:
        self._ingest.keep_arrivals = on

    # ------------------------------------------------------------ runs (Runs)
    @property
    def run_id(self) -> int:
        """The current run (0: none yet); views read it by default."""
        return self._runs.run_id

    @property
    def runs(self) -> list[dict[str, Any]]:
        """The runs in order: ``{"id", "cell", "started", "knobs", "changes", "marks",
        "hidden", "cluster", "cluster_text"}``."""
        return self._runs.records

    @property
    def cell_no(self) -> int | None:
        """The number of the ``%%distributed`` cell running or last run (None before)."""
        return self._runs.cell_no

    @property
    def marks(self) -> list[tuple[int, str]]:
        """(step, label) of the knob changes applied in the current run."""
        return self._runs.marks

    def mark(self, label: str) -> None:
        """Mark an event of the cluster (an elastic cluster lost ranks) on the running
        run's loss chart, at the latest step a rank's loop reported (none reported: no mark),
        and take the cluster's size again for the header."""
        with self._points.lock:
            steps = [
                int(i["step"])
                for i in self._link.rank_info.values()
                if isinstance(i.get("step"), (int, float))
            ]
            if steps:
                self._runs.mark(max(steps), label)
            # the header's size follows the cluster's (an elastic cluster's new generation)
            if self._link.cluster is not None:
                self._link.info["n"] = getattr(self._link.cluster, "n", self._link.info.get("n"))
            self._points.changed()

    def current_run(self) -> dict[str, Any] | None:
        """The current run's record (None before the first run); see ``runs``."""
        return self._runs.record(self._runs.run_id)

    def begin_cell(self, cell_no: int | None = None) -> None:
        """A ``%%distributed`` cell starts: its first logged point starts a new run."""
        self._runs.begin_cell(cell_no)

    def end_cell(self, outcome: str = "done") -> None:
        """The cell ended (after its last points arrived); ``outcome``: how (``done``,
        ``interrupted``, ``error``, ``stopped``), kept in the run store."""
        self._runs.end_cell()
        self._log.end(outcome)

    def hide_runs(self, keep_last: int = 1) -> int:
        """Take all but the last ``keep_last`` runs off the comparison chart; returns how
        many were hidden."""
        return self._runs.hide(keep_last)

    def run_curves(
        self, x: str = "step", name: str = "loss", last_runs: int = 5, points: int | None = None
    ) -> list[dict[str, Any]]:
        """The visible runs' mean-over-ranks ``name`` per step, for overlaying; see
        ``Runs.curves``."""
        return self._runs.curves(x, name, last_runs, points)

    # ------------------------------------------------------------ the run store (RunLog)
    @property
    def run_log(self) -> RunLog:
        """This session's runs on disk (``hvdnb.runs()``, ``%dist runs``, ``%dist compare``)."""
        return self._log

    def stored_rows(self, rid: str, name: str | None = None, rank: int | None = None) -> MetricRows:
        """A run of the run store (any session) as rows; see ``hvdnb.metrics(run=ID)``."""
        return stored_rows(self._log.store(), rid, name, rank)

    def pinned_curves(self, x: str = "step", points: int | None = None) -> list[dict[str, Any]]:
        """Runs of the run store pinned beside this session's (``%dist compare``)."""
        return self._log.pinned_curves(x, points)

    # ------------------------------------------------------------ knobs (KnobRequests)
    @property
    def knob_spec(self) -> dict[str, dict[str, Any]]:
        """The knobs of the running job: name -> spec, with the value in force."""
        return self._spec.spec

    @knob_spec.setter
    def knob_spec(self, spec: dict[str, dict[str, Any]]) -> None:
        self._spec.spec = spec

    @property
    def knob_events(self) -> list[dict[str, Any]]:
        """Requests, plans, applications and refusals, in order."""
        return self._knobs.events

    @property
    def last_request(self) -> str | None:
        """The id of the latest request sent."""
        return self._knobs.last_request

    def on_spec(self, msg: dict[str, Any]) -> None:
        """The ranks announced their knobs."""
        self._knobs.on_spec(msg)

    def on_plan(self, msg: dict[str, Any]) -> None:
        """Rank 0's decision: record it and forward it to every rank."""
        self._knobs.on_plan(msg)

    def on_applied(self, msg: dict[str, Any]) -> None:
        """A rank applied a change."""
        self._knobs.on_applied(msg)

    def refusal(self, values: dict[str, Any], at_step: int | None = None) -> str | None:
        """Why the knobs refuse ``values`` (at ``at_step``); None when they accept them."""
        return self._knobs.refusal(values, at_step)

    def request_knobs(self, at_step: int | None = None, **values: Any) -> tuple[bool, str]:
        """Ask rank 0 to schedule a change; returns (sent, message). Validated here first."""
        return self._knobs.request(at_step, **values)

    def change_knobs(
        self,
        /,
        *,
        at_step: int | None = None,
        after: float | None = None,
        timeout: float = 3.0,
        **values: Any,
    ) -> dict[str, Any]:
        """``hvdnb.set_knobs`` on this store (see its docstring)."""
        return self._knobs.change(at_step=at_step, after=after, timeout=timeout, **values)

    def knob_status(self, rid: str | None = None) -> dict[str, Any]:
        """For one request (default: the latest): plan and the ranks that applied it."""
        return self._knobs.status(rid)

    # ------------------------------------------------------------ watchers (Alarms)
    @property
    def watch_settings(self) -> WatchSettings:
        """The watch settings in force (``hvdnb.watch``)."""
        return self._alarms.settings

    @property
    def alarms(self) -> list[Alarm]:
        """Every alarm, in the order found (``Alarm.run`` says whose run)."""
        return self._alarms.alarms

    @property
    def stop_events(self) -> list[dict[str, Any]]:
        """Stop requests and rank 0's answers."""
        return self._alarms.stop_events

    @property
    def drift_checks(self) -> int:
        """Comparisons of the ranks' fingerprints made in the current run."""
        return self._alarms.drift_checks

    def set_watch(self, **values: Any) -> WatchSettings:
        """Change the watch settings (``hvdnb.watch``); ``ValueError`` for a bad value."""
        return self._alarms.set(**values)

    def on_stop_plan(self, msg: dict[str, Any]) -> None:
        """Rank 0's answer to a stop request: forward it to every rank."""
        self._alarms.on_stop_plan(msg)

    def take_lines(self, final: bool = False) -> list[str]:
        """The alarm and stop lines to show now in the running cell."""
        return self._alarms.take_lines(final)

    def run_alarms(self, run: int | None = None) -> list[Alarm]:
        """The alarms of ``run`` (default: the current one)."""
        return self._alarms.of_run(run)

    def alarm_lines(self, run: int | None = None) -> list[str]:
        """Each alarm of ``run`` (default: the current one) in words."""
        return self._alarms.lines(run)

    def alarm_marks(self) -> list[tuple[int, str]]:
        """(step, label) of the current run's alarms, for the loss chart."""
        return self._alarms.marks()

    def alarm_summary(self) -> str:
        """The live line's part: ``nan loss r1@57, spike r0@300`` ("" when none)."""
        return self._alarms.summary()

    # ------------------------------------------------------------ views (Views)
    def ranks(self) -> list[int]:
        """The ranks of the attached cluster (every rank heard from, before any)."""
        return self._views.ranks()

    def live_ranks(self) -> list[int]:
        """``ranks()`` less those an elastic cluster went on without (``Views.live_ranks``)."""
        return self._views.live_ranks()

    def per_step(
        self, prefix: str, rank: int, last_steps: int = 50, suffix: str = "/time"
    ) -> dict[int, float]:
        """Per step of the current run, the sum of the metrics ``prefix``...``suffix``
        (or ``prefix`` itself), over the last ``last_steps`` steps."""
        return self._views.per_step(prefix, rank, last_steps, suffix)

    def at_steps(
        self, prefix: str, rank: int, steps: Any, suffix: str = "/time"
    ) -> dict[int, float]:
        """``per_step``'s sums at the given steps of the current run."""
        return self._views.at_steps(prefix, rank, steps, suffix)

    def breakdown(self, last_steps: int = 50) -> dict[int, dict[str, float]]:
        """Median seconds per step on each rank, split into data / compute / comm; see
        ``Views.breakdown``."""
        return self._views.breakdown(last_steps)

    def hint(self, last_steps: int = 50) -> str:
        """One line naming the bottleneck (data, communication or compute) and stragglers."""
        return self._views.hint(last_steps)

    def hosts(self) -> dict[str, list[int]]:
        """Ranks grouped by the host they said they run on (``"?"`` until they say)."""
        return self._views.hosts()

    def host_summary(self, name: str = "loss") -> list[dict[str, Any]]:
        """Per host: its ranks, the step range, and min / median / max of ``name``."""
        return self._views.host_summary(name)

    def collective_times(self, last_steps: int = 50) -> dict[str, dict[int, float]]:
        """Per bucket, per step of the current run: the collective's time."""
        return self._views.collective_times(last_steps)

    def comm_summary(self, last: int = 20) -> list[dict[str, Any]]:
        """Per rank and bucket: collective, own and exposed times, bytes, bus bandwidth."""
        return self._views.comm_summary(last)

    def memory(self) -> dict[int, dict[str, float | None]]:
        """Latest memory and GPU-utilisation readings per rank (None: not reported)."""
        return self._views.memory()

    def throughput(self, window: float = 3.0) -> float | None:
        """Samples per second over every rank in the last ``window`` seconds of logs."""
        return self._views.throughput(window)

    def progress(self) -> tuple[int, int | None]:
        """(latest step seen on any rank, total_steps if the loop said so)."""
        return self._views.progress()


_STORE: MetricsStore | None = None
_SLOCK = threading.Lock()


def _no_cluster() -> Any:
    return None


#: which cluster is current: handed by the cluster package (``follow``) when it is imported;
#: before that no cluster can have started
_current: Callable[[], Any] = _no_cluster


def follow(current: Callable[[], Any]) -> None:
    """Read which cluster is current from ``current`` (``registry.current``): the cluster
    package registers it, so the store never imports the cluster's modules."""
    global _current
    _current = current


def get_store() -> MetricsStore:
    """The notebook's store (one per kernel)."""
    global _STORE
    with _SLOCK:
        if _STORE is None:
            _STORE = MetricsStore(keep_runs=True)
        return _STORE


def attach(cluster: Any = None) -> MetricsStore:
    """Feed the notebook's store from ``cluster`` (default: ``hvdnb.current()``)."""
    store = get_store()
    c = cluster if cluster is not None else _current()
    if c is not None:
        store.attach(c)
    return store


def set_knobs(
    *, at_step: int | None = None, after: float | None = None, timeout: float = 3.0, **values: Any
) -> dict[str, Any]:
    """Change knobs of the job from code: the same validated request as the panel's controls.

    Every rank applies the change at one step (rank 0 picks it; see ``hvdnb.knobs``).

    Parameters
    ----------
    at_step : apply at this step of the running loop, or of the next loop that runs
        (a plan waiting for its step carries over to the knob set a new cell makes)
    after : send the request this many seconds from now (from a timer thread), so a
        training cell started meanwhile is changed while it runs; returns at once
    timeout : seconds to wait for rank 0's plan and, when it applies at once (no loop
        running), for every rank's report
    **values : knob names and new values

    Returns
    -------
    dict: ``{"id", "plan", "applied": {rank: report}}`` (``{"scheduled_in": after}`` with
    ``after``)

    Raises
    ------
    ValueError
        a value the knobs refuse (unknown name, out of range, wrong kind), no knobs yet, or
        no cluster; nothing is sent then.

    Examples
    --------
    >>> hvdnb.set_knobs(warmup_steps=200, batch_size=64)          # doctest: +SKIP
    >>> hvdnb.set_knobs(batch_size=128, at_step=150)              # doctest: +SKIP
    """
    __tracebackhide__ = True
    try:
        return attach().change_knobs(at_step=at_step, after=after, timeout=timeout, **values)
    except (TypeError, ValueError) as exc:  # the knobs' own refusal (``protocol.knobs``)
        raise refusal("hvdnb.set_knobs", exc).with_traceback(None) from None


def watch(
    nan: str | None = None,
    spike: str | None = None,
    drift: str | None = None,
    **options: Any,
) -> WatchSettings:
    """What the watchers do when a training loop goes wrong; on by default (``warn``).

    While a ``%%distributed`` cell's loop calls ``hvdnb.log``, the notebook watches what it
    logs: a NaN or +-inf in a logged value (``nan``), a loss above 3x its running median
    (``spike``), ranks whose parameters no longer agree (``drift``, with
    ``hvd.DistributedOptimizer`` or ``hvdnb.ddp_comm_hook``). Each alarm is one line in the
    running cell's output (kept in the saved notebook), on the live line and a mark on the
    panel's loss chart. ``stop``: every rank also raises ``hvdnb.TrainingStopped`` at the
    same step (the cluster stays usable). The README's "Watchers" section defines each.

    Parameters
    ----------
    nan, spike, drift : ``"warn"`` (default), ``"stop"`` or ``"off"``
    **options : thresholds: ``spike_factor`` (3), ``spike_window`` (50 steps),
        ``spike_history`` (50 losses before judging), ``spike_floor`` (0.3 x the starting
        level), ``spike_end`` (10 steps), ``drift_rtol`` (1e-6)

    Returns
    -------
    WatchSettings, the settings now in force (called without arguments: unchanged)

    Raises
    ------
    ValueError
        an unknown setting or a bad value; nothing changes then.

    Examples
    --------
    >>> hvdnb.watch(nan="stop", spike="warn", drift="stop")        # doctest: +SKIP
    >>> hvdnb.watch(spike_factor=5)                                # doctest: +SKIP
    """
    __tracebackhide__ = True
    values = {k: v for k, v in (("nan", nan), ("spike", spike), ("drift", drift)) if v is not None}
    try:
        return attach().set_watch(**values, **options)
    except (TypeError, ValueError) as exc:  # the watchers' refusal: nothing changed
        raise refusal("hvdnb.watch", exc).with_traceback(None) from None


def _whole(what: str, v: Any, takes: str) -> Any:
    """``v`` as an int (a numpy integer too: ``df.run.max()``), or None; else refused."""
    if v is None:
        return None
    if not isinstance(v, bool):
        try:
            return operator.index(v)
        except TypeError:
            pass
    raise InputTypeError(f"hvdnb.metrics: {what} must be {takes}, not {type(v).__name__} ({v!r})")


def metrics(
    name: str | None = None, rank: int | None = None, run: int | str | None = None
) -> MetricRows:
    """Every point the ranks recorded with ``hvdnb.log`` (and allreduce, memory, phases),
    as rows ``(rank, step, name, value, time, run, segment, knobs)``.

    Parameters
    ----------
    name : only this metric (e.g. ``"loss"``)
    rank : only this rank
    run : only this run of this session (``hvdnb.metrics().to_pandas().run`` lists
        them), or a run of the run store by its id (``hvdnb.runs().id``), whichever
        session logged it

    Returns
    -------
    MetricRows, a list with ``to_csv(path)``, ``to_jsonl(path)``, ``to_pandas()``,
    ``to_tensorboard(dir)`` and ``to_trackio(project, dir=None)``

    Examples
    --------
    >>> rows = hvdnb.metrics("loss")                               # doctest: +SKIP
    >>> rows.to_csv("loss.csv")
    """
    __tracebackhide__ = True
    if name is not None and not isinstance(name, str):
        raise InputTypeError(
            f"hvdnb.metrics: name must be a metric's name (e.g. 'loss') or None, "
            f"not {type(name).__name__} ({name!r})"
        )
    rank = _whole("rank", rank, "a rank's number or None")
    if not isinstance(run, str):
        run = _whole(
            "run",
            run,
            "a run of this session (an int), a stored run's id (a str, hvdnb.runs().id) or None",
        )
    store = attach()
    if isinstance(run, str):
        return RunRows(store.stored_rows(run, name, rank))
    rows = RunRows(store.rows(name, rank, run))
    rows.lost_points, rows.lost_messages = store.lost_rows, store.lost_messages
    if rows.lost_points or rows.lost_messages:  # never a shorter list without a word
        what = []
        if rows.lost_points:
            what.append(f"{rows.lost_points:,} points (a rank's ring lapped before it sent)")
        if rows.lost_messages:
            what.append(f"{rows.lost_messages:,} messages (gaps in a rank's sequence)")
        warnings.warn(
            "hvdnb.metrics: this cluster lost " + " and ".join(what) + "; the rows returned "
            "are the rest (their count is in rows.lost_points / rows.lost_messages)",
            stacklevel=2,
        )
    return rows
