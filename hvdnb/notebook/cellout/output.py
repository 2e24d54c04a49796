"""Merge the live output of many ranks into one readable stream.

Owns: splitting each rank's stream into lines, holding a line briefly so that the same
line printed by several ranks is shown once with the ranks that printed it, and the rank
labels (``[0]``, ``[0,1]``, ``[0-3]``). Pure: no clocks of its own (callers pass ``now``),
no I/O except the ``emit`` callback, so it is unit-tested without processes.

Never: reorder one rank's lines, or hold a line longer than ``window`` seconds; never do
work per line that grows with the lines held or shown (a loop printing every step sends tens
of thousands of lines: each costs O(1) amortised, whatever the backlog).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from hvdnb.notebook.metrics.ranklabels import format_ranks, parse_ranks

__all__ = ["OutputCollapser", "format_ranks", "parse_ranks", "per_rank_lines"]


def per_rank_lines(text: str, pattern: str) -> dict[int, list[int]]:
    """Each rank's numbers in merged output: every line ``[ranks] <pattern>`` (``pattern``
    with one ``(\\d+)`` group) counts for each rank its label names. What a reader (a test,
    a benchmark) uses to check that every rank's lines arrived once and in order."""
    got: dict[int, list[int]] = {}
    for label, num in re.findall(rf"^\[([\d,-]+)\] {pattern}$", text, re.M):
        for r in parse_ranks(label):
            got.setdefault(r, []).append(int(num))
    return got


#: torch's rank prefix on the lines its C++ core and ``torch.distributed`` log
_TORCH_RANK_PREFIX = re.compile(r"\[rank\d+\]:")
#: a glog header's date and time: ``[W1128 08:43:21.812345961 reducer.cpp:1431]``
_GLOG_TIME = re.compile(r"^\[([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ ")


def _without_rank_prefix(line: str) -> str:
    """torch's per-rank log prefix (c10 warnings, TORCH_CPP_LOG: ``[rank0]:[W1128
    08:43:21.81 reducer.cpp:1529] ...``) and its glog header's time, which differ per rank,
    taken off: the tag names the ranks, so the same message from every rank is one line."""
    m = _TORCH_RANK_PREFIX.match(line)
    if m is None:
        return line
    return _GLOG_TIME.sub(r"[\1 ", line[m.end() :], count=1)


@dataclass
class _Pending:
    stream: str
    text: str
    first_seen: float
    seq: int  # position in the output order; increases along ``_pending``
    ranks: set[int] = field(default_factory=set)


