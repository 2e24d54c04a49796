"""JupyterLab's visual debugger, reaching the ranks: the kernel's debugger, widened.

ipykernel answers JupyterLab's ``debug_request`` messages with its ``Debugger``, which
drives debugpy inside the notebook's own process. ``RankRouter`` wraps that debugger: what
concerns the notebook's own cells goes to it unchanged; breakpoints also go to every rank's
debugpy (started on the rank when the debugger is turned on, ``hvdnb.rank.visualdebug``),
and what concerns a stopped rank (its stack, variables, stepping, the console) goes to that
rank's debugpy over the Debug Adapter Protocol (``dap.DapClient``).

How the ranks look in JupyterLab 4's debugger, which follows one stopped thread and lists
no threads: the Callstack lists every stopped rank's frames, the followed rank's first,
each named ``rank N · function``. Clicking a frame picks its rank: Variables, the console,
Continue, Next, Step in and Step out then act on that rank. When a rank continues, the
debugger follows the next rank still stopped. The toolbar's Terminate button releases
every rank at once (it disconnects and reconnects the debugger: breakpoints are kept).

A ``%%distributed`` cell's lines are the page's: the notebook tells each rank's debugpy
that lines 2.. of the cell's dumped file (the first is ``%%distributed``) are the rank's
``<cell N>`` (pydevd's source maps), before the cell is sent.

Owns: the ranks' debugger sessions and the ids the page sees for their threads, frames and
variables. Never: touch the notebook's own debugpy (ipykernel's ``Debugger`` does), or run
on a rank.
"""

from __future__ import annotations

import ast
import itertools
import logging
import sys
import threading
from typing import Any

from hvdnb.notebook.debug.dap import DapError
from hvdnb.notebook.debug.local import (
    cell_error,
    handle_stopped_event,
    spare_cell_errors,
    start_notebook_debugpy,
)
from hvdnb.notebook.debug.session import ANSWER_TIMEOUT, LISTEN_TIMEOUT, RankSession
from hvdnb.protocol import kinds

__all__ = ["RankRouter", "before_cell", "cell_error", "current", "install", "paused", "release"]

log = logging.getLogger("hvdnb.debug")

#: a rank's thread as the page sees it: THREAD_BASE * (rank + 1) + the rank's thread id
THREAD_BASE = 1_000_000
#: the ranks' frame and variable references as the page sees them: from here up (above
#: the notebook's own debugpy's small counters and ipykernel's ``id()`` references)
REF_BASE = 2**52
_ROUTER: RankRouter | None = None


def current() -> RankRouter | None:
    """The router installed in this kernel, if any."""
    return _ROUTER


def install(ipython: Any) -> RankRouter | None:
    """Wrap the kernel's debugger (once); None outside ipykernel or without debugpy."""
    global _ROUTER
    kernel = getattr(ipython, "kernel", None)
    local = getattr(kernel, "debugger", None)
    if kernel is None or local is None or not hasattr(local, "process_request"):
        return None
    if isinstance(local, RankRouter):
        _ROUTER = local
        return local
    _ROUTER = RankRouter(local)
    kernel.debugger = _ROUTER
    ipython.events.register("post_run_cell", lambda _result: cell_error(False))
    return _ROUTER


def before_cell(cluster: Any, code: str, cell_no: int, ranks: list[int]) -> None:
    """Called as a ``%%distributed`` cell is sent: with the visual debugger on, the ranks'
    debuggers are connected and told where the cell's lines are. Never raises."""
    cell_error(False)
    router = _ROUTER
    if router is None or not router.on:
        return
    try:
        router.prepare_cell(cluster, _raw_cell(), code, cell_no, ranks)
    except Exception as exc:  # the cell must run even when its ranks cannot be debugged
        print(
            f"hvdnb: the visual debugger could not reach the ranks ({exc}); this cell runs "
            "without stopping there. Turn the debugger off and on to try again.",
            file=sys.stderr,
        )


def paused() -> list[int]:
    """The ranks stopped in JupyterLab's debugger now (none while it is off)."""
    router = _ROUTER
    if router is None or not router.on:
        return []
    with router.lock:
        return router._stopped_ranks()


