"""Horovod-style timeline: Chrome-trace JSON of every collective, per rank and merged.

Owns: ``start_timeline`` / ``stop_timeline``, the per-rank writer and ``merge_timelines``.
The writer is a comm listener: it records only what already happened, never issues a
collective while recording. The file on disk is valid JSON after every flush (a closed
array, rewritten in place at its end), so an interrupted run leaves a readable trace; it
stops recording (with a marker event) past ``Config.timeline_max_bytes``.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

from hvdnb.config import get_config
from hvdnb.torch.basics import rank, size
from hvdnb.torch.collectives import barrier
from hvdnb.torch.listeners import add_comm_listener, remove_comm_listener

__all__ = ["TimelineWriter", "merge_timelines", "start_timeline", "stop_timeline"]


class TimelineWriter:
    """Append Chrome-trace events to ``path``, keeping the file a valid JSON array.

    Events are buffered and flushed every ``flush_interval`` seconds (and at close, exit
    and SIGTERM). Each flush overwrites the closing bracket, so a reader always sees
    ``[...]``; a process killed mid-run loses at most one interval.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        pid: int,
        max_bytes: int | None = None,
        flush_interval: float = 0.5,
    ) -> None:
        self.path = Path(path)
        self.pid = pid
        self.max_bytes = get_config().timeline_max_bytes if max_bytes is None else max_bytes
        self.flush_interval = flush_interval
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w+b")  # noqa: SIM115 (open until close(), by design)
        meta = {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid}"}}
        self._f.write(b"[\n" + json.dumps(meta).encode() + b"\n]\n")
        self._f.flush()
        self._size = self._f.tell()
        self._buf: list[bytes] = []
        self._last = time.monotonic()
        self.truncated = False
        self.closed = False
        #: NCCL collectives whose CUDA timings the GPU has not finished yet
        self._deferred: list[tuple[Any, ...]] = []

    def event(self, name: str, cat: str, ts_us: float, dur_us: float, **args: Any) -> None:
        """Record one complete event ("ph": "X"); drops events past the size bound."""
        if self.closed or self.truncated:
            return
        ev = {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": round(ts_us, 1),
            "dur": round(dur_us, 1),
            "pid": self.pid,
            "tid": 0,
            "args": args,
        }
        self._buf.append(json.dumps(ev, separators=(",", ":")).encode())
        if time.monotonic() - self._last > self.flush_interval:
            self.flush()

    def defer(
        self, name: str, cat: str, end_us: float, seconds: Any, exposed: Any, **args: Any
    ) -> None:
        """An event whose duration (and exposed time) are CUDA timings: written at a flush
        once the GPU has finished them, so recording never waits for the device."""
        if not (self.closed or self.truncated):
            self._deferred.append((name, cat, end_us, seconds, exposed, args))
            if time.monotonic() - self._last > self.flush_interval:
                self.flush()

    def _resolve(self, force: bool) -> None:
        keep = []
        for item in self._deferred:
            name, cat, end_us, seconds, exposed, args = item
            if not force and not all(
                getattr(v, "ready", lambda: True)() for v in (seconds, exposed)
            ):
                keep.append(item)
                continue
            sec, exp = _seconds(seconds), _seconds(exposed)
            if sec != sec:
                sec = exp if exp == exp else 0.0
            ev = {
                "name": name,
                "cat": cat,
                "ph": "X",
                "ts": round(end_us - sec * 1e6, 1),
                "dur": round(sec * 1e6, 1),
                "pid": self.pid,
                "tid": 0,
                "args": {**args, "exposed_us": round(exp * 1e6, 1) if exp == exp else None},
            }
            self._buf.append(json.dumps(ev, separators=(",", ":")).encode())
        self._deferred = keep

    def flush(self, force: bool = False) -> None:
        """Write buffered events, keeping the file a closed JSON array."""
        self._last = time.monotonic()
        if self._deferred and not self.closed:
            self._resolve(force)
        if not self._buf or self.closed:
            return
        chunk = b"".join(b",\n" + e for e in self._buf)
        self._buf = []
        if self._size + len(chunk) > self.max_bytes:
            marker = {
                "name": "timeline truncated",
                "ph": "i",
                "s": "g",
                "pid": self.pid,
                "ts": time.time() * 1e6,
                "args": {
                    "max_bytes": self.max_bytes,
                    "fix": "raise HVDNB_TIMELINE_MAX_BYTES or trace fewer steps",
                },
            }
            chunk = b",\n" + json.dumps(marker).encode()
            self.truncated = True
        self._f.seek(self._size - 3)  # the "\n]\n" tail
        self._f.write(chunk + b"\n]\n")
        self._f.flush()
        self._size = self._f.tell()

    def close(self) -> None:
        if not self.closed:
            self.flush(force=True)
            self._f.close()
            self.closed = True