class OutputCollapser:
    """Collapse identical lines printed by several ranks into one tagged line.

    Parameters
    ----------
    ranks : the ranks whose output is expected (a line printed by all of them is
        emitted as soon as the last one prints it)
    emit : ``emit(stream, text)`` receives finished, tagged lines (``text`` ends in "\\n")
    window : seconds a line waits for other ranks to print the same line

    Examples
    --------
    >>> out = []
    >>> c = OutputCollapser([0, 1], lambda s, t: out.append(t), window=0.2)
    >>> c.feed(0, "stdout", "hello\\n", now=0.0); c.feed(1, "stdout", "hello\\n", now=0.01)
    >>> c.poll(now=0.02); out
    ['[0,1] hello\\n']
    """

    def __init__(
        self, ranks: Iterable[int], emit: Callable[[str, str], None], window: float = 0.25
    ) -> None:
        self.ranks = frozenset(ranks)
        self.emit = emit
        self.window = window
        self._partial: dict[tuple[int, str], str] = defaultdict(str)
        # how often each rank has printed a given line: the k-th "loss 0.1" of rank 0 merges
        # with the k-th "loss 0.1" of rank 1, never with its own second one
        self._seen: dict[tuple[int, str, str], int] = defaultdict(int)
        self._pending: dict[tuple[object, ...], _Pending] = {}
        self._next_seq = 0
        # the seq of each rank's latest line (held or already shown): a rank may join a held
        # line at once when its own latest line comes before it, which is the usual case
        self._last_seq: dict[int, int] = {}

    def feed(self, rank: int, stream: str, text: str, now: float) -> None:
        """Add raw text from ``rank``'s ``stream`` (any chunking, partial lines allowed)."""
        if not text:
            return
        buf = self._partial[(rank, stream)] + text
        *lines, rest = buf.split("\n")
        self._partial[(rank, stream)] = rest
        if "[rank" in buf:  # one search a chunk: a flood of plain lines pays nothing more
            lines = [_without_rank_prefix(line) for line in lines]
        for line in lines:
            self._add(rank, stream, line, now)
        self.poll(now)

    def _add(self, rank: int, stream: str, line: str, now: float) -> None:
        k = self._seen[(rank, stream, line)]
        self._seen[(rank, stream, line)] = k + 1
        key: tuple[object, ...] = (stream, line, k)
        entry = self._pending.get(key)
        if (
            entry is not None
            and rank not in entry.ranks
            and (self._last_seq.get(rank, -1) < entry.seq or self._make_room(rank, entry))
        ):
            entry.ranks.add(rank)
            self._last_seq[rank] = max(self._last_seq.get(rank, -1), entry.seq)
            return
        if entry is not None:  # cannot merge without reordering: keep it apart
            key = (stream, line, k, rank)
        elif not self._holds(rank) and self._late(rank, stream, line, k):
            # every other rank's copy of this line was already shown alone (it waited out
            # the window): nothing can join it, and nothing of this rank's is held before
            # it, so it is shown now. Holding it instead put it behind the held lines, and
            # each next line of this rank then had to move it ahead (``_make_room``, linear
            # in the lines held): a rank lagging behind a 20,000-line flood made that
            # quadratic, 50-80 % of the kernel's time in the flood
            self._emit(_Pending(stream, line, now, -1, {rank}))
            return
        entry = self._pending[key] = _Pending(stream, line, now, self._next_seq)
        self._next_seq += 1
        entry.ranks.add(rank)
        self._last_seq[rank] = entry.seq

    def _holds(self, rank: int) -> bool:
        """Some line of ``rank`` is still held: lines leave in ``seq`` order, so exactly
        when its latest line (held or shown) is not before the oldest one held."""
        head = next(iter(self._pending.values()), None)
        return head is not None and self._last_seq.get(rank, -1) >= head.seq

    def _late(self, rank: int, stream: str, line: str, k: int) -> bool:
        """Every other expected rank has printed its ``k``-th copy of ``line`` already (and,
        as it is not held, it was shown)."""
        others = self.ranks - {rank}
        return bool(others) and all(self._seen.get((q, stream, line), 0) > k for q in others)

    def _make_room(self, rank: int, target: _Pending) -> bool:
        """Can ``rank`` join ``target`` without breaking any rank's order?

        Its own lines still waiting behind ``target`` were printed earlier, so they must be
        shown first: move them ahead of ``target`` when no other rank in them has a line in
        between (moving those would reorder that rank); otherwise refuse. Only called when
        ``rank`` has a line held behind ``target`` (rare: ranks printing different lines
        around a shared one); its cost is linear in the lines held.
        """
        items = list(self._pending.items())
        at = next(i for i, (_, e) in enumerate(items) if e is target)
        behind = [i for i in range(at + 1, len(items)) if rank in items[i][1].ranks]
        if not behind:
            return True
        moved = set(behind)
        for i in behind:
            others = items[i][1].ranks - {rank}
            for j in range(at, i):
                if j not in moved and others & items[j][1].ranks:
                    return False
        order = (
            items[:at]
            + [items[i] for i in behind]
            + [items[j] for j in range(at, len(items)) if j not in moved]
        )
        self._pending = dict(order)
        for entry in self._pending.values():  # renumber in the new order
            entry.seq = self._next_seq
            self._next_seq += 1
            for r in entry.ranks:
                self._last_seq[r] = entry.seq
        return True

    def poll(self, now: float) -> None:
        """Emit, in order of first appearance, every line that is complete or has waited long
        enough. A complete line behind a still-waiting one waits too, so no rank's lines are
        reordered."""
        while self._pending:
            key, entry = next(iter(self._pending.items()))
            if entry.ranks >= self.ranks or now - entry.first_seen >= self.window:
                del self._pending[key]
                self._emit(entry)
            else:
                break

    def release(self, rank: int | None = None) -> None:
        """Emit, in order and without waiting for other ranks, the complete lines held up to
        the last one of ``rank`` (every one when None): what a rank printed before a display
        of its own must come before it. Lines after it keep waiting to merge; partial lines
        stay."""
        if rank is None:
            self.poll(float("inf"))
            return
        while self._holds(rank):
            key, entry = next(iter(self._pending.items()))
            del self._pending[key]
            self._emit(entry)

    def take_partial(self, rank: int, stream: str) -> str:
        """Hand over ``rank``'s unfinished line on ``stream`` (it is drawn elsewhere: a
        progress bar's line, on the rank's screen)."""
        return self._partial.pop((rank, stream), "")

    def flush(self) -> None:
        """Emit everything held, partial lines included (the cell has ended)."""
        for (rank, stream), rest in list(self._partial.items()):
            if rest:
                self._add(rank, stream, rest, float("-inf"))
        self._partial.clear()
        for entry in list(self._pending.values()):
            self._emit(entry)
        self._pending.clear()

    def _emit(self, entry: _Pending) -> None:
        self.emit(entry.stream, f"[{format_ranks(entry.ranks)}] {entry.text}\n")
