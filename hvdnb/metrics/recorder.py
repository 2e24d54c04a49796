"""Engine side of the live panel: record points into a preallocated ring, flush them in batches.

Owns: ``log`` (loss and any scalar per step), ``phase`` (time a block: data / compute /
comm), the allreduce listener that ``hvdnb.torch.DistributedOptimizer`` feeds through
``hvdnb.torch.add_comm_listener``, ``ddp_comm_hook`` for plain DDP users, memory sampling
(psutil RSS; torch.cuda allocated/reserved and NVML used when there is a GPU), and the
flusher thread that sends one sequence-numbered ``metrics`` message per flush interval
over the side channel (``kernels_ext.channel.get()``).

Step attribution: ``log(step=s)`` records step ``s`` and says "step s is done", so the
step in progress becomes ``s + 1``; ``knobs.step(s)`` (start of a step) says "step s is in
progress". Allreduce timings and ``phase`` blocks are recorded against the step in
progress. Tensors (a CUDA loss) are kept as references and turned into floats on the
flusher thread, so the training thread never waits for the device.

Never: block the step, issue a collective, call ``cuda.synchronize``, import torch
(it is used only when the training code already imported it), or raise into the training
loop because the panel is absent: without an hvdnb cluster (``get()`` is None) ``log``
writes into the ring and nothing else happens.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

__all__ = ["Recorder", "get_recorder", "log", "phase", "ddp_comm_hook", "set_enabled"]

#: rows the ring holds between two flushes before the oldest are overwritten (and counted)
CAPACITY = 1 << 16
#: the training loop counts as idle (knob changes then apply at once) after this long
IDLE_AFTER = 1.0

_NUMBER = (int, float)


class Recorder:
    """A per-process ring of ``(step, time, name_id, value)`` rows and its flusher.

    Parameters
    ----------
    rank : this process's rank
    channel : an object with ``send(kind, **payload)`` (``kernels_ext.channel``), or None
    flush_interval : seconds between two messages
    capacity : ring size in rows
    """

    def __init__(
        self,
        rank: int,
        channel: Any = None,
        flush_interval: float = 0.25,
        capacity: int = CAPACITY,
    ) -> None:
        self.rank = rank
        self.channel = channel
        self.flush_interval = float(flush_interval)
        if capacity < 2 or capacity & (capacity - 1):
            raise ValueError(f"capacity must be a power of two, not {capacity}")
        self.capacity = capacity
        self._mask = capacity - 1
        # preallocated columns: the hot path only stores into them
        self._steps = [0] * capacity
        self._times = [0.0] * capacity
        self._names = [0] * capacity
        self._vals: list[Any] = [0.0] * capacity
        self._w = 0  # rows written (monotonic); only the training thread writes it
        self._r = 0  # rows flushed; only the flusher writes it
        self._name_ids: dict[str, int] = {}
        self._name_list: list[str] = []
        self._sent_names = 0
        # events from other threads (DDP hook futures, gloo callbacks): deque.append is atomic
        self._side: deque[tuple[int, float, str, float]] = deque()
        self.cur_step = 0  # the step in progress
        self._prev_step = -1  # the last step given to log()
        self.last_log = 0.0  # perf_counter of the last log()
        self.last_activity = 0.0  # perf_counter of the last log() or knobs.step()
        self._last_mark = 0.0
        self.step_time = 0.0  # EWMA of the time between two log() calls
        self.seq = 0
        self.overwritten = 0
        self.meta: dict[str, Any] = {}
        self.enabled = True
        self._owner = threading.get_ident()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # serialises flushes (thread vs explicit flush())
        # held from packing to sending: two flushes (the flusher thread, an explicit or
        # end-of-cell flush) must send their sequence numbers in order
        self._send_lock = threading.Lock()
        self._mem = _MemorySampler()
        self.comm_backend = ""
        #: set by the engine while a %%distributed cell runs (None: not under an engine)
        self.cell_running: bool | None = None
        self.pid = os.getpid()
        self._last_sent = 0.0

    # ------------------------------------------------------------------ hot path
    def _nid(self, name: str) -> int:
        i = self._name_ids.get(name)
        if i is None:
            i = self._name_ids[name] = len(self._name_list)
            self._name_list.append(name)
        return i

    def record(self, step: int, name: str, value: Any, t: float | None = None) -> None:
        """Store one point (training thread: ring; any other thread: a side queue)."""
        if t is None:
            t = time.time()
        if threading.get_ident() != self._owner:
            self._side.append((step, t, name, value))
            return
        w = self._w
        i = w & self._mask
        self._steps[i] = step
        self._times[i] = t
        self._names[i] = self._nid(name)
        self._vals[i] = value
        self._w = w + 1  # published last: the flusher reads rows below _w only

    def log(self, step: int, loss: Any = None, **metrics: Any) -> None:
        if not self.enabled:
            return
        step = int(step)
        now = time.perf_counter()
        t = time.time()
        prev = self._prev_step
        if self.last_log and step > prev:
            self.record(step, "time/step", (now - self.last_log) / (step - prev), t)
        self._prev_step = step
        self.last_log = now
        if loss is not None:
            self.record(step, "loss", loss, t)
        for k, v in metrics.items():
            if k == "total_steps":
                self.meta["total_steps"] = int(v)
                continue
            if k in _PHASE_ALIASES:
                k = _PHASE_ALIASES[k]
            self.record(step, k, v, t)
        self.mark(step + 1, now)
        k = _knobs_mod().CURRENT
        if k is not None:
            k._advance(step + 1)
        self._ensure_flusher()

    def mark(self, step: int, now: float | None = None) -> None:
        """Step ``step`` is now in progress (updates the step-time estimate)."""
        now = time.perf_counter() if now is None else now
        if step > self.cur_step and self._last_mark:
            per = (now - self._last_mark) / (step - self.cur_step)
            self.step_time = per if not self.step_time else 0.8 * self.step_time + 0.2 * per
        if step != self.cur_step or not self._last_mark:
            self._last_mark = now
        self.cur_step = step
        self.last_activity = now

    def new_loop(self) -> None:
        """Forget the step in progress (the engine calls it when a cell starts): step
        numbers start over in each loop, and a collective before the first ``log`` or
        ``knobs.step`` belongs to step 0, not to the previous cell's last step."""
        self.cur_step = 0
        self._prev_step = -1
        self.last_log = 0.0
        self._last_mark = 0.0

    def on_comm(self, name: str, nbytes: int, seconds: Any, backend: str,
                exposed: float = math.nan) -> None:
        """``hvdnb.torch`` comm listener: one collective (or fused bucket) just completed.

        Records ``comm/<name>/time`` (the collective's own duration; a CUDA-event span is
        kept as an object and read on the flusher thread), ``comm/<name>/exposed`` (what
        the training thread waited for it) and ``comm/<name>/bytes``.
        """
        if not self.enabled:
            return
        self.comm_backend = backend
        short = name.replace("DistributedOptimizer.", "")
        t = time.time()
        step = self.cur_step
        self.record(step, f"comm/{short}/time", seconds, t)
        self.record(step, f"comm/{short}/exposed", exposed, t)
        self.record(step, f"comm/{short}/bytes", nbytes, t)

    # ------------------------------------------------------------------ flushing
    def _ensure_flusher(self) -> None:
        if self._thread is None and self.channel is not None:
            self._thread = threading.Thread(
                target=self._run, name="hvdnb-metrics-flush", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval):
            try:
                self.flush()
            except Exception as exc:  # the panel must never break training
                print(f"hvdnb: metrics flush failed: {exc!r}", file=sys.stderr)

    def idle(self) -> bool:
        """No loop is running: no cell runs on this engine, or no step boundary for a
        while (slow steps are not idle)."""
        if self.cell_running is False:
            return True
        if not self.last_activity:
            return True
        quiet = time.perf_counter() - self.last_activity
        return quiet > max(IDLE_AFTER, 3 * self.step_time)

    def pack(self) -> dict[str, Any] | None:
        """Take every unflushed row and build one message (None when there is nothing new
        and the last message is recent)."""
        with self._lock:
            w = self._w
            r = self._r
            lost = 0
            if w - r > self.capacity:  # the ring was lapped: the oldest rows are gone
                lost = w - r - self.capacity
                r = w - self.capacity
            cols: dict[str, list[list[Any]]] = {}
            names = self._name_list
            cap = self.capacity
            for k in range(r, w):
                i = k % cap
                v = _as_float(self._vals[i])
                c = cols.get(names[self._names[i]])
                if c is None:
                    c = cols[names[self._names[i]]] = [[], [], []]
                c[0].append(self._steps[i])
                c[1].append(self._times[i])
                c[2].append(v)
            # a flush racing the writer may have read a row being overwritten: only the
            # lapped case can do that, and then it is counted as lost
            self._r = w
            while self._side:
                step, t, name, value = self._side.popleft()
                c = cols.setdefault(name, [[], [], []])
                c[0].append(step)
                c[1].append(t)
                c[2].append(_as_float(value))
            self.overwritten += lost
            now = time.time()
            for name, value in self._mem.sample().items():
                cols[name] = [[self.cur_step], [now], [value]]
            self.seq += 1
            msg: dict[str, Any] = {
                "seq": self.seq,
                "pid": self.pid,
                "t": now,
                "cols": cols,
                "lost": self.overwritten,
                "step": self.cur_step,
                "step_time": self.step_time,
                "backend": self.comm_backend or _dist_backend(),
                "idle": self.idle(),
            }
            if self.meta:
                msg["meta"] = dict(self.meta)
            return msg

    def flush(self) -> None:
        """Send what was recorded since the last flush (also called at the end of a loop)."""
        if self.channel is None:
            return
        if self._w == self._r and not self._side and self.idle():
            # nothing new: a heartbeat every 4 intervals keeps memory readings fresh
            if self.seq and time.time() - self._last_sent < 4 * self.flush_interval:
                return
        with self._send_lock:
            msg = self.pack()
            if msg is None:
                return
            self._last_sent = time.time()
            self.channel.send("metrics", **msg)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
            self._thread = None
        self.flush()