def release(ranks: list[int]) -> None:
    """``ranks`` are being interrupted: those held in the debugger take the interrupt where
    they stopped (it ends the wait debugpy holds them in), so the page shows them going on.
    The debugger stays on, its breakpoints set."""
    router = _ROUTER
    if router is None or not router.on:
        return
    with router.lock:
        held = [router.sessions[r] for r in router._stopped_ranks() if r in ranks]
    for s in held:
        router.rank_continued(s)
    if held:
        router._follow_next()


def _raw_cell() -> str | None:
    """The cell as the page sent it (its execute request's code), or None outside a kernel."""
    try:
        from IPython import get_ipython  # noqa: PLC0415  IPython: only inside a kernel

        shell = get_ipython()
        code = getattr(shell, "parent_header", {}).get("content", {}).get("code")
    except Exception:
        return None
    return code if isinstance(code, str) else None


def _ok(request: dict[str, Any], body: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "type": "response",
        "request_seq": request.get("seq", 0),
        "seq": 0,
        "success": True,
        "command": request.get("command"),
        "body": body or {},
    }


def _fail(request: dict[str, Any], message: str) -> dict[str, Any]:
    return {
        "type": "response",
        "request_seq": request.get("seq", 0),
        "seq": 0,
        "success": False,
        "command": request.get("command"),
        "message": message,
        "body": {},
    }


