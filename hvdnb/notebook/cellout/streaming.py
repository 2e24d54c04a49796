"""A running cell's output, from the ranks' messages to the notebook: merged, live, capped.

Owns: taking each rank's output messages as the client receives them (an iopub callback on
each rank's message future, as ipyparallel's own ``stream_output`` does), in order, and
drawing them in the notebook as a local kernel would:

- plain lines go to ``OutputCollapser`` (``output.py``), which merges the same line from
  several ranks into one tagged line;
- text that redraws its line (a progress bar: ``\r``, ``\b``, cursor moves) is drawn on the
  rank's own screen (``terminal.Screen``), shown as one display per rank and bar, updated in
  place while the cell runs and left at its final state;
- displays keep their ids, so ``display(..., display_id=True)`` and its ``update`` work;
  each rank's ids are its own (``hvdnb-r<rank>-<id>``): two ranks using the same id never
  overwrite each other's;
- a rank's ``clear_output`` clears what that rank drew (its displays), never another rank's;
  with ``wait=True`` its next display replaces them, the live-plot habit.

Past ``HVDNB_OUTPUT_LIMIT_MB`` a cell's text goes on into a file, and the notebook gets one
note and the last lines. Never: block on a rank, reorder a rank's lines, or hold more than
the output limit in the browser.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from hvdnb.notebook.cellout.output import OutputCollapser
from hvdnb.notebook.cellout.terminal import Screen, redraws

__all__ = ["Intake", "Streamer"]

#: the iopub messages of a rank that the cell draws (widgets' comm messages are relayed by
#: ipyparallel's client itself; errors and values come with the rank's reply)
DRAWN = frozenset({"stream", "display_data", "update_display_data", "clear_output"})


class Intake:
    """A cell's output messages, taken as the client receives them, from the first one.

    ``tapping(client)`` is held while the cell is sent: every message future the client
    makes for it gets a callback before the request leaves, so a fast rank's first display
    and its updates are taken too (ipyparallel's client keeps displays, not their updates;
    a callback added after the send missed them). ``bind(futures, targets)`` then names the
    rank of each of the cell's requests; messages that came before are kept and put in
    ``inbox``, in order, with their rank.
    """

    def __init__(self) -> None:
        self.inbox: collections.deque[tuple[int, str, dict[str, Any]]] = collections.deque()
        self._futures: list[Any] = []
        self._rank_of: dict[str, int] | None = None
        self._early: list[tuple[str, str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        #: when the last of the cell's output messages came (``time.monotonic``): the cell's
        #: end waits while output still flows, however long a loaded host takes to send it
        self.last = time.monotonic()

    def _take(self, msg: dict[str, Any]) -> None:
        kind = msg["header"]["msg_type"]
        if kind not in DRAWN:
            return
        self.last = time.monotonic()
        mid = (msg.get("parent_header") or {}).get("msg_id", "")
        content = msg.get("content") or {}
        with self._lock:
            # only the cell's own requests are tapped: one not bound yet (a rank joining
            # the running cell) is kept until it is
            rank = None if self._rank_of is None else self._rank_of.get(mid)
            if rank is None:
                self._early.append((mid, kind, content))
                return
        self.inbox.append((rank, kind, content))

    @contextmanager
    def tapping(self, client: Any) -> Iterator[None]:
        make = client.create_message_futures

        def create_message_futures(*args: Any, **kwargs: Any) -> Any:
            futures = make(*args, **kwargs)
            futures[0].iopub_callbacks.append(self._take)
            self._futures.append(futures[0])
            return futures

        client.create_message_futures = create_message_futures
        try:
            yield
        finally:
            del client.create_message_futures  # the class's own again

    def bind(self, futures: list[Any], targets: list[int]) -> None:
        """The cell's own message futures and their ranks (the AsyncResult's children and
        targets, in one order); a future another request made meanwhile is not the cell's."""
        rank_of = {f.msg_id: t for f, t in zip(futures, targets)}
        with self._lock:
            self._rank_of = rank_of
            early, self._early = self._early, []
        for mid, kind, content in early:
            if mid in rank_of:
                self.inbox.append((rank_of[mid], kind, content))

    def bind_more(self, futures: list[Any], targets: list[int]) -> None:
        """Requests the cell sent later (ranks that joined while it ran), and their ranks;
        held under ``tapping`` like the first ones."""
        with self._lock:
            rank_of = dict(self._rank_of or {})
            rank_of.update({f.msg_id: t for f, t in zip(futures, targets)})
            self._rank_of = rank_of
            early, self._early = self._early, []
        for mid, kind, content in early:
            if mid in rank_of:
                self.inbox.append((rank_of[mid], kind, content))

    def wait_quiet(self, ar: Any, quiet: float) -> bool:
        """Wait for every rank's output to be complete (``ar.wait_for_output``), for as long
        as output keeps coming; give up after ``quiet`` seconds in which none came (a rank
        that will never send its end). A fixed bound lost the tail of a 20,000-line cell
        on a loaded host, whose output was still arriving when the bound passed. Never
        raises: a cell's end never fails over its output."""
        try:
            while not ar.wait_for_output(min(0.5, quiet)):
                if time.monotonic() - self.last > quiet:
                    return False
        except Exception:
            return False
        return True

    def close(self) -> None:
        """Take no more messages (the cell has ended)."""
        for fut in self._futures:
            try:
                fut.iopub_callbacks.remove(self._take)
            except ValueError:
                pass
        self._futures.clear()


