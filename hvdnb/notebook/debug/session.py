"""One rank's debugpy, as the notebook's debugger sees it: a DAP session and its stop.

``RankSession`` attaches to a rank's adapter (initialize, attach, what the router knows so
far, configurationDone) and passes the adapter's events to the router (``RankRouter``:
stopped, continued, gone).

Owns: one rank's attach and its stopped thread. Never: decide what the page sees (the
router does).
"""

from __future__ import annotations

import threading
from typing import Any

from hvdnb.notebook.debug.dap import DapClient, DapError

__all__ = ["ANSWER_TIMEOUT", "LISTEN_TIMEOUT", "SKIPPED_MODULES", "RankSession"]

#: how long a rank's debugpy may take to start (a new adapter process) and answer
LISTEN_TIMEOUT = 20.0
ANSWER_TIMEOUT = 10.0

#: code the ranks' debuggers never stop in nor show: hvdnb's, the engine's machinery
SKIPPED_MODULES = (
    "hvdnb.*",
    "kernels_ext.*",
    "ipyparallel.*",
    "ipykernel.*",
    "IPython.*",
    "tornado.*",
    "zmq.*",
    "traitlets.*",
    "asyncio.*",
    "threading",
    "concurrent.*",
)


class RankSession:
    """One rank's debugpy, attached: its DAP client and what is stopped there."""

    def __init__(self, router: Any, rank: int, host: str, port: int, pid: int) -> None:
        self.router = router
        self.rank = rank
        self.pid = pid
        self.initialized = threading.Event()
        self.stopped: int | None = None  # the rank's thread id stopped now
        self.reason = ""
        self.dap = DapClient(host, port, self._on_event, name=f"rank {rank}")

    def attach(self) -> None:
        """DAP's start: initialize, attach, the breakpoints known so far, configurationDone."""
        rep = self.dap.request(
            "initialize",
            {
                "clientID": "hvdnb",
                "adapterID": "python",
                "pathFormat": "path",
                "linesStartAt1": True,
                "columnsStartAt1": True,
                "supportsVariableType": True,
            },
            LISTEN_TIMEOUT,
        )
        if not rep.get("success"):
            raise DapError(f"rank {self.rank}: initialize failed: {rep.get('message')}")
        attach = self.dap.send(
            "attach",
            {
                "justMyCode": True,
                "rules": [{"module": m, "include": False} for m in SKIPPED_MODULES],
                "redirectOutput": False,
                "subProcess": False,
                # only the thread at the breakpoint stops: the rank's own threads (its side
                # channel, metrics, heartbeat) go on, so the notebook still hears from it
                "stopAllThreadsOnSuspend": False,
            },
        )
        if not self.initialized.wait(LISTEN_TIMEOUT):
            raise DapError(f"rank {self.rank}'s debugger did not initialize")
        self.router.replay(self)
        self.dap.request("configurationDone", {}, ANSWER_TIMEOUT)
        rep = self.dap.wait(attach, ANSWER_TIMEOUT)
        if not rep.get("success"):
            raise DapError(f"rank {self.rank}: attach failed: {rep.get('message')}")

    def _on_event(self, msg: dict[str, Any]) -> None:
        event = msg.get("event")
        if event == "initialized":
            self.initialized.set()
        elif event == "stopped":
            self.router.rank_stopped(self, msg.get("body") or {})
        elif event == "continued":
            self.router.rank_continued(self)
        elif event in ("hvdnb_closed", "terminated", "exited"):
            self.router.rank_gone(self)
