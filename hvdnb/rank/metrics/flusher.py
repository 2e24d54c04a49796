"""Sending the recorder's messages: from ``log`` itself while a loop logs (no GIL
hand-over), else from the flusher thread (a loop that stopped logging, a slow step, a
heartbeat for fresh memory readings), one sequence-numbered ``metrics`` message per
interval over the side channel. Messages go out on a grid of steps (the first step of a
cell of ~1/16 interval once one is due; see ``hold``), so ranks in lockstep pack on the
same step and neither waits for the other's in turn.

Owns: ``Flusher`` (a part of ``hvdnb.rank.metrics.recorder.Recorder``: the flusher thread,
the send lock, when the last message went out, the sending grid and the late deadline,
``flush``, ``close``). It is handed its ``Source`` (the recorder: ``pack``, ``idle``,
``interval``, ``has_news``) and the channel. Never: block the training thread (a send in
progress elsewhere is skipped, a value that must wait for its device goes to the thread),
issue a collective, or raise into the training loop (a failed send is printed).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Protocol

from hvdnb.protocol import kinds

__all__ = ["Flusher", "Source"]


class Source(Protocol):
    """What the flusher sends from (the recorder)."""

    seq: int

    def pack(self) -> dict[str, Any] | None: ...

    def idle(self) -> bool: ...

    def interval(self, now: float | None = None) -> float: ...

    def has_news(self) -> bool: ...


class Flusher:
    """Sends ``source``'s messages on ``channel``.

    Parameters
    ----------
    source : what to pack (the recorder)
    channel : an object with ``send(kind, **payload)`` and a ``queued`` count, or None
    flush_interval : the flusher thread's period (and the heartbeat's: 4 of them)
    """

    def __init__(self, source: Source, channel: Any, flush_interval: float) -> None:
        self.source = source
        self.channel = channel
        self.flush_interval = float(flush_interval)
        #: send from the training thread at log() when a message is due (see _run)
        self.flush_in_loop = True
        self.thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._kick = threading.Event()  # wakes the flusher thread now (and on close)
        # held from packing to sending: two flushes (the flusher thread, an explicit or
        # end-of-cell flush) must send their sequence numbers in order
        self.send_lock = threading.Lock()
        self._last_sent = 0.0
        self._last_sent_pc = 0.0
        #: the channel's ``queued`` count just after the last message
        self._sent_mark = 0
        #: once a message is due, log() sends it at the first step of the next cell of
        #: ``grid`` steps (set at each drain: ~1/16 of an interval, a power of two), so that
        #: ranks in lockstep pack on the same step and a peer never waits for each in turn;
        #: ``due_cell``: the cell the first log() past the due time was in (None: none yet);
        #: past ``due_late`` it sends at once
        self.grid = 1
        self.due_cell: int | None = None
        self.due_late = 0.0
        #: while recording is off: seconds that were left to the due time and ``due_late``
        self._paused: tuple[float, float] | None = None

    # ------------------------------------------------------------ the training thread
    def schedule(self, now: float) -> float:
        """A message goes out now: the time the next one is due (and its late deadline)."""
        every = self.source.interval(now)
        due = now + every
        self.due_late = due + 0.25 * every
        self.due_cell = None
        return due

    def hold(self, step: int, now: float) -> bool:
        """A message is due at ``log(step)``: True to wait for the first step of the next
        cell of ``grid`` steps (until ``due_late``)."""
        g = self.grid
        if g > 1 and now < self.due_late:
            cell = step // g
            if self.due_cell is None:
                self.due_cell = cell
            if cell == self.due_cell:
                return True
        return False

    def from_loop(self, first: bool, objects: bool) -> None:
        """log() found a message due: send it from here, the training thread.

        Packing costs ~0.1 ms per interval; on the flusher thread the same work took the
        GIL from the training thread, and on a loaded machine each hand-over of the GIL
        costs the training thread a wake-up (ms). The flusher thread then only covers a
        loop that stopped logging (see ``_run``). ``first``: the loop's first message (it
        goes out one interval later); ``objects``: a value must wait for its device (a
        CUDA tensor), so the flusher thread sends this one."""
        if self.channel is None:
            return
        if self.thread is None:
            self.start()
        if first or not self.flush_in_loop:
            return
        if objects:  # not in the step: the flusher thread sends this one
            self._kick.set()
            return
        if not self.send_lock.acquire(blocking=False):
            return  # the flusher thread is sending right now: that message carries the rows
        try:
            self._send()
        except Exception as exc:  # the panel must never break training
            print(f"hvdnb: metrics flush failed: {exc!r}", file=sys.stderr)
        finally:
            self.send_lock.release()

    def pause(self, now: float, due: float) -> None:
        """Recording goes off: keep what was left to the due time (the message clock stops)."""
        if due:
            self._paused = (due - now, self.due_late - now)

    def resume(self, now: float, due: float) -> float:
        """Recording goes on again: the due time, moved on by the time spent off."""
        paused, self._paused = self._paused, None
        if paused is not None and due:
            due, self.due_late = now + paused[0], now + paused[1]
        return due

    # ------------------------------------------------------------ the flusher thread
    def start(self) -> None:
        if self.thread is None and self.channel is not None:
            self.thread = threading.Thread(
                target=self._run, name="hvdnb-metrics-flush", daemon=True
            )
            self.thread.start()

    def _run(self) -> None:
        src = self.source
        wait = self.flush_interval
        while True:
            kicked = self._kick.wait(wait)
            if self._stop.is_set():
                return
            if kicked:
                self._kick.clear()
            wait = self.flush_interval
            if not kicked and self.flush_in_loop and not src.idle():
                # a loop is logging and sends from log(); wake rarely, and only take over
                # when it has not sent for a while (a slow step: its phase and allreduce
                # rows, recorded between two log() calls, still go out)
                every = src.interval()
                since = time.perf_counter() - self._last_sent_pc
                if since < 2 * every:
                    wait = max(every, 4 * every - since)
                    continue
            try:
                self.flush()
            except Exception as exc:  # the panel must never break training
                print(f"hvdnb: metrics flush failed: {exc!r}", file=sys.stderr)

    def flush(self) -> None:
        """Send what was recorded since the last flush (also called at the end of a loop)."""
        if self.channel is None:
            return
        src = self.source
        # nothing new and a message sent lately: none now (a heartbeat every 4 intervals
        # keeps memory readings fresh). Unless the channel sent something else since (a
        # knob set, an alarm): the cell's end waits for this rank's last metrics message,
        # and one sent after those makes that wait cover them too (one socket, in order)
        if (
            not src.has_news()
            and src.idle()
            and src.seq
            and time.time() - self._last_sent < 4 * self.flush_interval
            and getattr(self.channel, "queued", 0) == self._sent_mark
        ):
            return
        with self.send_lock:
            self._send()

    def flush_now(self) -> None:
        """Send what was recorded now, waiting for a send in progress on another thread
        (the recorder's backpressure: its queue is full). Never raises: a failed send is
        printed, as the thread's are."""
        if self.channel is None:
            return
        if self.thread is None:
            self.start()
        try:
            with self.send_lock:
                self._send()
        except Exception as exc:  # the panel must never break training
            print(f"hvdnb: metrics flush failed: {exc!r}", file=sys.stderr)

    def _send(self) -> None:  # under send_lock
        msg = self.source.pack()
        if msg is None:
            return
        self._last_sent = msg["t"]
        self._last_sent_pc = time.perf_counter()
        self.channel.send(kinds.METRICS, **msg)
        self._sent_mark = getattr(self.channel, "queued", 0)

    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        if self.thread is not None:
            self.thread.join(2)
            self.thread = None
        self.flush()