@dataclass
class _Live:
    """A rank's redrawing text (a bar) on its screen, and the display that shows it."""

    screen: Screen
    display_id: str
    shown: bool = False
    dirty: bool = True


@dataclass
class _RankDrawing:
    """What one rank has drawn in this cell: its displays since its last clear, a
    ``clear_output(wait=True)`` waiting for the next display, and its display ids."""

    shown: list[str] = field(default_factory=list)
    clear_pending: bool = False
    aliases: dict[str, str] = field(default_factory=dict)  # the rank's id -> ours
    #: the rank called ``clear_output`` in this cell: its text from then on is drawn in a
    #: display of its own (``text_id``: ``text`` so far, since its last clear or display),
    #: so that its next clear can take it away, as a local kernel's would
    cleared: bool = False
    text: str = ""
    text_id: str | None = None


def _publish(data: dict[str, Any], metadata: dict[str, Any], display_id: str, update: bool) -> None:
    from IPython.display import publish_display_data  # noqa: PLC0415  IPython: only inside a kernel

    publish_display_data(data, metadata, transient={"display_id": display_id}, update=update)


#: a C++ core's informational log line (absl / glog format: ``I1128 08:43:21.812345  4242
#: port.cc:153] ...``; TensorFlow's before absl is set up: ``I0000 00:00:1795857587.08 ...``),
#: and absl's note that it logs to stderr before it is set up
_NATIVE_INFO = re.compile(
    r"^(?:I\d{4} [\d:.]+ +\d+ [^\]\n]+\] [^\n]*\n"
    r"|WARNING: All log messages before absl::InitializeLog\(\) is called are written to "
    r"STDERR\n)",
    re.M,
)


def _starts_redrawing(text: str) -> bool:
    """The text goes on drawing over the screen (a bar's next state) rather than starting
    new plain lines."""
    return text[:1] in ("\r", "\x08", "\x1b") and not text.startswith("\r\n")


