"""Rank side of the live panel: the ``log`` hot path, its ring and flusher, collective
timing, memory sampling and the knobs a loop reads. Never blocks the step, never issues a
collective."""
