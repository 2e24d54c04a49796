"""ipyparallel's ssh engine launchers, with a wait that outlives a host that does not answer,
and slots started and stopped side by side.

The stock ``SSHEngineLauncher`` waits for its engine with ``ssh HOST python -c waitpid``
in a thread; when ssh fails (the host's link cut, its sshd gone), that thread raises, and
its traceback lands in the cell that runs at the time. Here a failed ssh counts as "still
running, not heard from" and is tried again a second later: whether the engine is lost is
the controller's heartbeat's call (``elastic.Membership``), as on one host.

The stock engine set starts, stops and reads the log of each engine with a few ssh calls
one after another, on the event loop's thread; an elastic cluster has one set per slot, so
a start of 4 slots made 16 such calls in a row (measured across the namespace hosts: 2.7 s
per slot, 0.9 s of it ``ipython profile create`` on the host). Here each set's start and
stop run on a worker thread, so the slots' calls run side by side, and the engines' logs
(on the shared home already) are fetched and removed off the stop's path.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time
from typing import Any

from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher

__all__ = ["HostEngineLauncher", "HostEngineSetLauncher"]


class HostEngineLauncher(SSHEngineLauncher):  # type: ignore[misc]
    """One engine over ssh whose wait survives a failed ssh."""

    def wait_one(self, timeout: float) -> Any:
        try:
            return super().wait_one(timeout)
        except subprocess.CalledProcessError:
            time.sleep(1.0)
            raise TimeoutError("the host did not answer ssh") from None

    async def stop(self) -> None:
        """The stock stop (TERM, a wait, then KILL), its ssh signals on a worker thread: the
        engine set's stop gathers its engines' stops, which then signal side by side."""
        loop = asyncio.get_running_loop()
        for sig, wait in ((signal.SIGTERM, self.stop_seconds_until_kill), (signal.SIGKILL, None)):
            try:
                await loop.run_in_executor(None, self.signal, sig)
            except Exception as exc:
                self.log.debug(f"{sig.name} failed: {exc!r}")
            if wait is None:
                break
            try:
                await self.join(timeout=wait)
                return
            except TimeoutError:
                self.log.warning(f"Process {self.pid} did not exit {wait} s after TERM")
        await self.join(timeout=self.stop_timeout)


class HostEngineSetLauncher(SSHEngineSetLauncher):  # type: ignore[misc]
    """``SSHEngineSetLauncher`` whose engines are ``HostEngineLauncher``, started off the
    event loop's thread (``Cluster.start_engines`` awaits what ``start`` returns)."""

    launcher_class = HostEngineLauncher

    def start(self, n: int) -> Any:
        return asyncio.get_running_loop().run_in_executor(None, super().start, n)

    def get_output(self, remove: bool = False) -> str:
        """Nothing now: the logs are read (and removed) on a thread of their own, since a
        stop (``Cluster.stop_engines``) waits for this and drops what it returns."""
        threading.Thread(
            target=super().get_output, args=(remove,), name="hvdnb-ssh-logs", daemon=True
        ).start()
        return ""