_ACTIVE: dict[str, Any] = {}


def _seconds(v: Any) -> float:
    try:
        return float(v.item() if hasattr(v, "item") else v)
    except Exception:
        return math.nan


def _listener(name: str, nbytes: int, seconds: Any, backend: str, exposed: Any) -> None:
    """One collective completed (as the host sees it). Its span ends now and lasts its own
    duration; NCCL's are CUDA timings (the kernel's time), written once the GPU is done."""
    w = _ACTIVE.get("writer")
    if w is None:
        return
    now = time.time() * 1e6
    cat = name.split(".", 1)[0]
    if type(seconds) is not float or type(exposed) is not float:
        w.defer(name, cat, now, seconds, exposed, bytes=nbytes, backend=backend)
        return
    if seconds != seconds:
        seconds = exposed
    w.event(
        name,
        cat,
        now - seconds * 1e6,
        seconds * 1e6,
        bytes=nbytes,
        backend=backend,
        exposed_us=round(exposed * 1e6, 1),
    )


def _rank_path(path: Path, rank: int) -> Path:
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix or '.json'}")


def _on_term(signum: int, frame: Any) -> None:
    w = _ACTIVE.get("writer")
    if w is not None:
        w.close()
    prev = _ACTIVE.get("prev_term")
    if callable(prev):
        prev(signum, frame)
    else:
        raise SystemExit(128 + signum)


def start_timeline(file_path: str | os.PathLike[str], mark_cycles: bool = False) -> Path:
    """Start recording this rank's collectives to ``<stem>.rank<R>.json`` next to file_path.

    Not collective. ``stop_timeline(merge=True)`` merges every rank's file into
    ``file_path``. Open the result in ``chrome://tracing`` or https://ui.perfetto.dev.
    ``mark_cycles`` is accepted for Horovod compatibility and ignored.

    Returns
    -------
    pathlib.Path
        This rank's file.
    """

    stop_timeline(merge=False)
    path = Path(file_path)
    mine = _rank_path(path, rank())
    _ACTIVE.update(writer=TimelineWriter(mine, rank()), path=path)
    add_comm_listener(_listener)
    if not _ACTIVE.get("hooked"):
        atexit.register(lambda: _ACTIVE.get("writer") and _ACTIVE["writer"].close())
        try:
            _ACTIVE["prev_term"] = signal.signal(signal.SIGTERM, _on_term)
        except ValueError:  # not the main thread (e.g. an engine's worker): atexit only
            pass
        _ACTIVE["hooked"] = True
    return mine


def stop_timeline(merge: bool = True) -> Path | None:
    """Stop recording and close this rank's file.

    With ``merge=True`` this is collective (a barrier): rank 0 then merges every rank's file
    into the path given to ``start_timeline`` and returns it (other ranks return None).
    """
    w = _ACTIVE.pop("writer", None)
    remove_comm_listener(_listener)
    if w is None:
        return None
    w.close()
    path: Path = _ACTIVE.pop("path")
    if not merge:
        return None

    barrier()
    if rank() != 0:
        return None
    return merge_timelines([_rank_path(path, r) for r in range(size())], path)


def merge_timelines(paths: list[Path], out: str | os.PathLike[str]) -> Path:
    """Merge per-rank timeline files into one Chrome trace (one process row per rank)."""
    events: list[Any] = []
    for p in paths:
        with open(p) as f:
            events.extend(json.load(f))
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0)))
    outp = Path(out)
    tmp = outp.with_suffix(".tmp")
    tmp.write_text(json.dumps(events))
    tmp.replace(outp)  # readers never see a half-written merge
    return outp
