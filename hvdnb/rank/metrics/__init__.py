"""Rank side of the live panel: the ``log`` hot path, its ring and flusher, collective
timing, memory sampling and the knobs a loop reads. Never blocks the step, never issues a
collective.

Modules, each depending only on those before it: ``memory`` (readings), ``state`` (the
recorder's fields), ``ring`` (queue -> ring -> message), ``comm`` (collective timing),
``flusher`` (sending), ``recorder`` (``Recorder``, ``log``, ``phase``, the process's
recorder), ``ddp`` (the DDP hook) and ``knobs`` (it registers its step hook with the
recorder).
"""
