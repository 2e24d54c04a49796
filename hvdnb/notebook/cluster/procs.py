"""Ending a cluster's processes: ask the engines to exit, then kill what is left.

Owns: the event-loop thread ipyparallel's coroutines run on, the polite shutdown that
never blocks longer than asked (a dead or stuck engine never answers), and the kill of
what it left behind. Never: start anything, or wait on a
process that is not ours without a deadline.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any

import psutil

__all__ = ["LoopThread", "kill_survivors", "polite_shutdown", "processes"]


def polite_shutdown(
    client: Any, wait: float, ranks: list[int], launchers: list[Any] | None = None
) -> None:
    """Ask engines to exit (they exit 0, faster than a signal) without ever blocking
    for longer than ``wait``: a dead or stuck engine never answers.

    Done when every engine has answered, every rank process has gone, or every engine of
    ``launchers`` (engine sets: an elastic cluster's slots, over ssh on other hosts, whose
    processes are not this host's) is no longer running as its launcher sees it: an engine
    can exit before its reply leaves the socket (one stop in ~8 waited the full ``wait``
    for replies that were never sent; across hosts, every stop did).
    """
    engines = [el for es in launchers or [] for el in getattr(es, "launchers", {}).values()]

    def ask() -> None:
        try:
            if client.ids:
                client.shutdown(targets="all", hub=False, block=True)
        except Exception:
            pass

    def gone(pid: int) -> bool:
        try:
            return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return True

    t = threading.Thread(target=ask, name="hvdnb-shutdown", daemon=True)
    t.start()
    deadline = time.monotonic() + wait
    while t.is_alive() and time.monotonic() < deadline:
        t.join(0.02)
        if ranks and all(gone(p) for p in ranks):
            break
        if engines and all(getattr(el, "state", "") != "running" for el in engines):
            break


def processes(pids: list[int]) -> list[psutil.Process]:
    """``pids`` as psutil processes, each knowing its start time: one killed later through
    these is refused if its pid was reused meanwhile (pid_max 32,768 wraps in minutes)."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return procs


def kill_survivors(pids: list[int] | list[psutil.Process], wait: float = 1.0) -> None:
    """SIGKILL what a polite stop left behind: an engine busy in a loop that ignores
    signals never reaches ipyparallel's own shutdown code. Pass the processes taken
    before the stop began (``processes``): a bare pid looked up now may name another
    process already."""

    procs = []
    for given in pids:
        try:
            p = given if isinstance(given, psutil.Process) else psutil.Process(given)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                procs.append(p)
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    # not our children, so a killed one may linger as a zombie until init reaps it:
    # "gone" means gone or zombie (psutil.wait_procs would wait out its whole timeout)
    deadline = time.monotonic() + wait
    while procs and time.monotonic() < deadline:
        left = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.NoSuchProcess:
                pass
        procs = left
        if procs:
            time.sleep(0.01)


class LoopThread:
    """One long-lived asyncio loop in a daemon thread, for ipyparallel's coroutines."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="hvdnb-cluster", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        assert self._loop is not None
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise
