"""The recorder's ring: preallocated typed columns of ``(step, time, name id, value)`` rows,
the name table, and the rows taken out of it for a message (``take``).

Owns: ``Ring`` (its columns, its write and read cursors, the values kept as objects until a
pack reads them, the count of rows lost to a lap), the grouping of rows into a message's
columns (``_columns``, ``_period``) and the reading of values (``scalar`` in the step: never
waits; ``as_float`` at pack: may wait for a CUDA value, off the step). Its one writer (the
drain) and its reader (``take``) are serialised by the recorder's lock. Never: wait in the
training thread, issue a collective, import torch, or send.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

__all__ = ["Ring", "as_float", "numpy", "scalar"]

_NUMBER = (int, float)
#: rows from which a message's columns are grouped with numpy (see _columns)
_GROUP_NP = 256
_NP: Any = None


def numpy() -> Any:
    """numpy, imported on first use (a loop that never drains many rows never pays for it)."""
    global _NP
    if _NP is None:
        import numpy as np  # noqa: PLC0415  numpy on first use: a loop that never drains many rows never pays for it

        _NP = np
    return _NP


class Ring:
    """``capacity`` rows (a power of two) in four typed columns; ``w`` rows written and ``r``
    rows taken so far (monotonic: row ``i`` sits at ``i & mask``).

    The drain writes rows ``w``, ``w + 1``, ... (``put`` values; ``keep`` a value that is
    not a float yet) and publishes them by setting ``w`` last; ``take`` copies rows
    ``r``..``w`` out with slices and reads the kept objects.
    """

    __slots__ = (
        "_npv",
        "capacity",
        "has_objects",
        "lost",
        "mask",
        "name_ids",
        "name_list",
        "names",
        "objq",
        "r",
        "steps",
        "times",
        "vals",
        "w",
    )

    def __init__(self, capacity: int) -> None:
        if capacity < 2 or capacity & (capacity - 1):
            raise ValueError(f"capacity must be a power of two, not {capacity}")
        self.capacity = capacity
        self.mask = capacity - 1
        # preallocated typed columns: the drain only stores C numbers into them (no Python
        # objects kept alive, none freed when a slot is reused), and a message is cut out
        # of them with slices
        self.steps = array("q", bytes(8 * capacity))
        self.times = array("d", bytes(8 * capacity))
        self.names = array("i", bytes(4 * capacity))
        self.vals = array("d", bytes(8 * capacity))
        # (row, object) for values that are not numbers yet (a CUDA loss, an NCCL timing):
        # their row holds NaN until the next take reads them (off the training thread)
        self.objq: deque[tuple[int, Any]] = deque()
        self.has_objects = False  # a value that is not a float was stored since the last take
        self.w = 0  # rows written (monotonic); only the drain writes it
        self.r = 0  # rows taken; only take writes it
        self.lost = 0  # rows overwritten before a take (the ring was lapped)
        self.name_ids: dict[str, int] = {}
        self.name_list: list[str] = []
        self._npv: Any = None  # numpy views of the columns (see views)

    def nid(self, name: str) -> int:
        """The id of row name ``name`` (a new one the first time)."""
        i = self.name_ids.get(name)
        if i is None:
            i = self.name_ids[name] = len(self.name_list)
            self.name_list.append(name)
        return i

    def keep(self, w: int, v: Any) -> float:
        """Row ``w``'s value ``v`` is not a float (``scalar`` could not make it one without
        waiting): keep it to be read at the next take; the row holds NaN until then."""
        self.objq.append((w, v))  # before the row is published (a take reads rows < w)
        self.has_objects = True
        return math.nan

    def views(self) -> tuple[Any, Any, Any, Any]:
        """numpy views of the four columns (steps, times, name ids, values)."""
        if self._npv is None:
            np = numpy()
            self._npv = (
                np.frombuffer(self.steps, np.int64),
                np.frombuffer(self.times),
                np.frombuffer(self.names, np.intc),
                np.frombuffer(self.vals),
            )
        return self._npv  # type: ignore[no-any-return]

    def take(self) -> dict[str, list[Any]]:
        """Every row written since the last take, as ``{name: [steps, times, values]}``
        (the kept objects read now: a CUDA value may wait for its device); counts the rows
        a lap overwrote in ``lost``. The caller holds the recorder's lock."""
        # cleared before w is read: an object stored after this is flagged again; the queue
        # itself, not the flag, says which rows below w hold objects to read
        self.has_objects = False
        w = self.w
        r = self.r
        if w - r > self.capacity:  # the ring was lapped: the oldest rows are gone
            self.lost += w - r - self.capacity
            r = w - self.capacity
        # copy the rows out with slices (C speed) while the writer goes on above w
        a, b = r & self.mask, w & self.mask
        cols: dict[str, list[Any]] = {}
        if w - r:
            parts: list[array[Any]] = []
            ring: tuple[array[Any], ...] = (self.steps, self.times, self.names, self.vals)
            for col in ring:
                # wrapped around the end of the ring (or exactly full): two slices
                parts.append(col[a:b] if a < b else col[a:] + col[:b])
            steps, times, nids, vals = parts
            if self.objq:
                self._read_objects(vals, r, w)
            cols = _columns(steps, times, nids, vals, self.name_list)
        q = self.objq  # rows overwritten by a lap: their objects are dropped unread
        while q and q[0][0] < w:
            q.popleft()
        # a take racing the writer may have read a row being overwritten: only the lapped
        # case can do that, and then it is counted as lost
        self.r = w
        return cols

    def _read_objects(self, vals: array[float], r: int, w: int) -> None:
        """Fill the NaN placeholders of rows ``r``..``w`` with their objects' values."""
        q = self.objq
        while q and q[0][0] < w:
            row, obj = q.popleft()
            if row >= r:
                vals[row - r] = as_float(obj)


