"""The engines' ``sys.stdout``/``sys.stderr``: ipykernel's OutStream, minus empty flushes.

An engine flushes both streams twice per request (ipyparallel after ``apply``, ipykernel
before publishing "idle"). Each ``flush()`` from the main thread hands two callbacks to
the IOPub thread and waits for it to run them: four cross-thread round trips per cell,
even when the cell printed nothing. On a 2-core machine shared by the notebook, the
controller and every rank, each wait is also a chance to be descheduled.

``flush()`` here returns at once when nothing is buffered and no flush is scheduled, so
there is nothing to send and nothing whose order relative to the reply could change
(status messages go through the IOPub thread's queue in order either way). Any output,
or an echo stream, takes ipykernel's own path unchanged.

Used through ``--IPEngine.out_stream_factory=kernels_ext.iostream.OutStream``.
"""

from __future__ import annotations

from ipykernel.iostream import OutStream as _OutStream

__all__ = ["OutStream"]


class OutStream(_OutStream):
    def flush(self) -> None:
        if self.echo is None and not self._flush_pending and not self._subprocess_flush_pending:
            with self._buffer_lock:
                empty = not any(buf.tell() for buf in self._buffers.values())
            if empty:
                return
        super().flush()
