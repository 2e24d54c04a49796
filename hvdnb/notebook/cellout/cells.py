"""Run one cell on many ranks: live merged output, merged errors, no hanging.

Owns: sending a cell to the engines (``apply`` of ``hvdnb.rank.engine.run_cell``, ~25 %
cheaper than ``execute``), streaming each rank's output while it runs (collapsed by
``OutputCollapser``), the watchers' alarm lines (``hvdnb.watch``: the store finds them,
the waiting loop prints them), showing trailing-expression values once per distinct value,
one ``DistributedCellError`` that names the ranks, and doing what the wait's policy
(``cellwait.CellWait``: fail fast, the stop button, the timeout, stall checks) decides.

Never: block without a deadline when a rank has failed, or print a traceback once per rank.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hvdnb.config import get_config
from hvdnb.extras import hint_for_error
from hvdnb.notebook.cellout.args import check_args
from hvdnb.notebook.cellout.cellwait import (
    ESCALATE_AFTER,
    Action,
    CellWait,
    CheckAlive,
    Escalate,
    Finish,
    Interrupt,
    LookForStall,
    Pump,
    Redraw,
)
from hvdnb.notebook.cellout.elasticcell import CellMembers, elastic_between_cells, rejoin_note
from hvdnb.notebook.cellout.history import ExportCell
from hvdnb.notebook.cellout.output import format_ranks
from hvdnb.notebook.cellout.pdbprompt import PdbPrompt
from hvdnb.notebook.cellout.streaming import Intake, Streamer
from hvdnb.notebook.cluster import health
from hvdnb.notebook.debug import router as visual
from hvdnb.notebook.diagnosis.stall import StallWatch
from hvdnb.notebook.metrics.runlog import outcome_of
from hvdnb.notebook.metrics.store import get_store
from hvdnb.protocol.remote import JOIN_CELL, REBUILD_GROUP, RUN_CELL
from hvdnb.protocol.replies import CellReply

__all__ = [
    "CellResult",
    "DistributedCellError",
    "add_wait_hook",
    "parse_targets",
    "remove_wait_hook",
    "run_cell",
]

#: callables run on the notebook's main thread while a cell waits (every output interval)
#: and once when it ends, e.g. to redraw the live panel with the cell's parent header
_WAIT_HOOKS: list[Any] = []


def add_wait_hook(fn: Any) -> None:
    """Call ``fn(final: bool)`` from the waiting loop of every cell (main thread)."""
    if fn not in _WAIT_HOOKS:
        _WAIT_HOOKS.append(fn)


def remove_wait_hook(fn: Any) -> None:
    if fn in _WAIT_HOOKS:
        _WAIT_HOOKS.remove(fn)


def _show_alarms(store: Any, final: bool) -> None:
    """The watchers' lines (``hvdnb.watch``): one per alarm, in the cell's output (stderr:
    Jupyter shows it red), from the waiting loop so it carries the cell's parent header
    and stays in the saved notebook."""
    try:
        lines = store.take_lines(final)
    except Exception as exc:  # a broken watcher must never break the cell
        lines = [f"hvdnb: the watchers failed: {exc!r}"]
    if lines:
        sys.stderr.write("".join(f"{line}\n" for line in lines))
        sys.stderr.flush()


def _run_hooks(final: bool) -> None:
    for fn in list(_WAIT_HOOKS):
        try:
            fn(final)
        except Exception as exc:  # a broken panel must never break the cell
            print(f"hvdnb: wait hook {fn!r} failed: {exc}", file=sys.stderr)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: seconds without a message after which a finished cell stops waiting for its ranks' last
#: output (on a loaded host it comes after the replies: 1 s lost a cell's, 15 s fixed a tail)
OUTPUT_WAIT = 15.0

#: messages that mean "a peer went away", i.e. a consequence of another rank's failure
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket Timeout",
    "process group has been destroyed",
    "Default process group has not been initialized",
    "NCCL communicator was aborted",
)


@dataclass
class CellResult:
    """What a ``%%distributed`` cell returned, per rank."""

    cell: int
    ranks: list[int]
    values: dict[int, Any] = field(default_factory=dict)
    reprs: dict[int, str | None] = field(default_factory=dict)
    errors: dict[int, dict[str, Any]] = field(default_factory=dict)
    stdout: dict[int, str] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0
    #: the last metrics message each rank had sent when the cell ended, as (pid, seq)
    metrics_marks: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)
    #: ranks an elastic cluster lost while the cell ran, which went on without them
    lost: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: each rank's process-group generation when its cell ended, -1 where not known
    generations: dict[int, int] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return not self.errors


class DistributedCellError(RuntimeError):
    """One or more ranks raised; the traceback is shown once per distinct error."""

    def __init__(self, result: CellResult, note: str = "") -> None:
        self.result = result
        self.note = note
        groups = _group_errors(result.errors)
        first = groups[0]
        super().__init__(
            f"{first['ename']} on rank{'s' if len(first['ranks']) > 1 else ''} "
            f"{format_ranks(first['ranks'])}: {first['evalue']}"
        )

    @property
    def failed_ranks(self) -> list[int]:
        return sorted(self.result.errors)

    def _render_traceback_(self) -> list[str]:
        """IPython shows this instead of a client-side traceback (which would be noise).
        A ModuleNotFoundError for an optional dependency gets the line that installs it."""

        lines: list[str] = []
        groups = _group_errors(self.result.errors)
        primary = [g for g in groups if not g["consequence"] and not g["interrupted"]]
        roots = format_ranks(r for g in primary for r in g["ranks"]) if primary else ""
        for g in groups:
            ranks = format_ranks(g["ranks"])
            plural = "s" if len(g["ranks"]) > 1 else ""
            if g["interrupted"] and roots:
                which = "ranks" if "," in roots or "-" in roots else "rank"
                lines.append(f"[{ranks}] interrupted, because {which} {roots} failed")
                continue
            if g["consequence"] and roots:
                lines.append(
                    f"[{ranks}] {g['ename']}: {g['evalue'].splitlines()[0] if g['evalue'] else ''}"
                    f"  (released because rank{'s' if ',' in roots or '-' in roots else ''} "
                    f"{roots} failed)"
                )
                continue
            lines.append(f"--- rank{plural} {ranks} raised {g['ename']} ---")
            if g["traceback"]:
                lines.extend(g["traceback"].rstrip("\n").splitlines())
            else:
                lines.append(f"{g['ename']}: {g['evalue']}")
            tip = hint_for_error(g["ename"], g["evalue"])  # a missing optional module
            if tip:
                lines.append(tip)
        if self.note:
            lines.append(self.note)
        return lines

    def __str__(self) -> str:
        return "\n".join(self._render_traceback_())


def _is_consequence(err: dict[str, Any]) -> bool:
    text = f"{err.get('evalue', '')}"
    return any(s in text for s in _PEER_GONE)


def _group_errors(errors: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Errors with the same type, message and traceback, merged; root causes first."""
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    for rank in sorted(errors):
        e = errors[rank]
        # the same error at the same place: key without rank-specific numbers in text
        key = (e["ename"], e["evalue"], e["traceback"])
        g = groups.setdefault(
            key,
            {
                "ename": e["ename"],
                "evalue": e["evalue"],
                "traceback": e["traceback"],
                "ranks": [],
                "consequence": _is_consequence(e),
                "interrupted": bool(e.get("interrupted")),
            },
        )
        g["ranks"].append(rank)
    return sorted(
        groups.values(), key=lambda g: (g["consequence"] or g["interrupted"], g["ranks"][0])
    )