_KNOBSET: Any = None


def _knobs_mod() -> Any:
    global _KNOBSET
    if _KNOBSET is None:
        import importlib

        _KNOBSET = importlib.import_module(__package__ + ".knobset")
    return _KNOBSET


_PHASE_ALIASES = {
    "data_time": "time/data",
    "compute_time": "time/compute",
    "comm_time": "time/comm",
}


def _as_float(v: Any) -> float:
    if type(v) is float:
        return v
    try:
        item = getattr(v, "item", None)  # a tensor: read here, on the flusher thread
        return float(item() if item is not None else v)
    except Exception:
        return math.nan


def _dist_backend() -> str:
    mod = sys.modules.get("torch.distributed")
    try:
        if mod is not None and mod.is_initialized():
            return str(mod.get_backend())
    except Exception:
        pass
    return ""


class _MemorySampler:
    """Memory readings at flush time; a reading that cannot be taken is left out (the
    panel shows "n/a"), never reported as 0."""

    def __init__(self) -> None:
        self._proc: Any = None
        self._nvml: Any = None
        self._nvml_tried = False
        try:
            import psutil

            self._proc = psutil.Process()
        except Exception:
            pass

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self._proc is not None:
            try:
                out["mem/rss"] = float(self._proc.memory_info().rss)
            except Exception:
                pass
        torch = sys.modules.get("torch")
        if torch is None:
            return out
        try:
            cuda = torch.cuda
            if cuda.is_available() and cuda.is_initialized():
                dev = cuda.current_device()
                out["mem/gpu_allocated"] = float(cuda.memory_allocated(dev))
                out["mem/gpu_reserved"] = float(cuda.memory_reserved(dev))
                used = self._nvml_used(dev)
                if used is not None:
                    out["mem/gpu_nvml_used"] = used
        except Exception:
            pass
        return out

    def _nvml_used(self, dev: int) -> float | None:
        if not self._nvml_tried:
            self._nvml_tried = True
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception:
                self._nvml = None
        if self._nvml is None:
            return None
        try:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            ids = [v.strip() for v in visible.split(",") if v.strip()]
            index = int(ids[dev]) if dev < len(ids) and ids[dev].isdigit() else dev
            h = self._nvml.nvmlDeviceGetHandleByIndex(index)
            return float(self._nvml.nvmlDeviceGetMemoryInfo(h).used)
        except Exception:
            return None


