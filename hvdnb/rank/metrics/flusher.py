"""Sending the recorder's messages: from ``log`` itself while a loop logs (no GIL
hand-over), else from the flusher thread (a loop that stopped logging, a slow step, a
heartbeat for fresh memory readings), one sequence-numbered ``metrics`` message per
interval over the side channel. Messages go out on a grid of steps (the first step of a
cell of ~1/16 interval once one is due; see the recorder's ``_events``), so ranks in
lockstep pack on the same step and neither waits for the other's in turn.

Owns: ``Flusher`` (a part of ``hvdnb.rank.metrics.recorder.Recorder``: the flusher thread,
``flush``, ``close``, sending when ``log`` finds a message due). The intervals themselves
are ``RecorderState.interval``. Never: block the training thread (a send in progress
elsewhere is skipped, a value that must wait for its device goes to the thread), issue a
collective, or raise into the training loop (a failed send is printed).
"""

from __future__ import annotations

import sys
import threading
import time

from hvdnb.protocol import kinds
from hvdnb.rank.metrics.ring import Ring

__all__ = ["Flusher"]


class Flusher(Ring):
    """The flusher thread and sending: a part of ``Recorder`` (no fields of its own)."""

    __slots__ = ()

    def _ensure_flusher(self) -> None:
        if self._thread is None and self.channel is not None:
            self._thread = threading.Thread(
                target=self._run, name="hvdnb-metrics-flush", daemon=True
            )
            self._thread.start()

    def _flush_from_loop(self, now: float) -> None:
        """log() found a message due: send it from here, the training thread.

        Packing costs ~0.1 ms per interval; on the flusher thread the same work took the
        GIL from the training thread, and on a loaded machine each hand-over of the GIL
        costs the training thread a wake-up (ms). The flusher thread then only covers a
        loop that stopped logging (see ``_run``)."""
        self._try_drain()  # also without a channel: the queue stays one interval long
        first = not self._due  # the first message goes out one interval after the first log
        every = self.interval(now)
        self._due = now + every
        self._due_late = self._due + 0.25 * every
        self._due_cell = None
        if self.channel is None:
            return
        if self._thread is None:
            self._ensure_flusher()
        if first or not self.flush_in_loop:
            return
        if self._objects:  # a value to read (a CUDA tensor must wait for its device):
            self._kick.set()  # not in the step; the flusher thread sends this one
            return
        if not self._send_lock.acquire(blocking=False):
            return  # the flusher thread is sending right now: that message carries the rows
        try:
            self._send()
        except Exception as exc:  # the panel must never break training
            print(f"hvdnb: metrics flush failed: {exc!r}", file=sys.stderr)
        finally:
            self._send_lock.release()

    def _run(self) -> None:
        wait = self.flush_interval
        while True:
            kicked = self._kick.wait(wait)
            if self._stop.is_set():
                return
            if kicked:
                self._kick.clear()
            wait = self.flush_interval
            if not kicked and self.flush_in_loop and not self.idle():
                # a loop is logging and sends from log(); wake rarely, and only take over
                # when it has not sent for a while (a slow step: its phase and allreduce
                # rows, recorded between two log() calls, still go out)
                every = self.interval()
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
        # nothing new and a message sent lately: none now (a heartbeat every 4 intervals
        # keeps memory readings fresh). Unless the channel sent something else since (a
        # knob set, an alarm): the cell's end waits for this rank's last metrics message,
        # and one sent after those makes that wait cover them too (one socket, in order)
        if (
            self._w == self._r
            and not self._pend
            and not self._side
            and not self._fp  # a drift fingerprint (a cell's last one) goes out now
            and self.idle()
            and self.seq
            and time.time() - self._last_sent < 4 * self.flush_interval
            and getattr(self.channel, "queued", 0) == self._sent_mark
        ):
            return
        with self._send_lock:
            self._send()

    def _send(self) -> None:  # under _send_lock
        msg = self.pack()
        if msg is None:
            return
        self._last_sent = msg["t"]
        self._last_sent_pc = time.perf_counter()
        self.channel.send(kinds.METRICS, **msg)
        self._sent_mark = getattr(self.channel, "queued", 0)

    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(2)
            self._thread = None
        self.flush()