def parse_targets(spec: str | int | Sequence[int] | None, ids: Sequence[int]) -> list[int]:
    """Ranks named by ``--targets``: ``all``, ``0``, ``0,2``, ``1:3``, ``::2``."""
    ids = sorted(ids)
    if spec is None or spec == "all":
        return list(ids)
    if isinstance(spec, int):
        chosen = [spec]
    elif isinstance(spec, str):
        spec = spec.strip()
        try:
            if ":" in spec:
                parts = [int(p) if p.strip() else None for p in spec.split(":")]
                if len(parts) > 3:
                    raise ValueError
                chosen = list(ids[slice(*parts)])
            else:
                chosen = [int(p) for p in spec.split(",") if p.strip()]
        except ValueError:
            raise ValueError(
                f"--targets {spec!r} is not understood: use a rank (0), a list (0,2), "
                "a slice (::2, 1:3) or all"
            ) from None
    else:
        chosen = [int(r) for r in spec]
    missing = [r for r in chosen if r not in ids]
    if missing or not chosen:
        raise ValueError(
            f"--targets names rank(s) {format_ranks(missing) if missing else '(none)'} "
            f"but the cluster has ranks {format_ranks(ids)}"
        )
    return sorted(set(chosen))


_RUNNER: Any = None


def _engine_runner() -> Any:
    """``hvdnb.rank.engine.run_cell`` (``protocol.remote.RUN_CELL``), pickled once.

    ipyparallel cans a function by value (its code object) on every apply, and every
    engine rebuilds it from that code: a sixth of the notebook's CPU per no-op cell. A
    ``RemoteCall`` pickles as the function's name instead, and ``PrePickled``
    (ipyparallel's own wrapper for re-used objects) keeps the bytes.
    """
    global _RUNNER
    if _RUNNER is None:
        from ipyparallel.serialize import PrePickled  # noqa: PLC0415  ipyparallel is heavy: loaded only where it is used

        _RUNNER = PrePickled(RUN_CELL)
    return _RUNNER