class Streamer:
    """Reads each rank's accumulated stdout/stderr from the client and feeds the collapser.

    Past ``limit`` bytes shown, the cell's output goes on into ``spill`` (a file that holds
    the whole of it, the part shown too) and only its last ``tail`` lines are shown when the
    cell ends, after one note saying how much was left out and where it is.
    """

    def __init__(
        self,
        ranks: list[int],
        window: float,
        limit: int | None = None,
        spill: str | None = None,
        tail: int = 50,
        cell: int = 0,
        inbox: collections.deque[tuple[int, str, dict[str, Any]]] | None = None,
        log_dir: str | None = None,
    ) -> None:
        self.ranks = list(ranks)
        self.cell = cell
        #: (rank, msg_type, content), appended by the client's thread (``Intake``), drained
        #: by ``pump``
        self.inbox = inbox if inbox is not None else collections.deque()
        self.collapser = OutputCollapser(ranks, self._write, window)
        self.live: dict[tuple[int, str], _Live] = {}
        self.drawing: dict[int, _RankDrawing] = {r: _RankDrawing() for r in ranks}
        self._made = 0  # displays made in this cell (their ids)
        #: every rank's stream text as it came (carriage returns, bars, all), appended to
        #: ``<log_dir>/rank<N>.cells.log`` at each pump: ``%dist logs`` reads it whole
        self.log_dir = log_dir
        self._raw: dict[int, list[str]] = {}
        self._logged: set[int] = set()  # ranks whose file has this cell's header
        #: leave out the INFO lines a C++ core logs at import (TensorFlow's, absl's:
        #: ``I0000 ...``), unless the user asked for them (``TF_CPP_MIN_LOG_LEVEL=0``); they
        #: stay in the cells log
        self.quiet_native = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1") != "0"
        self.limit, self.spill_path = limit, spill
        self.shown = 0  # bytes written to the notebook
        self.held = 0  # lines past the limit (in the file only)
        self._head: list[tuple[str, str]] = []  # what was shown, for the file
        self._spill: Any = None
        self._tail: collections.deque[tuple[str, str]] = collections.deque(maxlen=tail)

    def add_ranks(self, ranks: list[int]) -> None:
        """Ranks that joined the running cell (``%dist scale`` at a commit)."""
        self.ranks.extend(r for r in ranks if r not in self.ranks)
        self.collapser.ranks = frozenset(self.ranks)
        for r in ranks:
            self.drawing.setdefault(r, _RankDrawing())

    # ------------------------------------------------------------------ intake
    def receive(self, rank: int, msg_type: str, content: dict[str, Any]) -> None:
        """One output message of ``rank`` (any thread; drawn at the next ``pump``)."""
        if msg_type in DRAWN:
            self.inbox.append((rank, msg_type, content))

    def _write(self, stream: str, text: str) -> None:
        if self.limit is None or self.spill_path is None:
            (sys.stderr if stream == "stderr" else sys.stdout).write(text)
            return
        if self._spill is None:
            if self.shown + len(text) <= self.limit:
                self.shown += len(text)
                self._head.append((stream, text))
                (sys.stderr if stream == "stderr" else sys.stdout).write(text)
                return
            os.makedirs(os.path.dirname(self.spill_path), exist_ok=True)
            self._spill = open(self.spill_path, "w", encoding="utf-8")  # noqa: SIM115
            self._spill.writelines(t for _, t in self._head)
            self._head = []
        self._spill.write(text)
        self._tail.append((stream, text))
        self.held += 1

    def _close_spill(self) -> None:
        if self._spill is None:
            return
        self._spill.close()
        self._spill = None
        shown = len(self._tail)
        sys.stdout.write(
            f"hvdnb: this cell's output passed {(self.limit or 0) / 1e6:g} MB; "
            f"{self.held - shown} line(s) are not shown here, the last {shown} follow. "
            f"The whole output is in {self.spill_path}\n"
        )
        for stream, text in self._tail:
            (sys.stderr if stream == "stderr" else sys.stdout).write(text)

    # ------------------------------------------------------------------ drawing
    def pump(self, final: bool = False) -> None:
        now = time.monotonic()
        while self.inbox:
            rank, kind, content = self.inbox.popleft()
            if kind == "stream":
                text = content.get("text") or ""
                if self.log_dir is not None:
                    self._raw.setdefault(rank, []).append(text)
                self._stream(rank, str(content.get("name", "stdout")), text, now)
            elif kind == "clear_output":
                self._clear(rank, bool(content.get("wait")))
            else:
                self._display(rank, kind, content)
        for (rank, _), live in self.live.items():
            if live.dirty:
                self._draw(rank, live)
        if self._raw:
            self._write_raw()
        if final:
            self.live.clear()
            self.collapser.flush()
            self._close_spill()
        else:
            self.collapser.poll(now)
        sys.stdout.flush()
        sys.stderr.flush()

    def _write_raw(self) -> None:
        assert self.log_dir is not None
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            for rank, parts in self._raw.items():
                path = os.path.join(self.log_dir, f"rank{rank}.cells.log")
                with open(path, "a", encoding="utf-8") as fh:
                    if rank not in self._logged:
                        fh.write(f"\n--- cell {self.cell} ---\n")
                        self._logged.add(rank)
                    fh.write("".join(parts))
        except OSError:
            pass  # the notebook's output goes on; the log is a copy
        self._raw = {}

    def _stream(self, rank: int, name: str, text: str, now: float) -> None:
        key = (rank, name)
        live = self.live.get(key)
        if live is not None:
            if not (live.screen.at_rest and text and not _starts_redrawing(text)):
                live.screen.feed(text)
                live.dirty = True
                return
            # the bar is done (its line ended) and plain lines follow: they merge again
            if live.dirty:
                self._draw(rank, live)
            del self.live[key]
        if self.quiet_native and ("I0" in text or "absl::" in text):
            text = _NATIVE_INFO.sub("", text)
        if not redraws(text):
            d = self.drawing.get(rank)
            if d is not None and d.cleared:  # clear_output, then print: the rank's own text
                self._own_text(rank, d, text)
                return
            self.collapser.feed(rank, name, text, now)
            return
        # the line that starts redrawing, from its beginning, goes on the rank's screen;
        # the complete lines before it are plain
        i = text.find("\n")
        first = len(text)
        for ch in ("\r", "\x08", "\x1b["):
            j = text.find(ch)
            while ch == "\r" and j != -1 and text.startswith("\r\n", j):
                j = text.find(ch, j + 1)
            if j != -1:
                first = min(first, j)
        cut = text.rfind("\n", 0, first) + 1 if i != -1 else 0
        if cut:
            self.collapser.feed(rank, name, text[:cut], now)
        screen = Screen()
        screen.feed(self.collapser.take_partial(rank, name) + text[cut:])
        self._made += 1
        self.live[key] = _Live(screen, f"hvdnb-c{self.cell}-r{rank}-{name}-{self._made}")

    def _draw(self, rank: int, live: _Live) -> None:
        text = "\n".join(f"[{rank}] {ln}" for ln in live.screen.text().split("\n"))
        if not live.shown:
            self.collapser.release(rank)  # the rank's earlier lines first
            sys.stdout.flush()
            sys.stderr.flush()
        _publish({"text/plain": text}, {}, live.display_id, update=live.shown)
        live.shown, live.dirty = True, False

    def _own_text(self, rank: int, d: _RankDrawing, text: str) -> None:
        """Text of a rank that has cleared its output in this cell: drawn in the rank's own
        text display (tagged ``[rank]``), which a ``clear_output(wait=True)`` before it
        replaces: ``clear_output(wait=True); print(...)`` in a loop leaves the last text."""
        if d.clear_pending:
            target, rest = (d.shown[0], d.shown[1:]) if d.shown else (None, [])
            for other in rest:
                _publish({"text/plain": ""}, {}, other, update=True)
            d.clear_pending, d.text, d.text_id = False, "", target
            d.shown = [target] if target is not None else []
        d.text += text
        body = d.text[:-1] if d.text.endswith("\n") else d.text
        data = {"text/plain": "\n".join(f"[{rank}] {ln}" for ln in body.split("\n"))}
        if d.text_id is not None:
            _publish(data, {}, d.text_id, update=True)
            return
        self.collapser.release(rank)  # the rank's earlier lines first
        sys.stdout.flush()
        sys.stderr.flush()
        self._made += 1
        d.text_id = f"hvdnb-c{self.cell}-r{rank}-text-{self._made}"
        _publish(data, {}, d.text_id, update=False)
        d.shown.append(d.text_id)

    def _display(self, rank: int, kind: str, content: dict[str, Any]) -> None:
        data, metadata = content.get("data") or {}, content.get("metadata") or {}
        theirs = (content.get("transient") or {}).get("display_id")
        d = self.drawing.setdefault(rank, _RankDrawing())
        ours = (d.aliases.get(theirs) or f"hvdnb-r{rank}-{theirs}") if theirs else None
        if kind == "update_display_data":
            if ours is not None:
                _publish(data, metadata, ours, update=True)
            return
        self.collapser.release(rank)
        sys.stdout.flush()
        sys.stderr.flush()
        d.text, d.text_id = "", None  # the rank's text after this display goes below it
        if d.clear_pending and d.shown:
            # clear_output(wait=True), then a display: it takes the place of what the rank
            # drew before, as in a local kernel; the rank's other displays are emptied
            target, *rest = d.shown
            _publish(data, metadata, target, update=True)
            for other in rest:
                _publish({"text/plain": ""}, {}, other, update=True)
            d.shown, d.clear_pending = [target], False
            if theirs:
                d.aliases[theirs] = target
            return
        d.clear_pending = False
        if ours is None:
            self._made += 1
            ours = f"hvdnb-c{self.cell}-r{rank}-{self._made}"
        sys.stdout.write(f"[{rank}] output:\n")
        sys.stdout.flush()
        _publish(data, metadata, ours, update=False)
        d.shown.append(ours)

    def _clear(self, rank: int, wait: bool) -> None:
        """The rank's ``clear_output``: what it drew (its displays and bars) is cleared; its
        merged text lines are not (they may be other ranks' too)."""
        d = self.drawing.setdefault(rank, _RankDrawing())
        d.cleared = True
        for key in [k for k in self.live if k[0] == rank]:
            live = self.live.pop(key)
            if live.shown:
                _publish({"text/plain": ""}, {}, live.display_id, update=True)
        if wait:
            d.clear_pending = True
            return
        for ours in d.shown:
            _publish({"text/plain": ""}, {}, ours, update=True)
        d.shown, d.text, d.text_id = [], "", None
