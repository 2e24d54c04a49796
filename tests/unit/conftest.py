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


@pytest.fixture
def sent(monkeypatch) -> list[tuple[str, str | None]]:
    """Every widget comm message the test's widgets publish, as ``(msg_type, method)``: the
    comms are ipykernel's own ``DummyComm`` (no kernel), recording instead of sending."""
    import comm

    log: list[tuple[str, str | None]] = []

    class Recording(comm.DummyComm):
        def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
            log.append((msg_type, (data or {}).get("method")))

    monkeypatch.setattr(comm, "create_comm", lambda *a, **k: Recording(*a, **k))
    return log
