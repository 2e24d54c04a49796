"""ipyparallel's ssh engine launchers, with a wait that outlives a host that does not answer.

The stock ``SSHEngineLauncher`` waits for its engine with ``ssh HOST python -c waitpid``
in a thread; when ssh fails (the host's link cut, its sshd gone), that thread raises, and
its traceback lands in the cell that runs at the time. Here a failed ssh counts as "still
running, not heard from" and is tried again a second later: whether the engine is lost is
the controller's heartbeat's call (``elastic.Membership``), as on one host.
"""

from __future__ import annotations

import subprocess
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


class HostEngineSetLauncher(SSHEngineSetLauncher):  # type: ignore[misc]
    """``SSHEngineSetLauncher`` whose engines are ``HostEngineLauncher``."""

    launcher_class = HostEngineLauncher