# ---------------------------------------------------------------------- process singleton
_RECORDER: Recorder | None = None
_RLOCK = threading.Lock()


def get_recorder() -> Recorder:
    """This process's recorder, created on first use (connects the side channel and
    registers the allreduce listener when ``hvdnb.torch`` is loaded)."""
    global _RECORDER
    if _RECORDER is not None:
        return _RECORDER
    with _RLOCK:
        if _RECORDER is None:
            from ..config import get_config

            channel = None
            if os.environ.get("HVDNB_CHANNEL"):  # an engine: scripts never import zmq
                try:
                    from kernels_ext.channel import get

                    channel = get()
                except Exception:
                    channel = None
            rank = int(os.environ.get("RANK", os.environ.get("PMI_RANK", "0")) or 0)
            rec = Recorder(rank, channel, get_config().flush_interval)
            _install_comm_listener(rec)
            _RECORDER = rec
    return _RECORDER


def _install_comm_listener(rec: Recorder) -> None:
    # only when hvdnb.torch is already imported: never import torch for the panel's sake
    if "hvdnb.torch" in sys.modules or "torch" in sys.modules:
        try:
            from ..torch.listeners import add_comm_listener

            add_comm_listener(rec.on_comm)
        except Exception:
            pass


def set_enabled(on: bool) -> None:
    """Switch recording on or off in this process (``log`` returns at once when off)."""
    get_recorder().enabled = bool(on)