def run_cell(
    cluster: Any,
    code: str,
    targets: str | Sequence[int] | None = None,
    *,
    timeout: float | None = None,
    stream: bool = True,
    quiet: bool = False,
) -> CellResult:
    """Run ``code`` on the target ranks of ``cluster``; stream output; raise on any error.

    Parameters
    ----------
    cluster : a running ``hvdnb.Cluster``
    code : the cell's source (IPython syntax: magics and ``!cmd`` work)
    targets : ranks to run on (default all); see ``parse_targets``
    timeout : seconds before the ranks still running are interrupted
    stream : print output live (False: only collect it)
    quiet : do not display trailing-expression values

    Raises
    ------
    DistributedCellError
        if any rank raised (or was interrupted); the message names the ranks.
    """
    __tracebackhide__ = True
    check_args(cluster, code, timeout)
    cfg = get_config()
    if timeout is None and cfg.cell_timeout > 0:  # hvdnb run --timeout (HVDNB_CELL_TIMEOUT)
        timeout = cfg.cell_timeout
    # a Ctrl-C is remembered even where Python drops its KeyboardInterrupt (a __del__ run by
    # the GC during the submit): the stop button never leaves the ranks running unwatched
    sigint = _SigintLatch()
    try:
        sent = _submit(cluster, code, targets)
        run = _CellRun(cluster, code, sent, cfg, timeout, stream)
    except BaseException:
        sigint.close()
        raise
    run.wait(sigint)
    return run.finish(quiet)


class _Sent(NamedTuple):
    """A cell on its way: its AsyncResult (first, as tests unpack it), number and ranks."""

    ar: Any
    cell_no: int
    ranks: list[int]
    everyone: bool  #: sent to every rank (the export names no targets)
    store: Any  #: the metrics store, whose run the cell began
    t0: float  #: ``time.monotonic()`` when it was sent
    intake: Intake  #: the cell's output messages, as they arrive
    slots: list[int]  #: the engine of each rank (an elastic cluster's ranks renumber)


