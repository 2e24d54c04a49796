"""The rule a warm start's hand-over follows on both sides: which variables a standby
process (``hvdnb.rank.standby``) read when it started, so that it cannot serve a rank whose
environment has other values for them. The notebook checks it before offering its standby
(``hvdnb.notebook.cluster.standby``), the standby again when it is handed a rank. And
how a standby's control socket is spoken to (``send_line``), by the notebook for its own
host and by a host's pool (``hvdnb.rank.standby_pool``) for that host.

Never: import anything beyond the standard library (the stand-in and the standby read it
before torch is loaded).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

__all__ = ["IMPORT_TIME_PREFIXES", "import_time_diff", "send_line"]

#: variables read when the interpreter or a native library starts (Python's own, the
#: dynamic loader's, OpenMP's and the BLAS libraries' thread settings)
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOMP_")
#: of those, read later (at run time), so a standby serves any value
RUN_TIME = frozenset({"PYTHONUNBUFFERED"})


def import_time_diff(started: Mapping[str, str], rank: Mapping[str, str]) -> list[str]:
    """The import-time variables whose values differ between two environments."""
    keys = {k for k in (*started, *rank) if k.startswith(IMPORT_TIME_PREFIXES)} - RUN_TIME
    return sorted(k for k in keys if started.get(k) != rank.get(k))


def send_line(control: socket.socket, line: str) -> None:
    """One line to a standby's control socket; a standby that is gone is no error (it
    ended, or became a rank and closed its end)."""
    try:
        control.sendall(line.encode() + b"\n")
    except OSError:
        pass
