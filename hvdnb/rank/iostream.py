"""The engines' ``sys.stdout``/``sys.stderr``: ipykernel's OutStream, minus empty flushes,
plus output written below Python (C code, ``os.write``) that is never lost at a cell's end.

Empty flushes: an engine flushes both streams twice per request (ipyparallel after
``apply``, ipykernel before publishing "idle"). Each ``flush()`` from the main thread hands
two callbacks to the IOPub thread and waits for it to run them: four cross-thread round
trips per cell, even when the cell printed nothing. ``flush()`` here returns at once when
nothing is buffered, nothing is on its way from the file descriptor, no flush is scheduled
and there is no echo stream. Status messages go through the IOPub thread's queue in order
either way, so nothing can overtake anything.

File-descriptor output: ipykernel points fd 1/2 at a pipe that a thread reads into the
stream. Nothing tied that thread to ``flush()``: bytes a cell wrote just before it ended
were often read after "idle" went out, so the notebook never showed them (measured: 14 of
80 ``os.write`` lines missing from cell results with ipykernel's own stream). Here the
reader counts the bytes it takes out of the pipe and those it has buffered, and
``flush()`` first waits (at most ``fd_drain_timeout``) until every byte that was in the
pipe or in the reader's hands when it was called is buffered, then flushes them too.

Flushes a cell asks for too often: a progress bar that flushes at every update (plain
``tqdm`` at ``mininterval=0``: 10,000 a second) made one IOPub message per update, each a
cross-thread wait here and a message the notebook's client had to take apart; the notebook
fell seconds behind and the bar's last states arrived after the cell had ended. While a cell
runs (``coalesced()``), a flush within ``min_flush_gap`` of the last one schedules the next
timed send instead: at most one message per gap, nothing lost, the text in order. The flush
after the cell (ipyparallel's, before the reply) is a full one, as before.

Used through ``--IPEngine.out_stream_factory=hvdnb.rank.iostream.OutStream``.
"""

from __future__ import annotations

import fcntl
import os
import select
import sys
import termios
import threading
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ipykernel.iostream import PIPE_BUFFER_SIZE
from ipykernel.iostream import OutStream as _OutStream

__all__ = ["OutStream", "coalesced"]


class OutStream(_OutStream):
    #: longest a flush waits for file-descriptor output still on its way (seconds)
    fd_drain_timeout = 1.0
    #: shortest gap between two flushes while a cell runs (seconds); see ``coalesced``
    min_flush_gap = 0.05
    #: a cell is running: flushes closer than ``min_flush_gap`` are coalesced
    coalesce = False
    _last_flush = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # before ipykernel's __init__, which starts the pipe reader
        self._fd_lock = threading.Lock()
        self._fd_taken = 0  # bytes the reader took out of the pipe
        self._fd_done = 0  # ... and has put into the buffer
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]  # ipykernel: unannotated

    def _watch_pipe_fd(self) -> None:
        """ipykernel's pipe reader, counting what it took out of the pipe (under a lock
        that ``flush()`` snapshots with) and what it has buffered."""
        if self._fid is None:
            return
        try:
            while True:
                select.select([self._fid], [], [])
                with self._fd_lock:  # the pipe is readable: this read does not block
                    bts = os.read(self._fid, PIPE_BUFFER_SIZE)
                    self._fd_taken += len(bts)
                if not bts or not self._should_watch:
                    break
                self.write(bts.decode(errors="replace"))
                self._fd_done += len(bts)
                os.write(self._original_stdstream_copy, bts)
        except Exception:
            self._exc = sys.exc_info()

    def _drain_fd(self) -> None:
        """Wait until what was written to the file descriptor before this call is in the
        buffer (not what keeps coming after: a chatty thread cannot hold a flush)."""
        if self._fid is None or not self._should_watch:
            return
        n = array("i", [0])
        with self._fd_lock:
            try:
                fcntl.ioctl(self._fid, termios.FIONREAD, n, True)
            except OSError:
                return
            target = self._fd_taken + n[0]
        if self._fd_done >= target:
            return
        deadline = time.monotonic() + self.fd_drain_timeout
        while self._fd_done < target and time.monotonic() < deadline:
            time.sleep(0.0002)

    def flush(self) -> None:
        self._drain_fd()
        if self.echo is None and not self._flush_pending and not self._subprocess_flush_pending:
            with self._buffer_lock:
                empty = not any(buf.tell() for buf in self._buffers.values())
            if empty:
                return
        if self.coalesce:
            now = time.monotonic()
            if now - self._last_flush < self.min_flush_gap:
                self._schedule_flush()  # type: ignore[no-untyped-call]  # ipykernel: unannotated
                return
            self._last_flush = now
        super().flush()  # type: ignore[no-untyped-call]  # ipykernel: unannotated


@contextmanager
def coalesced() -> Iterator[None]:
    """While the block runs (a cell's code), the engine's streams coalesce flushes that come
    closer than ``OutStream.min_flush_gap``; after it, every flush is a full one."""
    streams = [s for s in (sys.stdout, sys.stderr) if isinstance(s, OutStream)]
    for s in streams:
        s.coalesce = True
    try:
        yield
    finally:
        for s in streams:
            s.coalesce = False