def _submit(cluster: Any, code: str, targets: Any) -> _Sent:
    """Check the ranks, start the cell on them (apply_async) and begin its run in the store."""
    cluster.check_alive()
    slot_of = elastic_between_cells(cluster)
    health.require_all_ranks(cluster)
    ranks = parse_targets(targets, range(cluster.n))
    slots = [slot_of(r) for r in ranks]
    everyone = ranks == list(range(cluster.n))
    cluster.cell_no += 1
    cell_no = cluster.cell_no
    view = cluster.client[slots] if not everyone else cluster.view
    visual.before_cell(cluster, code, cell_no, ranks)  # JupyterLab's debugger, when it is on

    store = get_store()
    store.begin_cell(cell_no)  # the cell's first logged point starts a new run
    t0 = time.monotonic()
    intake = Intake()
    with intake.tapping(cluster.client):
        ar = view.apply_async(_engine_runner(), code, cell_no)
    rank_of = dict(zip(slots, ranks))
    intake.bind(list(ar._children), [rank_of.get(t, t) for t in ar._targets])
    return _Sent(ar, cell_no, ranks, everyone, store, t0, intake, slots)


class _CellRun:
    """The I/O half of a cell's wait: it polls the ranks, tells the ``CellWait`` policy
    (``hvdnb.notebook.cellout.cellwait``) what happened, and carries out the actions it returns
    (output, redraws, interrupts, health and stall checks); then collects the results."""

    def __init__(
        self,
        cluster: Any,
        code: str,
        sent: _Sent,
        cfg: Any,
        timeout: float | None,
        stream: bool,
    ) -> None:
        self.cluster, self.code, self.sent, self.stream = cluster, code, sent, stream
        self.interval = cfg.output_interval
        self.result = CellResult(cell=sent.cell_no, ranks=list(sent.ranks))
        # the AsyncResult's own metadata dicts, taken when the cell was sent: the client's
        # ``metadata`` is a defaultdict that drops an entry once its output is complete, and
        # a lookup after that (a fast cell, a loaded machine) made a fresh empty one: the
        # cell's output was lost (1 cell in ~40 under load)
        self.metadata = list(sent.ar._metadata)
        limit = int(cfg.output_limit_mb * 1e6) if cfg.output_limit_mb > 0 else None
        state_dir = getattr(cluster, "state_dir", None) or tempfile.gettempdir()
        spill = os.path.join(state_dir, "output", f"cell{sent.cell_no}.txt")
        self.streamer = Streamer(
            sent.ranks,
            cfg.collapse_window,
            limit,
            spill,
            cell=sent.cell_no,
            inbox=sent.intake.inbox,
            # %dist logs: every byte the ranks printed in cells, beside their own logs
            log_dir=os.path.join(cluster.state_dir, "logs")
            if getattr(cluster, "state_dir", None)
            else None,
        )
        self.members = CellMembers(cluster, sent.ranks, sent.slots, sent.cell_no)
        self.slot_of = dict(zip(sent.ranks, sent.slots))
        self.policy = CellWait(
            sent.ranks, sent.t0, timeout, cfg.stall_after, elastic=self.members.active
        )
        self.watch = StallWatch(cluster, sent.ranks, cfg.stall_after)
        self.prompt = PdbPrompt(cluster)
        self.futures = dict(zip(sent.ranks, sent.ar._children))  # one reply future per rank
        self.children: dict[int, Any] = {}  # per-rank AsyncResults, made when ranks finish apart
        self.stuck: list[int] = []  # ranks that ignored an interrupt (the cluster restarts)

    # ------------------------------------------------------------------ the loop
    def wait(self, sigint: _SigintLatch) -> None:
        """Stream the running cell's output until every rank is done, or the policy ends
        the wait; interrupt on Ctrl-C, a failed rank (fail-fast) or the timeout."""
        try:
            while not self.policy.finished:
                self._step(sigint)
        finally:
            sigint.close()
            self.prompt.close()
        self.watch.close()

    def _step(self, sigint: _SigintLatch) -> None:
        try:
            if sigint.seen and not self.policy.interrupted:
                # a Ctrl-C whose KeyboardInterrupt Python swallowed (raised inside a weakref
                # callback or __del__, it is only "unraisable"): act on it anyway
                raise KeyboardInterrupt
            self._poll()
            for action in self.policy.tick(time.monotonic()):
                if self._do(action):
                    break
        except KeyboardInterrupt:
            self._carry_out(self.policy.ctrl_c(time.monotonic()))

    def _poll(self) -> None:
        """Wait up to one output interval for the ranks; tell the policy who finished."""
        ar, result, done = self.sent.ar, self.result, self.policy.done
        if self.members.joined:  # ranks joined the running cell: wait on every rank's reply
            pending = [f for r, f in self.futures.items() if r not in done]
            futures.wait(pending, timeout=self.interval, return_when=futures.FIRST_COMPLETED)
        elif ar.wait(self.interval) and ar.successful():
            outs = ar.get(0)  # the common case: every rank done, one unpacking
            for r, out in zip(self.sent.ranks, outs):
                if r not in done:
                    _record(result, r, out)
                    err = result.errors.get(r)  # a rank that left an elastic loop is no failure
                    failed = err is not None and not self.members.ended(r, err)
                    self._carry_out(self.policy.rank_done(r, time.monotonic(), failed))
            return
        if not self.children:  # ranks finish apart (or one failed at engine level)
            self.children = dict(zip(self.sent.ranks, ar.split()))
        for r, died in self.members.tick():  # an elastic cluster lost ranks: no interrupts
            if r not in done:
                if died:
                    result.errors[r] = health.rank_died(self.cluster, r, result.cell)
                self._carry_out(self.policy.lost(r, time.monotonic(), self.members.below))
        joined = self.members.scale_tick()  # a scale asked for while the cell runs
        if joined:
            self._join(joined)
        for r, fut in list(self.futures.items()):
            # a rank lost with its host? (``deciding``) the host's change comes first
            if r not in done and fut.done() and not self.members.deciding(r):
                _collect(result, r, self.children[r], self.cluster)
                err = result.errors.get(r)
                dead = bool(err and err.get("dead"))
                failed = err is not None and not self.members.ended(r, err)
                self._carry_out(self.policy.rank_done(r, time.monotonic(), failed, dead))

    def _join(self, joined: list[tuple[int, int]]) -> None:
        """Ranks started while the cell runs (a scale at a commit) join the group and run
        the cell from its top; their output, replies and errors are the cell's."""
        c, sent = self.cluster, self.sent
        ranks, slots = [r for r, _ in joined], [s for _, s in joined]
        members = list(c.membership.members)
        with sent.intake.tapping(c.client):
            ar = c.client[slots].apply_async(
                JOIN_CELL, c.generation, members, self.code, sent.cell_no, c.membership.hosts()
            )
        sent.intake.bind_more(list(ar._children), ranks)
        self.metadata.extend(ar._metadata)
        self.futures.update(zip(ranks, ar._children))
        self.children.update(zip(ranks, ar.split()))
        self.result.ranks.extend(ranks)
        self.policy.ranks.extend(ranks)
        self.streamer.add_ranks(ranks)
        self.slot_of.update(zip(ranks, slots))

    def _carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            self._do(action)

    def _do(self, action: Action) -> bool:
        """Carry out one action; True when the rest of this tick's actions must wait (the
        wait is over, or a pdb prompt was answered and the clock has moved on)."""
        if isinstance(action, Pump):
            if self.stream:
                self.streamer.pump()
            if visual.paused():  # a rank in JupyterLab's debugger: the cell is not timing out
                self.policy.deadline = None
            if self.prompt.serve():
                # a rank sat at breakpoint(): its peers' waiting is no stall, and the stall
                # detector's countdown starts again; the next tick decides afresh
                self.policy.prompt_answered(time.monotonic())
                self.watch.t0 = time.monotonic()
                self.watch.previous = None
                return True
        elif isinstance(action, Redraw):
            _show_alarms(self.sent.store, False)
            _run_hooks(False)
        elif isinstance(action, Interrupt):  # to the ranks' engines (an elastic cluster's slots)
            _interrupt(self.cluster, [self.slot_of[r] for r in action.ranks])
        elif isinstance(action, CheckAlive):
            self.cluster.check_alive()
        elif isinstance(action, LookForStall):
            self.watch.tick(self.policy.done)
        elif isinstance(action, Escalate):
            self.cluster.check_alive()
            self.stuck = list(action.ranks)
            for r in action.ranks:
                self.result.errors[r] = {
                    "ename": "Unresponsive",
                    "evalue": f"did not answer an interrupt within {ESCALATE_AFTER:g} s",
                    "traceback": "",
                    "interrupted": True,
                }
            return True
        elif isinstance(action, Finish):
            return True
        return False

    # ------------------------------------------------------------------ after the wait
    def finish(self, quiet: bool) -> CellResult:
        """Collect the last output, points and alarms; record the cell; raise its errors
        (``DistributedCellError``) or show its values."""
        sent, result, store = self.sent, self.result, self.sent.store
        # a reply can overtake the rank's last output (another socket): wait while it flows,
        # until OUTPUT_WAIT s pass without a message, 1 s where one never comes (dead, stuck)
        gone = self.stuck or any(e.get("dead") for e in result.errors.values())
        sent.intake.wait_quiet(sent.ar, 1.0 if gone else OUTPUT_WAIT)
        if result.metrics_marks:  # the cell's last points, on the side channel: wait (bounded)
            store.wait_for(result.metrics_marks, timeout=1.0)
        if self.stream:
            self.streamer.pump(final=True)
        sent.intake.close()
        _show_alarms(store, True)
        store.end_cell(outcome_of(result.errors))  # how the run ended, for the run store
        _run_hooks(True)
        result.seconds = time.monotonic() - sent.t0
        # in rank order, however they finished (a lesson prints %%distributed -o's dict)
        result.values = dict(sorted(result.values.items()))
        for r, md in zip(result.ranks, self.metadata):
            result.stdout[r] = md.get("stdout") or ""
            result.stderr[r] = md.get("stderr") or ""
            state = "error" if r in result.errors else "ok"
            self.cluster.last_cell[r] = {"cell": sent.cell_no, "state": state}
        # what %dist export turns into a script: every cell, in the order it ran
        self.cluster.history.append(
            ExportCell(
                sent.cell_no, self.code, None if sent.everyone else list(sent.ranks), result.ok
            )
        )
        settled = self.members.settle(result)  # an elastic cluster's changes, said
        if result.errors and not settled:
            visual.cell_error(True)  # the notebook's "pause on exceptions" skips this raise
            raise DistributedCellError(result, self._error_note())
        if not quiet:
            _show_values(result)
        return result

    def _error_note(self) -> str:
        """How the wait ended, and what became of the cluster: dead ranks are named, ranks
        that ignored an interrupt get a restart, otherwise the process group is rebuilt."""
        note = self.members.with_lines(self.policy.note)  # an elastic cluster's changes
        died = health.died_note(self.cluster, health.dead_in(self.result.errors))
        if died:
            return f"{note}; {died}" if note else died
        if self.stuck:
            return _escalate(self.cluster, self.stuck, note)
        return _rebuild_group(self.cluster, note)


