"""pdb on a rank, driven from the notebook: post-mortem of a failed cell and ``breakpoint()``.

``%dist debug`` runs one pdb command at a time on the frames of the rank's last failed
cell (``debug_command``, the ``DEBUG_COMMAND`` remote call); ``breakpoint()`` inside a
``%%distributed`` cell opens pdb on the rank with its input and output over the side
channel, and the notebook's waiting loop shows the ``(Pdb rank N)`` prompt.

Owns: the last failed cell's exception, and pdb sessions on the rank. Never: read this
process's stdin, or import the notebook side.
"""

from __future__ import annotations

import io
import queue
import sys
import traceback
from typing import Any

from hvdnb.protocol import kinds
from hvdnb.protocol.replies import DebugReply
from hvdnb.rank import channel, visualdebug

__all__ = ["breakpoint_hook", "debug_command", "forget", "keep"]

#: ``last_error``: the exception of the last failed cell (kept until the next cell);
#: ``post_mortem``: the pdb session on its frames
_STATE: dict[str, Any] = {"last_error": None, "post_mortem": None}


# ------------------------------------------------------------------ post-mortem (%dist debug)
class _PostMortem:
    """pdb on the frames of the last failed cell, driven one command at a time from the
    notebook (``%dist debug``): output goes to a buffer, nothing reads this process's stdin."""

    def __init__(self, exc: BaseException) -> None:
        import pdb  # noqa: PLC0415  pdb: only when debugging

        self.buf = io.StringIO()
        self.pdb = pdb.Pdb(stdout=self.buf, nosigint=True)
        self.pdb.use_rawinput = False
        self.exc = exc
        self.pdb.reset()
        self.pdb.setup(None, exc.__traceback__)
        # hide this runner's frames, as the traceback does: the stack starts at the cell
        stack = self.pdb.stack
        first = next(
            (i for i, (f, _) in enumerate(stack) if f.f_code.co_filename.startswith("<cell ")), 0
        )
        self.pdb.stack = stack[first:]
        self.pdb.curindex = max(0, self.pdb.curindex - first)
        self.pdb.curframe = self.pdb.stack[self.pdb.curindex][0]
        self.pdb.curframe_locals = self.pdb.curframe.f_locals

    def run(self, line: str) -> tuple[str, bool]:
        self.buf.seek(0)
        self.buf.truncate()
        line = line.strip()
        if line in ("q", "quit", "exit", "c", "cont", "continue"):
            return "", True
        if not line:
            line = "where" if not self.pdb.lastcmd else self.pdb.lastcmd
        if line in ("interact",):
            return "*** interact needs a terminal: evaluate expressions directly\n", False
        try:
            self.pdb.onecmd(line)
            self.pdb.lastcmd = line
        except Exception as exc:  # a bad expression must not end the session
            self.buf.write(f"*** {type(exc).__name__}: {exc}\n")
        return self.buf.getvalue(), False


def keep(exc: BaseException) -> None:
    """The cell failed with ``exc``: keep its frames for ``%dist debug``."""
    _STATE["last_error"] = exc


def forget() -> None:
    """A new cell begins: the last failed cell's frames (and its pdb) go."""
    _STATE["last_error"] = _STATE["post_mortem"] = None


def debug_command(line: str | None) -> DebugReply:
    """One pdb command on the last failed cell's frames (None: start, show where it failed).

    Returns pdb's output and whether the session is over, or an ``error`` when there is
    nothing to debug on this rank."""
    exc = _STATE.get("last_error")
    if exc is None:
        return DebugReply(
            error="no failed cell on this rank since its last cell started (the frames "
            "are kept until the next %%distributed cell)"
        )
    pm = _STATE.get("post_mortem")
    if line is None or pm is None or pm.exc is not exc:
        pm = _STATE["post_mortem"] = _PostMortem(exc)
        head = "".join(traceback.format_exception_only(type(exc), exc))
        out, _ = pm.run("where")
        return DebugReply(out=head + out)
    out, done = pm.run(line)
    return DebugReply(out=out, done=done)


# ------------------------------------------------------------------ breakpoint() in a cell
_PDB_LINES: Any = None  # commands from the notebook for a paused pdb (a queue.Queue)


class _ChannelPdbIO:
    """pdb's stdin and stdout, over the side channel: what pdb writes is sent to the notebook
    when it asks for a command, and the notebook's answer is the command it reads."""

    def __init__(self, ch: Any) -> None:
        self.ch = ch
        self.buf: list[str] = []

    def write(self, text: str) -> int:
        self.buf.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        text, self.buf = "".join(self.buf), []
        self.ch.send(kinds.PDB_OUT, text=text, waiting=True)
        return str(_PDB_LINES.get()) + "\n"


def breakpoint_hook(*args: Any, **kwargs: Any) -> None:
    """``breakpoint()`` in a %%distributed cell: pdb on this rank, prompted in the notebook
    (the notebook shows ``(Pdb rank N)``); ``continue`` resumes the cell. Without a notebook
    to ask (a script), Python's own hook runs."""
    import pdb  # noqa: PLC0415  pdb: only when debugging

    global _PDB_LINES
    if visualdebug.active():  # JupyterLab's debugger is attached: it stops here
        visualdebug.breakpoint_here()
        return None
    ch = channel.get()
    if ch is None:
        sys.__breakpointhook__(*args, **kwargs)
        return None
    if _PDB_LINES is None:
        _PDB_LINES = queue.Queue()
        ch.on(kinds.PDB_CMD, lambda msg: _PDB_LINES.put(msg.get("line", "c")))
    io = _ChannelPdbIO(ch)
    # skip this runner and the engine's machinery: `next` past the cell's end resumes it
    p = pdb.Pdb(
        stdin=io,  # type: ignore[arg-type]  # readline/write/flush: all pdb uses of a stream
        stdout=io,  # type: ignore[arg-type]
        nosigint=True,
        skip=[
            "kernels_ext.*",
            "hvdnb.rank.*",
            "ipyparallel.*",
            "ipykernel.*",
            "IPython.*",
            "tornado.*",
            "asyncio.*",
            "zmq.*",
            "traitlets.*",
        ],
    )
    p.use_rawinput = False
    p.prompt = ""
    p.set_trace(sys._getframe(1))
