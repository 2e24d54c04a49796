"""What a rank's redrawn lines look like: progress bars drawn as a terminal would draw them.

A progress bar redraws its line: plain ``tqdm`` writes ``\\r`` and the new state, Keras'
progbar backspaces (``\\b``) over its last state, Rich moves the cursor up (``ESC[1A``) and
erases lines (``ESC[2K``). A notebook's output area draws ``\\r`` and ``\\b`` within one
stream, but the ranks' streams are merged into one, and it draws no cursor moves at all.
So the lines a rank redraws are drawn here, on a small screen of that rank's own, and the
notebook shows the screen as one display per rank that is updated in place (``Screen``):
each rank's bar stays on its own line, and a rank that lags shows it.

Owns: telling text that redraws (``redraws``) from plain lines (which ``OutputCollapser``
merges across ranks), and the screen a rank's redrawing text makes. Pure: no I/O, no clock.

Never: let a cursor or erase sequence reach the notebook as text; drop colour (SGR
sequences are kept, the notebook draws them); grow without bound (``max_lines``).
"""

from __future__ import annotations

import re

__all__ = ["Screen", "redraws", "strip_controls"]

#: a control that moves the cursor or erases: a carriage return that is not a line end, a
#: backspace, or a CSI sequence other than SGR (colour, ``ESC[...m``)
_REDRAW = re.compile(r"\r(?!\n)|\x08|\x1b\[[0-9;?]*[A-Za-ln-z]")
#: what the screen interprets, one token at a time
_TOKEN = re.compile(r"(\r\n|\n|\r|\x08|\x1b\[[0-9;?]*[A-Za-ln-z])")
_CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")


def redraws(text: str) -> bool:
    """Whether ``text`` moves the cursor back or erases (a bar redrawing its line)."""
    return _REDRAW.search(text) is not None


def strip_controls(text: str) -> str:
    """``text`` without cursor and erase sequences (colour kept): what is left of a redrawing
    text where no screen draws it."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-ln-z]", "", text)


class Screen:
    """A few lines of a terminal: text written at a cursor, which ``\\r``, ``\\b``, ``\\n``
    and CSI cursor moves (``A`` up, ``B`` down, ``C`` right, ``D`` left, ``G`` column,
    ``K`` erase in line, ``J`` erase below) move; other CSI sequences (``?25l`` hides the
    cursor) are dropped. Colour sequences count as text (a colour change inside a line that
    is later overwritten in part may be cut; bars that colour redraw the whole line).

    Parameters
    ----------
    max_lines : lines kept; older ones scroll off the top (they stay in ``%dist logs``)

    Examples
    --------
    >>> s = Screen()
    >>> s.feed("  0%|   | 0/3\\r 33%|#  | 1/3\\r100%|###| 3/3\\n")
    >>> s.text()
    '100%|###| 3/3'
    """

    def __init__(self, max_lines: int = 200) -> None:
        self.lines: list[str] = [""]
        self.row = 0
        self.col = 0
        self.max_lines = max_lines

    @property
    def at_rest(self) -> bool:
        """The cursor is at the start of a fresh last line (after a newline): what comes
        next may be plain text again."""
        return self.row == len(self.lines) - 1 and self.col == 0 and not self.lines[-1]

    def feed(self, text: str) -> None:
        for tok in _TOKEN.split(text):
            if not tok:
                continue
            if tok in ("\n", "\r\n"):
                self._newline()
            elif tok == "\r":
                self.col = 0
            elif tok == "\x08":
                self.col = max(0, self.col - 1)
            elif tok.startswith("\x1b["):
                self._csi(tok)
            else:
                self._write(tok)

    def _write(self, s: str) -> None:
        line = self.lines[self.row]
        if self.col > len(line):
            line += " " * (self.col - len(line))
        self.lines[self.row] = line[: self.col] + s + line[self.col + len(s) :]
        self.col += len(s)

    def _newline(self) -> None:
        self.row += 1
        self.col = 0
        if self.row == len(self.lines):
            self.lines.append("")
            if len(self.lines) > self.max_lines:
                del self.lines[0]
                self.row -= 1

    def _csi(self, tok: str) -> None:
        m = _CSI.fullmatch(tok)
        if m is None:
            return
        args, final = m.groups()
        if args.startswith("?"):
            return  # cursor visibility and other private modes: nothing to draw
        n = int(args.split(";")[0]) if args.split(";")[0].isdigit() else None
        if final == "A":
            self.row = max(0, self.row - (n or 1))
        elif final == "B":
            self.row = min(len(self.lines) - 1, self.row + (n or 1))
        elif final == "C":
            self.col += n or 1
        elif final == "D":
            self.col = max(0, self.col - (n or 1))
        elif final == "G":
            self.col = max(0, (n or 1) - 1)
        elif final == "K":
            line = self.lines[self.row]
            if n in (None, 0):
                self.lines[self.row] = line[: self.col]
            elif n == 1:
                self.lines[self.row] = " " * min(self.col, len(line)) + line[self.col :]
            else:
                self.lines[self.row] = ""
        elif final == "J" and n in (None, 0):
            self.lines[self.row] = self.lines[self.row][: self.col]
            del self.lines[self.row + 1 :]

    def text(self) -> str:
        """What the screen shows: without the fresh last line a final newline opened, nor
        the blank lines above the first drawn one (a live display that moved up and
        erased leaves them)."""
        lines = self.lines[:-1] if self.at_rest and len(self.lines) > 1 else self.lines
        first = next((i for i, ln in enumerate(lines) if ln.strip()), len(lines) - 1)
        return "\n".join(lines[first:])