class RankRouter:
    """The kernel's ``Debugger`` with the ranks added (see the module's docstring).

    Every attribute it does not define is the wrapped debugger's, so ipykernel's own uses of
    ``kernel.debugger`` (its debugpy stream, stopped events) are unchanged.
    """

    def __init__(self, local: Any) -> None:
        self.__dict__["local"] = local
        self.on = False  # JupyterLab's debugger is attached
        self.sessions: dict[int, RankSession] = {}
        self.lock = threading.RLock()
        self.breakpoints: dict[str, dict[str, Any]] = {}  # path -> setBreakpoints arguments
        self.exceptions: dict[str, Any] | None = None  # setExceptionBreakpoints arguments
        self.source_maps: dict[str, list[dict[str, Any]]] = {}  # dumped path -> pydevd maps
        self.refs: dict[int, tuple[int, int]] = {}  # page ref -> (rank, the rank's ref)
        self.rank_refs: dict[int, list[int]] = {}
        self.ref_of: dict[tuple[int, int], int] = {}  # (rank, the rank's ref) -> page ref
        self._counter = itertools.count(REF_BASE)
        self.shown: int | None = None  # the rank whose thread the page follows
        self.picked: int | None = None  # the rank of the frame the person picked last
        self.cluster: Any = None
        self.told: set[int] = set()  # ranks told the debugger is on (DEBUG_LISTEN) since off

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["local"], name)

    async def handle_stopped_event(self) -> None:
        """ipykernel's loop over the notebook's stops, which one error would end."""
        await handle_stopped_event(self.local)

    # ------------------------------------------------------------------ page-facing ids
    @staticmethod
    def thread_of(rank: int, tid: int) -> int:
        return THREAD_BASE * (rank + 1) + tid

    @staticmethod
    def rank_of_thread(tid: Any) -> int | None:
        if isinstance(tid, int) and tid >= THREAD_BASE:
            return tid // THREAD_BASE - 1
        return None

    def _ref(self, rank: int, real: int) -> int:
        """The page's id for the rank's frame or variable reference ``real``: the same one
        each time while the rank stays stopped (JupyterLab keeps the picked frame only when
        a refreshed Callstack has its id again; pydevd's ids hold while suspended)."""
        if not real:
            return 0
        ours = self.ref_of.get((rank, real))
        if ours is None:
            ours = next(self._counter)
            self.refs[ours] = (rank, real)
            self.ref_of[(rank, real)] = ours
            self.rank_refs.setdefault(rank, []).append(ours)
        return ours

    def _forget_refs(self, rank: int) -> None:
        for ours in self.rank_refs.pop(rank, []):
            hit = self.refs.pop(ours, None)
            if hit is not None:
                self.ref_of.pop(hit, None)

    def _publish(self, event: str, body: dict[str, Any]) -> None:
        self.local.event_callback({"type": "event", "seq": 0, "event": event, "body": body})

    # ------------------------------------------------------------------ rank events
    def rank_stopped(self, s: RankSession, body: dict[str, Any]) -> None:
        with self.lock:
            tid = body.get("threadId")
            if not isinstance(tid, int):
                return
            if not self.on:  # a step that ends after the debugger was turned off: go on
                s.dap.send("continue", {"threadId": tid})
                return
            s.stopped, s.reason = tid, str(body.get("reason") or "breakpoint")
            self._forget_refs(s.rank)
            if (
                self.shown is None
                or self.shown not in self._stopped_ranks()
                or (self.picked == s.rank)
            ):
                self.shown = self.picked = s.rank
            shown = self.sessions[self.shown]
        # the page follows one thread: a stop elsewhere redraws the followed one's stack,
        # which lists every stopped rank
        self._publish(
            "stopped",
            {
                "reason": shown.reason,
                "threadId": self.thread_of(shown.rank, shown.stopped or 0),
                "allThreadsStopped": False,
                "description": f"rank {shown.rank}",
                "preserveFocusHint": False,
            },
        )

    def rank_continued(self, s: RankSession) -> None:
        with self.lock:
            if s.stopped is None:
                return
            tid, s.stopped = s.stopped, None
            self._forget_refs(s.rank)
        self._publish(
            "continued",
            {"threadId": self.thread_of(s.rank, tid), "allThreadsContinued": False},
        )

    def rank_gone(self, s: RankSession) -> None:
        with self.lock:
            if self.sessions.get(s.rank) is s:
                del self.sessions[s.rank]
            was = s.stopped
            s.stopped = None
            self._forget_refs(s.rank)
        if was is not None:
            self._publish(
                "continued",
                {"threadId": self.thread_of(s.rank, was), "allThreadsContinued": False},
            )

    def _stopped_ranks(self) -> list[int]:
        return sorted(r for r, s in self.sessions.items() if s.stopped is not None)

    def _follow_next(self) -> None:
        """After a rank went on: the page follows the next rank still stopped."""
        with self.lock:
            left = self._stopped_ranks()
            if not left:
                self.shown = None
                return
            self.shown = self.picked = left[0]
            s = self.sessions[left[0]]
        self._publish(
            "stopped",
            {
                "reason": s.reason,
                "threadId": self.thread_of(s.rank, s.stopped or 0),
                "allThreadsStopped": False,
                "description": f"rank {s.rank}",
                "preserveFocusHint": False,
            },
        )

    # ------------------------------------------------------------------ connecting ranks
    def replay(self, s: RankSession) -> None:
        """What a newly attached rank must know: source maps, breakpoints, exceptions."""
        for path, maps in list(self.source_maps.items()):
            s.dap.request(
                "setPydevdSourceMap", {"source": {"path": path}, "pydevdSourceMaps": maps}
            )
        for args in list(self.breakpoints.values()):
            s.dap.request("setBreakpoints", args)
        if self.exceptions is not None:
            s.dap.request("setExceptionBreakpoints", self.exceptions)

    def connect(self, cluster: Any, ranks: list[int]) -> None:
        """Start debugpy on ``ranks`` that have none attached, and attach to each."""
        ch = getattr(cluster, "channel", None)
        if ch is None:
            return
        with self.lock:
            if self.cluster is not cluster:  # another cluster (a restart): new processes
                for s in self.sessions.values():
                    s.dap.close()
                self.sessions.clear()
                self.told.clear()
                self.cluster = cluster
            missing = [r for r in ranks if r not in self.sessions or self.sessions[r].dap.closed]
            untold = [r for r in ranks if r not in self.told]
        if not untold:
            return
        # each rank told the debugger is on (its breakpoint() stops there, its collectives
        # wait); those without a session also say where their adapter listens
        replies = ch.ask(untold, kinds.DEBUG_LISTEN, kinds.DEBUG_READY, LISTEN_TIMEOUT, "debug")
        problems = []
        for r in untold:
            rep = replies.get(r)
            if rep is None or rep.get("error"):
                why = rep.get("error") if rep else f"no answer within {LISTEN_TIMEOUT:g} s"
                problems.append(f"rank {r}: {why}")
                continue
            self.told.add(r)
            if r not in missing:
                continue
            s = RankSession(self, r, str(rep["host"]), int(rep["port"]), int(rep.get("pid") or 0))
            with self.lock:
                self.sessions[r] = s
            try:
                s.attach()
            except (DapError, OSError) as exc:
                problems.append(f"rank {r}: {exc}")
                with self.lock:
                    self.sessions.pop(r, None)
                s.dap.close()
        if problems:
            raise DapError("; ".join(problems))

    def prepare_cell(
        self, cluster: Any, raw: str | None, code: str, cell_no: int, ranks: list[int]
    ) -> None:
        """Before a cell goes to ``ranks``: attach to them, and map the cell's lines."""
        self.connect(cluster, ranks)
        if raw is None:
            return
        from ipykernel.compiler import get_file_name  # noqa: PLC0415  only with the debugger on

        at = raw.find(code) if code else -1
        if at < 0:
            return
        path = get_file_name(raw)
        first = raw[:at].count("\n") + 1  # the page's line of the body's first line
        count = code.count("\n") + 1
        maps = [
            {
                "line": first,
                "endLine": first + count - 1,
                "runtimeSource": {"path": f"<cell {cell_no}>"},
                "runtimeLine": 1,
            }
        ]
        self.source_maps[path] = maps
        with self.lock:
            sessions = [self.sessions[r] for r in ranks if r in self.sessions]
        seqs = [
            (
                s,
                s.dap.send(
                    "setPydevdSourceMap", {"source": {"path": path}, "pydevdSourceMaps": maps}
                ),
            )
            for s in sessions
        ]
        for s, seq in seqs:
            s.dap.wait(seq, ANSWER_TIMEOUT)
        # breakpoints set before this cell's map existed are resolved again with it
        args = self.breakpoints.get(path)
        if args is not None:
            for s in sessions:
                s.dap.request("setBreakpoints", args, ANSWER_TIMEOUT)

    # ------------------------------------------------------------------ the page's requests
    async def process_request(self, message: dict[str, Any]) -> dict[str, Any]:
        command = message.get("command")
        args = message.get("arguments") or {}
        handler = getattr(self, f"_on_{command}", None)
        if handler is not None:
            reply = handler(message, args)
            if reply is not None:
                return reply  # type: ignore[no-any-return]
        reply = await self.local.process_request(message)
        after = getattr(self, f"_after_{command}", None)
        if after is not None:
            after(message, args, reply)
        return reply  # type: ignore[no-any-return]

    def _on_initialize(self, message: dict[str, Any], args: Any) -> dict[str, Any] | None:
        error = start_notebook_debugpy(self.local)
        if error is None:
            return None  # ipykernel's initialize goes on from a listening debugpy
        return _fail(message, f"the notebook's debugpy did not start ({error})")

    # requests the notebook's debugger answers, with the ranks told too
    def _after_initialize(self, message: dict[str, Any], args: Any, reply: Any) -> None:
        if isinstance(reply, dict) and reply.get("success"):
            self.on = True

    def _after_attach(self, message: dict[str, Any], args: Any, reply: Any) -> None:
        """On again (Terminate is a disconnect and a new attach, mid-cell too): the ranks
        attached before are told now, not at the next cell, so their collectives wait."""
        with self.lock:
            ranks = sorted(self.sessions)
        if self.cluster is None or not ranks:
            return
        try:
            self.connect(self.cluster, ranks)
        except Exception as exc:  # the page's attach stands; the cell says what failed
            log.warning("hvdnb: the visual debugger could not reach ranks again: %s", exc)

    def _after_setBreakpoints(self, message: dict[str, Any], args: Any, reply: Any) -> None:
        path = (args.get("source") or {}).get("path")
        if not path:
            return
        new = {
            "source": {"path": path},
            "breakpoints": args.get("breakpoints") or [],
            "sourceModified": False,
        }
        if self.breakpoints.get(path) == new:
            return  # the page sends them again at every cell and stop: the ranks have them
        self.breakpoints[path] = new
        self._to_ranks("setBreakpoints", new)

    def _after_setExceptionBreakpoints(self, message: Any, args: Any, reply: Any) -> None:
        spare_cell_errors()  # the notebook does not stop where a cell reports its ranks' errors
        self.exceptions = dict(args)
        self._to_ranks("setExceptionBreakpoints", self.exceptions)

    def _on_disconnect(self, message: dict[str, Any], args: Any) -> dict[str, Any] | None:
        if getattr(self.local, "is_started", True):
            return None
        # off already (a second page's disconnect): ipykernel's own would fail on its socket
        self.release_all()
        return _ok(message)

    def _after_disconnect(self, message: Any, args: Any, reply: Any) -> None:
        """The debugger was turned off, or Terminate pressed: every rank goes on."""
        self.release_all()

    def _after_debugInfo(self, message: Any, args: Any, reply: Any) -> None:
        if isinstance(reply, dict) and isinstance(reply.get("body"), dict):
            with self.lock:  # the followed rank first: the page follows the first listed
                order = sorted(self.sessions, key=lambda r: (r != self.shown, r))
                mine = [
                    self.thread_of(r, self.sessions[r].stopped or 0)
                    for r in order
                    if self.sessions[r].stopped is not None
                ]
            if mine:
                reply["body"]["stoppedThreads"] = mine + list(
                    reply["body"].get("stoppedThreads", [])
                )

    def release_all(self) -> None:
        with self.lock:
            self.on = False
            sessions = list(self.sessions.values())
            self.breakpoints.clear()
            self.exceptions = None
            self.shown = self.picked = None
            told, self.told = self.told, set()
        held = False
        ch = getattr(self.cluster, "channel", None)
        if ch is not None:
            for r in sorted(told):  # breakpoint() is pdb's again, collectives time out again
                ch.send(r, kinds.DEBUG_OFF)
        for s in sessions:
            try:
                for path in list(self.source_maps):
                    s.dap.send("setBreakpoints", {"source": {"path": path}, "breakpoints": []})
                s.dap.send("setExceptionBreakpoints", {"filters": []})
                if s.stopped is not None:
                    s.dap.send("continue", {"threadId": s.stopped})
                    self.rank_continued(s)
                    held = True
            except DapError:
                pass
        if held:  # and once for all, so no page keeps its "paused" bar for a rank it missed
            self._publish("continued", {"threadId": 0, "allThreadsContinued": True})

    def _to_ranks(self, command: str, args: dict[str, Any]) -> None:
        with self.lock:
            sessions = list(self.sessions.values())
        seqs = []
        for s in sessions:
            try:
                seqs.append((s, s.dap.send(command, args)))
            except DapError:
                pass
        for s, seq in seqs:
            try:
                s.dap.wait(seq, ANSWER_TIMEOUT)
            except DapError as exc:
                log.warning("hvdnb: %s", exc)

    # requests about a rank: answered here (None: the notebook's debugger answers)
    def _on_stackTrace(self, message: dict[str, Any], args: Any) -> dict[str, Any] | None:
        rank = self.rank_of_thread(args.get("threadId"))
        if rank is None:
            return None
        with self.lock:
            order = self._stopped_ranks()
            if rank in order:  # the followed rank first
                order.remove(rank)
                order.insert(0, rank)
            sessions = [self.sessions[r] for r in order]
        frames: list[dict[str, Any]] = []
        for s in sessions:
            if s.stopped is None:
                continue
            try:
                rep = s.dap.request("stackTrace", {"threadId": s.stopped}, ANSWER_TIMEOUT)
            except DapError:
                continue
            for f in (rep.get("body") or {}).get("stackFrames", []):
                if not _users_frame(f):
                    continue
                g = dict(f)
                g["id"] = self._ref(s.rank, int(f["id"]))
                g["name"] = f"rank {s.rank} · {f.get('name', '?')}"
                frames.append(g)
        return _ok(message, {"stackFrames": frames, "totalFrames": len(frames)})

    def _routed(self, ref: Any) -> tuple[RankSession, int] | None:
        with self.lock:
            hit = self.refs.get(ref) if isinstance(ref, int) else None
            if hit is None:
                return None
            s = self.sessions.get(hit[0])
        return (s, hit[1]) if s is not None else None

    def _forward(
        self, s: RankSession, message: dict[str, Any], args: dict[str, Any]
    ) -> dict[str, Any]:
        try:
            rep = s.dap.request(str(message["command"]), args, ANSWER_TIMEOUT)
        except DapError as exc:
            return _fail(message, str(exc))
        rep = dict(rep)
        rep["request_seq"] = message.get("seq", 0)
        return rep

    def _on_scopes(self, message: dict[str, Any], args: Any) -> dict[str, Any] | None:
        hit = self._routed(args.get("frameId"))
        if hit is None:
            return None
        s, real = hit
        with self.lock:
            self.picked = s.rank  # picking a frame picks its rank
        rep = self._forward(s, message, {**args, "frameId": real})
        for scope in (rep.get("body") or {}).get("scopes", []):
            scope["variablesReference"] = self._ref(
                s.rank, int(scope.get("variablesReference") or 0)
            )
        return rep

    def _on_variables(self, message: dict[str, Any], args: Any) -> dict[str, Any] | None:
        hit = self._routed(args.get("variablesReference"))
        if hit is None:
            return None
        s, real = hit
        rep = self._forward(s, message, {**args, "variablesReference": real})
        body = rep.get("body") or {}
        kept = []
        for v in body.get("variables", []):
            if not self.local.accept_variable(str(v.get("name", ""))):
                continue
            v["variablesReference"] = self._ref(s.rank, int(v.get("variablesReference") or 0))
            kept.append(v)
        body["variables"] = kept
        return rep

    def _on_evaluate(self, message: dict[str, Any], args: Any) -> dict[str, Any] | None:
        hit = self._routed(args.get("frameId"))
        if hit is None:
            return None
        s, real = hit
        rep = self._forward(s, message, {**args, "frameId": real})
        body = rep.get("body") or {}
        if "variablesReference" in body:
            body["variablesReference"] = self._ref(s.rank, int(body["variablesReference"] or 0))
        return rep

    def _on_richInspectVariables(self, message: dict[str, Any], args: Any) -> dict[str, Any] | None:
        hit = self._routed(args.get("frameId"))
        if hit is None:
            return None
        s, real = hit
        name = str(args.get("variableName", ""))
        if not name.isidentifier():
            return _ok(message, {"data": {}, "metadata": {}})
        code = f"get_ipython().display_formatter.format({name})"
        try:
            rep = s.dap.request(
                "evaluate",
                {"expression": code, "frameId": real, "context": "clipboard"},
                ANSWER_TIMEOUT,
            )
            data, metadata = (
                ast.literal_eval(rep["body"]["result"]) if rep.get("success") else ({}, {})
            )
        except (DapError, ValueError, SyntaxError, KeyError):
            data, metadata = {}, {}
        return _ok(
            message,
            {"data": data, "metadata": {k: v for k, v in metadata.items() if k in data}},
        )

    def _stepping(self, message: dict[str, Any], args: Any) -> dict[str, Any] | None:
        """Continue, Next, Step in/out, Pause: on the picked rank (or the followed one)."""
        rank = self.rank_of_thread(args.get("threadId"))
        with self.lock:
            stopped = self._stopped_ranks()
            if rank is None and not stopped:
                return None  # the notebook's own thread
            target = self.picked if self.picked in stopped else rank
            s = self.sessions.get(target) if target is not None else None
            if s is None or s.stopped is None:
                return _fail(message, "no rank is stopped there")
            tid = s.stopped
        # marked as going on before it is asked to: the rank may stop again (a loop) before
        # its answer is read, and that stop must not be taken for this one
        self.rank_continued(s)
        rep = self._forward(s, message, {**args, "threadId": tid})
        if message.get("command") == "continue":
            self._follow_next()  # the page follows the next rank still stopped
        return rep

    _on_continue = _stepping
    _on_next = _stepping
    _on_stepIn = _stepping
    _on_stepOut = _stepping

    def _on_exceptionInfo(self, message: dict[str, Any], args: Any) -> dict[str, Any] | None:
        with self.lock:
            rank = self.rank_of_thread(args.get("threadId"))
            s = self.sessions.get(rank) if rank is not None else None
            tid = s.stopped if s is not None else None
        if s is None or tid is None:
            return None
        return self._forward(s, message, {**args, "threadId": tid})

    def _on_threads(self, message: dict[str, Any], args: Any) -> dict[str, Any] | None:
        with self.lock:
            mine = [
                {"id": self.thread_of(r, s.stopped), "name": f"rank {r}"}
                for r, s in sorted(self.sessions.items())
                if s.stopped is not None
            ]
        if not mine:
            return None
        return _ok(message, {"threads": mine})


def _users_frame(frame: dict[str, Any]) -> bool:
    """A frame of the user's code: the cell's, or a file of theirs (not hvdnb's machinery)."""
    path = str((frame.get("source") or {}).get("path") or "")
    if not path:
        return False
    parts = path.replace("\\", "/")
    return not any(
        p in parts
        for p in ("/hvdnb/", "/kernels_ext/", "/site-packages/", "/ipyparallel/", "/ipykernel/")
    )
