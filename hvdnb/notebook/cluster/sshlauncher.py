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
start runs on a worker thread, so the slots' calls run side by side, their stops signal side
by side, each host's shell and Python are asked once (``SharedHomeSend``), and the engines'
logs are read from the shared home instead of fetched over ssh.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import Any

from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher
from ipyparallel.cluster.shellcmd import ShellCommandSend

__all__ = ["HostEngineLauncher", "HostEngineSetLauncher", "SharedHomeSend"]


class SharedHomeSend(ShellCommandSend):  # type: ignore[misc]
    """ipyparallel's ssh command sender for a host that shares this home and Python, one per
    host for every engine started there (``HostEngineLauncher.ssh_sender``).

    The stock launcher makes a sender per engine, and each asks the host for its shell (an
    ``echo``), checks ``python --version`` and runs ``ipython profile create`` on the
    profile: across the namespace hosts 0.3-0.5 s, 0.3-0.7 s and 2-3 s (a Python importing
    IPython, four at once on 2 cores) of every engine's start. Here the host's shell is
    asked once, Python is checked until it answers, and the profile is not created again
    where it exists already (it is this kernel's own, in the shared home, which is also why
    the connection files are read there and never copied)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._python_ok = False

    def has_python(self, python_path: str | None = None) -> bool:
        if python_path is None and self._python_ok:
            return True
        ok = bool(super().has_python(python_path))
        self._python_ok = self._python_ok or (ok and python_path is None)
        return ok

    def check_output_python_module(self, module_params: Any, **kwargs: Any) -> Any:
        words = list(module_params) if isinstance(module_params, list | tuple) else []
        if words[:3] == ["IPython", "profile", "create"] and os.path.isdir(str(words[-1])):
            return ""
        return super().check_output_python_module(module_params, **kwargs)


_SENDERS: dict[tuple[Any, ...], SharedHomeSend] = {}
_SENDERS_LOCK = threading.Lock()


class HostEngineLauncher(SSHEngineLauncher):  # type: ignore[misc]
    """One engine over ssh whose wait survives a failed ssh, its host's commands sent by
    that host's ``SharedHomeSend``."""

    def get_output(self, remove: bool = False) -> str:
        """The engine's log, read where it is: the shared home holds it (the stock launcher
        fetches it over ssh, three calls with a Python each, per engine, at every stop)."""
        if getattr(self, "_output", None) is None:
            path = str(self.remote_output_file)
            try:
                with open(path, errors="replace") as f:
                    self._output = f.read()
            except OSError:  # not here after all: the stock fetch
                return str(super().get_output(remove))
            if remove:
                with contextlib.suppress(OSError):
                    os.remove(path)
        return str(getattr(self, "_output", ""))

    @property
    def ssh_sender(self) -> SharedHomeSend:
        key = (tuple(self.ssh_cmd), tuple(self.ssh_args), self.location, self.remote_python)
        with _SENDERS_LOCK:  # the slots of one host start side by side, on worker threads
            sender = _SENDERS.get(key)
            if sender is None:
                sender = _SENDERS[key] = SharedHomeSend(
                    self.ssh_cmd, [*self.ssh_args, self.location], self.remote_python, log=self.log
                )
        return sender

    def wait_one(self, timeout: float) -> Any:
        try:
            return super().wait_one(timeout)
        except subprocess.CalledProcessError:
            time.sleep(1.0)
            raise TimeoutError("the host did not answer ssh") from None

    async def stop(self) -> None:
        """The stock stop (TERM, a wait, then KILL) after a second's wait for an engine that
        is ending already, its ssh signals on a worker thread: the engine set's stop gathers
        its engines' stops, which then signal side by side."""
        loop = asyncio.get_running_loop()
        try:  # asked to shut down already (``Cluster.stop``): most engines have ended, and
            # a signal to an ended one prints the host's ProcessLookupError traceback
            await self.join(timeout=1.0)
            return
        except TimeoutError:
            pass
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
