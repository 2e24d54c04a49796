"""hvdnb.rank.iostream.OutStream: empty flushes return at once, real output is never lost."""

from __future__ import annotations

import time

import pytest
import zmq
from ipykernel.iostream import IOPubThread
from jupyter_client.session import Session

from hvdnb.rank.iostream import OutStream


@pytest.fixture
def stream():
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    thread = IOPubThread(pub)
    thread.start()
    session = Session(key=b"k")
    out = OutStream(session, thread, "stdout", watchfd=False)
    time.sleep(0.2)  # subscription
    scheduled: list[object] = []
    real = thread.schedule

    def counting(f):
        scheduled.append(f)
        real(f)

    thread.schedule = counting
    yield out, sub, session, scheduled
    out.close()
    # cancel ipykernel's event-pipe GC task on its own loop first: IOPubThread.stop()
    # cancels it with the loop already stopped, and asyncio then reports it at exit
    gc_task = getattr(thread, "_event_pipe_gc_task", None)
    if gc_task is not None:
        thread.io_loop.add_callback(gc_task.cancel)
        time.sleep(0.05)
    thread.stop()
    thread.close()
    sub.close(linger=0)
    ctx.term()


def _texts(sub, session, wait: float) -> list[str]:
    texts = []
    while sub.poll(int(wait * 1000)):
        _, parts = session.feed_identities(sub.recv_multipart())
        msg = session.deserialize(parts)
        texts.append(msg["content"]["text"])
        wait = 0.05
    return texts


def test_empty_flush_hands_nothing_to_the_io_thread(stream):
    out, sub, session, scheduled = stream
    for _ in range(5):
        out.flush()
    assert scheduled == []
    assert _texts(sub, session, 0.2) == []


def test_flush_sends_buffered_text_before_it_returns(stream):
    out, sub, session, scheduled = stream
    out.write("no newline")  # schedules a timed flush; flush() must not wait for it
    out.flush()
    assert scheduled, "a non-empty flush must go through the IO thread"
    # already sent when flush() returned: no extra wait needed beyond socket delivery
    assert _texts(sub, session, 1.0) == ["no newline"]
    scheduled.clear()
    out.flush()  # nothing left: back to the fast path
    assert scheduled == []