def log(step: int, loss: Any = None, **metrics: Any) -> None:
    """Record this step's loss and other scalars for the live panel and ``hvdnb.metrics()``.

    Call it once per step, at the end of the step, on every rank. It only stores into a
    preallocated buffer (about a microsecond); a background thread sends one message per
    flush interval (``hvdnb.config`` ``flush_interval``, 250 ms).

    Parameters
    ----------
    step : the step that just finished (integers, increasing)
    loss : the loss (a float or a 0-d tensor; a CUDA tensor is read later, off the loop)
    **metrics : more scalars by name. Reserved names: ``samples`` (samples this rank
        processed in this step; gives samples/s), ``total_steps`` (for the progress bar),
        ``data_time`` / ``compute_time`` / ``comm_time`` (seconds spent in that phase this
        step, an alternative to ``hvdnb.phase``).

    Examples
    --------
    >>> for step in range(steps):                                 # doctest: +SKIP
    ...     with hvdnb.phase("data"):
    ...         x, y = next(batches)
    ...     loss = loss_fn(model(x), y); loss.backward(); opt.step()
    ...     hvdnb.log(step, loss, samples=len(x), total_steps=steps)
    """
    get_recorder().log(step, loss, **metrics)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as phase ``name`` of the step in progress (``data``, ``compute`` or
    ``comm``; any name is recorded as ``time/<name>``).

    Step time not covered by ``data`` and ``comm`` counts as compute; when ``comm`` is not
    marked, the allreduce time that ``hvdnb.torch`` reports is used instead.

    Examples
    --------
    >>> with hvdnb.phase("data"):                                 # doctest: +SKIP
    ...     x, y = next(loader)
    """
    rec = get_recorder()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if rec.enabled:
            rec.record(rec.cur_step, f"time/{name}", time.perf_counter() - t0)


def ddp_comm_hook(model: Any, state: Any = None) -> Any:
    """Register a DDP communication hook that records each bucket's allreduce timings.

    For plain ``torch.nn.parallel.DistributedDataParallel`` users (hvdnb.torch's
    DistributedOptimizer reports by itself). The hook is torch's ``allreduce_hook``; per
    bucket and step it records, measured on the host (no ``cuda.synchronize``):

    - ``comm/ddp.bucket.<i>/time``, the collective's own duration: from when it could
      start (its launch, or the previous bucket's completion when the backend was still
      busy with that one: Gloo runs a group's collectives in order) to its completion;
      on CUDA (NCCL) the host cannot see the stream, so this is "n/a" (NaN). A rank
      that starts a bucket before its peers also counts waiting for them (the store
      takes the smallest reading over the ranks as the collective's time), and the
      completion is seen when Gloo's thread gets the GIL, so a bucket that completes
      while the training thread still runs Python reads late: measured on 2 CPU ranks,
      6 buckets of 257 KB read 0.4-0.9 ms where the same allreduce alone took 0.45-0.65
      ms, except the first of each step, 1.7-2.4 ms;
    - ``comm/ddp.bucket.<i>/exposed``, communication the step waited for: DDP waits for
      every bucket once the last one is launched (backward compute is over), so a bucket
      completing after that instant exposes the time since the later of that instant
      and the previous completion; buckets done earlier were hidden behind backward (0);
    - ``comm/ddp.bucket.<i>/bytes``.

    Parameters
    ----------
    model : a DistributedDataParallel module
    state : the process group (default: the default group)

    Returns
    -------
    the model, with the hook registered
    """
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    rec = get_recorder()
    backend = str(dist.get_backend(state) if state is not None else dist.get_backend())
    # this step's clock: when the last bucket was launched (0: not yet), the previous
    # bucket's completion; the hook runs on the training thread, completions on Gloo's
    clock = {"last_launch": 0.0, "prev_done": 0.0}
    lock = threading.Lock()

    # no annotations: DDP rejects a hook whose annotations are not exactly GradBucket and
    # torch.futures.Future (this module's are strings under `from __future__ import`)
    def hook(st, bucket):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        step = rec.cur_step
        idx = bucket.index()
        is_last = bucket.is_last()
        buf = bucket.buffer()
        cuda = bool(buf.is_cuda)
        nbytes = float(buf.numel() * buf.element_size())
        if is_last:
            with lock:
                clock["last_launch"] = t0
        fut = allreduce_hook(st, bucket)

        def done(f: Any) -> Any:
            t1 = time.perf_counter()
            with lock:
                prev = clock["prev_done"]
                start = max(t0, prev)
                last = clock["last_launch"]
                exposed = max(0.0, t1 - max(last, prev)) if last else 0.0
                clock["prev_done"] = t1
                if is_last:  # every bucket of this step is done: the next step starts afresh
                    clock["last_launch"] = clock["prev_done"] = 0.0
            t = time.time()
            nan = math.nan
            rec._side.append((step, t, f"comm/ddp.bucket.{idx}/time", nan if cuda else t1 - start))
            rec._side.append((step, t, f"comm/ddp.bucket.{idx}/exposed", nan if cuda else exposed))
            rec._side.append((step, t, f"comm/ddp.bucket.{idx}/bytes", nbytes))
            rec.comm_backend = backend
            return f.value()

        return fut.then(done)

    model.register_comm_hook(state, hook)
    return model
