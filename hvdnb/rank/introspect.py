"""Completion and inspection of a rank's names, for the notebook (Tab and Shift-Tab in a
``%%distributed`` cell or in auto mode).

The notebook asks rank 0 (``protocol.remote.COMPLETE`` / ``INSPECT``); the rank answers with
its own IPython shell's completer and inspector over its own namespace, as a local kernel
answers. Only text travels: names, signatures and docstrings, never an object.

Owns: those two answers. Never: evaluate user code beyond what IPython's completer and
inspector do (attribute lookups), or raise (a failed answer is an empty one).
"""

from __future__ import annotations

import threading
from typing import Any

from hvdnb.protocol import parsocache

__all__ = ["complete", "inspect", "prewarm"]

#: completions sent back at most (a module's attributes can be thousands)
LIMIT = 500
_ONE_AT_A_TIME = threading.Lock()


def complete(code: str, cursor: int) -> list[tuple[str, int, int, str]]:
    """IPython's completions of ``code`` at ``cursor`` on this rank: (text, start, end,
    type), start and end being offsets in ``code`` of the text each replaces."""
    try:
        from IPython import get_ipython  # noqa: PLC0415  IPython: present on an engine
        from IPython.core.completer import provisionalcompleter  # noqa: PLC0415  IPython: present on an engine

        ip = get_ipython()
        if ip is None:
            return []
        parsocache.harden()  # a rank killed mid-write must not end Tab for everyone
        # one completion at a time: the prewarm thread's and a request's ran together, and
        # IPython's completer (jedi) failed in one of them, which answered no names at all
        with _ONE_AT_A_TIME, provisionalcompleter():
            comps = list(ip.Completer.completions(code, cursor))
        return [(c.text, c.start, c.end, c.type or "") for c in comps[:LIMIT]]
    except Exception:
        return []


def inspect(name: str, detail_level: int = 0) -> dict[str, Any] | None:
    """What Shift-Tab and ``name?`` show of ``name`` on this rank (a mime bundle: signature
    and docstring), or None when the rank has no such name."""
    try:
        from IPython import get_ipython  # noqa: PLC0415  IPython: present on an engine

        ip = get_ipython()
        if ip is None or not ip._object_find(name).found:
            return None
        bundle: dict[str, Any] = ip.object_inspect_mime(name, detail_level=detail_level)
        return bundle
    except Exception:
        return None


def prewarm() -> None:
    """Load IPython's completer (it imports jedi: 0.6 s here) in a thread of its own, and
    return at once: the rank's request queue is not held, so the first cell is not delayed
    (a completion asked meanwhile waits for the import, as it would anyway)."""
    threading.Thread(target=complete, args=("", 0), name="hvdnb-prewarm", daemon=True).start()