def scalar(v: Any) -> Any:
    """``v`` as a float when that is cheap and never waits for a device: an int, or a CPU
    tensor of one element (~0.2 us warm, ~2.5 us in a loop); anything else as it is, read
    by ``as_float`` at the next take, on whichever thread sends (a CUDA tensor must not be
    read in the step)."""
    try:
        if getattr(v, "is_cpu", False):  # ``tolist`` reads a 0-d tensor ~20 % quicker
            return float(v.tolist() if v.ndim == 0 else v.item())  # than ``item`` (in a loop)
        if isinstance(v, _NUMBER):  # int, bool, numpy's float64
            return float(v)
        if type(v).__module__ == "numpy":  # numpy's other scalars
            return float(v)
    except Exception:  # an int too large for a float, a tensor of many elements: NaN later
        pass
    return v


def as_float(v: Any) -> float:
    if type(v) is float:
        return v
    try:
        item = getattr(v, "item", None)  # a tensor: read here, on the flusher thread
        return float(item() if item is not None else v)
    except Exception:
        return math.nan


def _period(nids: Sequence[int]) -> int:
    """The length p of the repeating pattern of names when every step records the same
    names in the same order (row k has the name of row k % p), else 0."""
    n = len(nids)
    first = nids[0]
    try:
        p = nids.index(first, 1)
    except ValueError:
        p = n
    head = nids[:p]
    if len(set(head)) != p:
        return 0
    for k in range(p):
        col = nids[k::p]
        if col.count(head[k]) != len(col):
            return 0
    return p


def _columns(
    steps: array[int], times: array[float], nids: array[int], vals: array[float], names: list[str]
) -> dict[str, list[Any]]:
    """Group rows (in order) into ``{name: [steps, times, values]}`` (typed arrays)."""
    cols: dict[str, list[Any]] = {}
    p = _period(nids)
    if p:  # the usual loop: strided slices, no per-row Python work
        for k in range(p):
            cols[names[nids[k]]] = [steps[k::p], times[k::p], vals[k::p]]
        return cols
    if len(nids) >= _GROUP_NP:  # a loop's rows with timed collectives among them
        np = numpy()
        nv = np.frombuffer(nids, np.intc)
        order = np.argsort(nv, kind="stable")  # row order kept within a name
        ids, starts = np.unique(nv[order], return_index=True)
        ends = [*starts[1:], len(nv)]
        sv, tv, vv = (np.frombuffer(steps, np.int64), np.frombuffer(times), np.frombuffer(vals))
        groups = sorted(zip(order[starts].tolist(), ids.tolist(), starts.tolist(), ends))
        for _, i, a, b in groups:  # names in the order they first appear, as below
            ix = order[a:b]
            cols[names[i]] = [
                array("q", sv[ix].tobytes()),
                array("d", tv[ix].tobytes()),
                array("d", vv[ix].tobytes()),
            ]
        return cols
    rows: dict[int, list[int]] = {}
    for k, i in enumerate(nids):
        ix = rows.get(i)
        if ix is None:
            rows[i] = [k]
        else:
            ix.append(k)
    for i, ix in rows.items():
        if len(ix) == 1:
            k = ix[0]
            cols[names[i]] = [
                array("q", (steps[k],)),
                array("d", (times[k],)),
                array("d", (vals[k],)),
            ]
        else:
            get = itemgetter(*ix)
            cols[names[i]] = [array("q", get(steps)), array("d", get(times)), array("d", get(vals))]
    return cols
