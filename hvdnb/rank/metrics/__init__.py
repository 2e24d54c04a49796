"""Rank side of the live panel: the ``log`` hot path, its ring and flusher, collective
timing, memory sampling and the knobs a loop reads. Never blocks the step, never issues a
collective.

The ``Recorder`` (``core``) is composed, not stacked: it owns the training thread's queue
and hot path, and parts that each own their fields: ``ring.Ring`` (the preallocated
columns), ``state.LoopClock`` (the loop's clock), ``drain.Drain`` (queue -> ring),
``comm.CommTiming`` (sampled collective timing on ``hvdnb.rank.hooks``), ``flusher.Flusher``
(sending), ``memory.MemorySampler`` and ``outbox.Fingerprints``. ``recorder`` holds the
process's recorder, ``log`` and ``phase``; ``ddp`` (the DDP hook), ``fingerprint``, ``stop``
and ``knobs`` use it (the last two register step hooks with ``on_step_start``).
"""
