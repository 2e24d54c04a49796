"""The notebook's own stops stay listed (``debug.local.handle_stopped_event``).

ipykernel's kernel awaits ``debugger.handle_stopped_event()`` in an endless loop; its own
version raises when debugpy's reply (matched by order alone) is not the threads reply, which
ends the loop: no later stop of the notebook is ever listed. The debugger here stands in for
ipykernel's with the attributes the handler uses, and its replies are the two debugpy can
give."""

from __future__ import annotations

import asyncio
from typing import Any

from hvdnb.notebook.debug.local import handle_stopped_event


class _Debugger:
    def __init__(self, reply: dict[str, Any]) -> None:
        self.stopped_queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.stopped_threads: set[int] = set()
        self.sent: list[dict[str, Any]] = []
        self.reply = reply

    async def _forward_message(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.reply

    def _accept_stopped_thread(self, name: str) -> bool:
        return name not in ("IPythonHistorySavingThread", "Thread-2")

    def event_callback(self, event: dict[str, Any]) -> None:
        self.sent.append(event)


STOPPED = {
    "type": "event",
    "seq": 7,
    "event": "stopped",
    "body": {"reason": "breakpoint", "threadId": 1, "allThreadsStopped": True},
}


async def _stop(d: _Debugger) -> None:
    d.stopped_queue.put_nowait(STOPPED)
    await handle_stopped_event(d)


def test_the_threads_reply_lists_every_stopped_thread_and_the_page_hears_the_stop():
    threads = [
        {"id": 1, "name": "MainThread"},
        {"id": 5, "name": "Thread-2"},
        {"id": 9, "name": "x"},
    ]
    d = _Debugger({"type": "response", "command": "threads", "body": {"threads": threads}})
    asyncio.run(_stop(d))
    assert d.stopped_threads == {1, 9} and d.sent == [STOPPED]


def test_a_crossed_reply_still_lists_the_thread_that_stopped_and_raises_nothing():
    d = _Debugger({"type": "response", "command": "stackTrace", "body": {"stackFrames": []}})
    asyncio.run(_stop(d))
    asyncio.run(_stop(d))  # the loop goes on: a second stop is handled too
    assert d.stopped_threads == {1} and d.sent == [STOPPED, STOPPED]
