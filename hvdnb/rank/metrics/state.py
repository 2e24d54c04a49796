"""The recorder's sizes and thresholds, the format of the training thread's queue, and the
loop's clock.

Owns: the queue's entry kinds (``LOG``, ``COMM``, ``RECORD``), ``CAPACITY``, ``IDLE_AFTER``,
``COMM_EVERY_MAX``, and ``LoopClock``: what the logged steps say about the running loop (the
last logged step and its time, the step-time estimate, when the loop started) and the
message intervals that follow from it. Never: do work (no threads, no I/O), import torch,
or import another part of the recorder.
"""

from __future__ import annotations

import time

__all__ = ["CAPACITY", "COMM", "COMM_EVERY_MAX", "IDLE_AFTER", "LOG", "RECORD", "LoopClock"]

#: rows the ring holds between two flushes before the oldest are overwritten (and counted)
CAPACITY = 1 << 16
#: the training loop counts as idle (knob changes then apply at once) after this long
IDLE_AFTER = 1.0
#: the longest sampling period of collective timings (steps): see CommTiming.every
COMM_EVERY_MAX = 64
#: kinds of the training thread's queued entries (see Drain.run): ``log`` appends
#: ``(LOG, now, step, loss, metrics)``, ``on_comm`` ``(COMM, t, step, name, nbytes,
#: seconds, backend, exposed)``, ``record`` ``(RECORD, t, step, name, value)``
LOG, COMM, RECORD = 0, 1, 2


class LoopClock:
    """The running loop's clock, from the steps given to ``log``: written by the drain (on
    the training thread, or under the recorder's lock), ``log`` from another thread and
    ``knobs.step`` (``Recorder.mark``); read by the flusher (``interval``), the collective
    sampling and rank 0's plans (``Recorder.step_ahead``).

    Parameters
    ----------
    flush_interval : seconds between two messages for the first ``warm`` seconds of a loop
    steady_interval : seconds between two messages after that
    warm : seconds of logging after which a loop is past its start
    """

    __slots__ = (
        "flush_interval",
        "last_log",
        "last_mark",
        "loop_t0",
        "prev_step",
        "steady_interval",
        "step_time",
        "warm",
    )

    def __init__(self, flush_interval: float, steady_interval: float, warm: float) -> None:
        self.flush_interval = float(flush_interval)
        self.steady_interval = float(steady_interval)
        self.warm = float(warm)
        self.prev_step = -1  # the last step given to log()
        self.last_log = 0.0  # perf_counter of the last log()
        self.step_time = 0.0  # EWMA of the time between two log() calls
        self.loop_t0 = 0.0  # perf_counter of the first log() of the running loop
        self.last_mark = 0.0  # perf_counter of the last step start (Recorder.mark)

    def reset(self) -> None:
        """A new loop: step numbers start over (the step-time estimate is kept)."""
        self.prev_step = -1
        self.last_log = 0.0
        self.last_mark = 0.0
        self.loop_t0 = 0.0

    def logged(self, step: int, now: float) -> float | None:
        """Step ``step`` was logged at ``now`` (``log`` from a thread other than the
        recorder's): the seconds per step since the previous log, None for the first."""
        prev, last = self.prev_step, self.last_log
        per = (now - last) / (step - prev) if last and step > prev else None
        if now - last > IDLE_AFTER:  # a loop starts (or goes on after a pause)
            self.loop_t0 = now
        self.prev_step = step
        self.last_log = now
        return per

    def mark(self, step: int, cur_step: int, now: float) -> None:
        """Step ``step`` starts at ``now`` (``cur_step`` was in progress): the step-time
        estimate follows the step starts too."""
        if step > cur_step and self.last_mark:
            per = (now - self.last_mark) / (step - cur_step)
            self.step_time = per if not self.step_time else 0.8 * self.step_time + 0.2 * per
        if step != cur_step or not self.last_mark:
            self.last_mark = now

    def interval(self, now: float | None, idle: bool) -> float:
        """Seconds between two messages now: ``flush_interval`` while no loop runs and for
        the first ``warm`` seconds of one (quick first points, knob effects seen at once),
        ``steady_interval`` after that (fewer messages: each costs the ranks CPU)."""
        t0 = self.loop_t0
        if not t0 or idle:
            return self.flush_interval
        now = time.perf_counter() if now is None else now
        return self.steady_interval if now - t0 >= self.warm else self.flush_interval
