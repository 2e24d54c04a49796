"""Shared preamble of the spmd_*.py scripts: never hang silently.

``setup()`` arms faulthandler (a rank stuck past the timeout dumps its stack and exits) and
makes an uncaught exception end the process at once with status 1, so mpiexec tears the
other ranks down instead of leaving them waiting in a collective.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import traceback
from types import TracebackType


def _die(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    # sys.__stderr__: torch's own excepthook points sys.stderr at a buffer while it runs
    traceback.print_exception(kind, value, tb, file=sys.__stderr__)
    sys.stdout.flush()
    if sys.__stderr__ is not None:
        sys.__stderr__.flush()
    os._exit(1)


def setup() -> None:
    faulthandler.dump_traceback_later(float(os.environ.get("HVDNB_SPMD_TIMEOUT", "60")), exit=True)
    sys.excepthook = _die
