"""A rank paused at ``breakpoint()`` inside a running cell: its prompt, answered in the notebook.

Owns: the ranks' pdb output (``kinds.PDB_OUT``) and the answers (``kinds.PDB_CMD``). Never:
answer for the user, or wait for a rank.
"""

from __future__ import annotations

import queue
import sys
from typing import Any

from hvdnb.protocol import kinds

__all__ = ["PdbPrompt"]


class PdbPrompt:
    """Ranks paused at ``breakpoint()``: their pdb output arrives on the side channel (any
    thread); the cell's waiting loop (main thread) prints it and asks for the next command
    with ``input()``, as Jupyter asks for any input, and sends the answer to that rank."""

    _RESUME = frozenset({"c", "cont", "continue", "q", "quit", "exit"})

    def __init__(self, cluster: Any) -> None:
        self.channel = getattr(cluster, "channel", None)
        self.waiting: Any = queue.Queue()
        self.paused = False  # a prompt is being answered now (the stall watch holds off)
        if self.channel is not None:
            self.channel.on(kinds.PDB_OUT, self._on_out)

    def _on_out(self, msg: dict[str, Any]) -> None:
        if isinstance(msg.get("rank"), int):
            self.waiting.put((msg["rank"], str(msg.get("text", ""))))

    def serve(self) -> bool:
        """Answer every rank waiting for a command; returns whether any was."""
        served = False
        while not self.waiting.empty():
            rank, text = self.waiting.get()
            served = self.paused = True
            sys.stdout.write(text)
            sys.stdout.flush()
            try:
                line = input(f"(Pdb rank {rank}) ")
            except (EOFError, KeyboardInterrupt):
                line = "continue"
            if self.channel is not None:
                self.channel.send(rank, kinds.PDB_CMD, line=line)
            self.paused = False
        return served

    def close(self) -> None:
        if self.channel is not None:
            self.channel.off(kinds.PDB_OUT, self._on_out)
