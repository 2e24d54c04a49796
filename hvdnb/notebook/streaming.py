"""A running cell's output, from the client's buffers to the notebook: merged, live, capped.

Owns: reading each rank's accumulated stdout/stderr (and displays) from the ipyparallel
client's metadata as they arrive, feeding them to ``OutputCollapser`` (``output.py``) and
writing what it emits to the cell's streams; past ``HVDNB_OUTPUT_LIMIT_MB`` a cell's output
goes on into a file, and the notebook gets one note and the last lines. Never: block on a
rank, reorder a rank's lines, or hold more than the output limit in the browser.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from typing import Any

from hvdnb.notebook.output import OutputCollapser

__all__ = ["Streamer"]


class Streamer:
    """Reads each rank's accumulated stdout/stderr from the client and feeds the collapser.

    Past ``limit`` bytes shown, the cell's output goes on into ``spill`` (a file that holds
    the whole of it, the part shown too) and only its last ``tail`` lines are shown when the
    cell ends, after one note saying how much was left out and where it is.
    """

    def __init__(
        self,
        metadata: list[Any],
        ranks: list[int],
        window: float,
        limit: int | None = None,
        spill: str | None = None,
        tail: int = 50,
    ) -> None:
        # hold the metadata dicts themselves: ipyparallel drops them from client.metadata
        # as soon as a result's output is complete
        self.pairs = list(zip(ranks, metadata))
        self.offsets: dict[tuple[int, str], int] = {}
        self.n_outputs: dict[int, int] = {}
        self.collapser = OutputCollapser(ranks, self._write, window)
        self.limit, self.spill_path = limit, spill
        self.shown = 0  # bytes written to the notebook
        self.held = 0  # lines past the limit (in the file only)
        self._head: list[tuple[str, str]] = []  # what was shown, for the file
        self._spill: Any = None
        self._tail: collections.deque[tuple[str, str]] = collections.deque(maxlen=tail)

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

    def pump(self, final: bool = False) -> None:
        now = time.monotonic()
        for rank, md in self.pairs:
            for name in ("stdout", "stderr"):
                text = md.get(name) or ""
                off = self.offsets.get((rank, name), 0)
                if len(text) < off:  # a carriage return rewrote the buffer
                    off = 0
                if len(text) > off:
                    self.collapser.feed(rank, name, text[off:], now)
                    self.offsets[(rank, name)] = len(text)
            outputs = md.get("outputs") or []
            seen = self.n_outputs.get(rank, 0)
            for out in outputs[seen:]:
                self._display(rank, out)
            self.n_outputs[rank] = len(outputs)
        if final:
            self.collapser.flush()
            self._close_spill()
        else:
            self.collapser.poll(now)
        sys.stdout.flush()
        sys.stderr.flush()

    def _display(self, rank: int, content: dict[str, Any]) -> None:
        from IPython.display import publish_display_data  # noqa: PLC0415  IPython: only inside a kernel

        self.collapser.flush()
        sys.stdout.write(f"[{rank}] output:\n")
        sys.stdout.flush()
        publish_display_data(content.get("data", {}), content.get("metadata", {}))
