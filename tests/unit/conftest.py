"""Fakes shared by the unit tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest


class RecordingChannel:
    """The notebook side's channel to the ranks, recording ``(rank, kind, payload)`` per send."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        self.sent: list[tuple] = []

    def send(self, rank, kind, **p) -> None:
        self.sent.append((rank, kind, p))


@pytest.fixture
def recording_channel() -> Callable[[list[int]], RecordingChannel]:
    """``recording_channel(ranks)``: a channel for ``MetricsStore._channel`` that keeps what
    the store sends (knob requests, plans) in ``.sent``."""
    return RecordingChannel