def _collect(result: CellResult, rank: int, child: Any, cluster: Any = None) -> None:
    try:
        out = child.get(10)  # its reply came: ipyparallel marks it ready a moment later
        if isinstance(out, list):  # a one-rank AsyncResult still returns a list
            out = out[0]
    except Exception as exc:  # serialisation or engine-level failure
        elist = getattr(exc, "elist", None)
        if elist and len(elist) == 1:  # a one-rank result wraps its error: unwrap it
            ename, evalue = elist[0][0], elist[0][1]
        else:
            ename = getattr(exc, "ename", None) or type(exc).__name__
            evalue = getattr(exc, "evalue", None) or str(exc)
        if ename == "EngineError":  # the engine process is gone: say so, not ipyparallel's stack
            result.errors[rank] = health.rank_died(cluster, rank, result.cell)
            return
        result.errors[rank] = {
            "ename": ename,
            "evalue": evalue,
            "traceback": _ANSI.sub("", "".join(getattr(exc, "traceback", "") or "")),
            "interrupted": ename == "KeyboardInterrupt",
        }
        return
    _record(result, rank, out)


def _record(result: CellResult, rank: int, out: CellReply) -> None:
    """A rank's reply into the cell's result: its value and repr, or its error record."""
    if out.metrics is not None:
        result.metrics_marks[rank] = (out.metrics[0], out.metrics[1])
    result.generations[rank] = out.generation
    if out.ok:
        result.values[rank] = out.value
        result.reprs[rank] = out.repr
    else:
        result.errors[rank] = out.error()


def _rebuild_group(cluster: Any, note: str) -> str:
    """Failing ranks tore their process group down to release their peers: build a fresh
    one on every rank now, so the next cell (on any targets) finds a working group."""

    if getattr(cluster, "membership", None) is not None:
        return rejoin_note(cluster, note)
    cluster.generation += 1
    try:
        cluster.view.apply_async(REBUILD_GROUP, cluster.generation).get(timeout=30)
    except Exception as exc:
        extra = f"the process group could not be rebuilt ({exc}); run `%dist restart`"
        return f"{note}; {extra}" if note else extra
    return note


def _escalate(cluster: Any, stuck: list[int], note: str) -> str:
    """Ranks that ignore SIGINT (a C loop, a signal handler swallowing it) cannot be trusted
    with the next cell: restart the cluster, and say so."""
    print(
        f"hvdnb: rank(s) {format_ranks(stuck)} ignored the interrupt for 2 s; restarting the "
        "cluster (variables on the ranks are lost; an hvdnb.State you committed is restored)",
        file=sys.stderr,
    )
    try:
        cluster.restart(force=True)
    except Exception as exc:
        extra = f"the automatic restart failed ({exc}); run `%dist restart`"
    else:
        extra = f"the cluster was restarted: {cluster.n} fresh ranks are ready"
    return f"{note}; {extra}" if note else extra


class _SigintLatch:
    """Remembers a SIGINT (the stop button, Ctrl-C) for the length of one cell.

    The KeyboardInterrupt that Python raises for it lands in whatever code runs next; when
    that is a weakref callback or a ``__del__``, Python reports it as "unraisable" and
    drops it. Seen once in a 20-trial test: the stop button did nothing and a rank stayed
    blocked in a collective until its 300 s timeout. The cell's waiting loop checks
    ``seen`` as well. The previous handler still runs (it raises as before); installed
    only on the main thread and only over Python's own handler.
    """

    def __init__(self) -> None:
        self.seen = False
        self._prev: Any = None
        if threading.current_thread() is not threading.main_thread():
            return
        prev = signal.getsignal(signal.SIGINT)
        if not callable(prev):  # SIG_IGN / SIG_DFL: somebody chose that; leave it
            return
        self._prev = prev

        def handler(signum: int, frame: Any) -> None:
            self.seen = True
            prev(signum, frame)

        signal.signal(signal.SIGINT, handler)

    def close(self) -> None:
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)
            self._prev = None


def _interrupt(cluster: Any, ranks: list[int]) -> float:
    visual.release(ranks)  # ranks held in JupyterLab's debugger take it there
    if ranks:
        try:
            cluster.client.send_signal(signal.SIGINT, targets=ranks, block=False)
        except Exception:
            pass
    return time.monotonic()


def _show_values(result: CellResult) -> None:
    by_repr: dict[str, list[int]] = {}
    for r in result.ranks:
        rep = result.reprs.get(r)
        if rep is not None:
            by_repr.setdefault(rep, []).append(r)
    for rep, rs in by_repr.items():
        sys.stdout.write(f"Out[{format_ranks(rs)}]: {rep}\n")
    sys.stdout.flush()
