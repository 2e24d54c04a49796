"""What the framework modules share: where the ranks stand (``Place``), the one-line notes,
the version check against ``TESTED`` and the post-import hooks.

Owns: ``TESTED`` (the versions the ``frameworks`` extra pins) and the installed ``Place``.
Never: import a framework.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from hvdnb.extras import pip_target

__all__ = [
    "TESTED",
    "Place",
    "installed",
    "new_cell",
    "note",
    "on_import",
    "set_place",
    "setdefault_env",
    "warn_version",
]


@dataclass(frozen=True)
class Place:
    """Where the ranks stand, as the frameworks need it (read once at install)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    nodes: int
    #: "cpu" or "cuda:N"
    device: str
    backend: str


#: distribution -> (lowest tested, first version not tested), as the ``frameworks`` extra pins
TESTED: dict[str, tuple[str, str]] = {
    "accelerate": ("1.15", "1.16"),
    "transformers": ("5.23", "5.24"),
    "lightning": ("2.6", "2.7"),
    "pytorch-lightning": ("2.6", "2.7"),
}

_PLACE: Place | None = None
_SAID: set[str] = set()
_WARNED: set[str] = set()


def installed() -> Place | None:
    """The place the hooks were installed for, or None outside an hvdnb rank."""
    return _PLACE


def replace_place(p: Place) -> None:
    """Where this rank stands now (an elastic cluster's new generation)."""
    global _PLACE
    _PLACE = p


def set_place(p: Place) -> bool:
    """Remember where this rank stands; False when it was set already (installed once)."""
    global _PLACE
    if _PLACE is not None:
        return False
    _PLACE = p
    return True


def new_cell() -> None:
    """A new cell: each one-line note may be said once more."""
    _SAID.clear()


def note(text: str) -> None:
    """Print ``hvdnb: text`` on this rank, once per cell (every rank printing the same line,
    the notebook shows it once, tagged with the ranks)."""
    if text in _SAID:
        return
    _SAID.add(text)
    print(f"hvdnb: {text}", flush=True)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _key(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def warn_version(dist: str) -> None:
    """One warning per process when ``dist`` is installed at a version hvdnb was not tested
    with (``TESTED``); the hooks still go in, as they are written for that seam."""
    lo, hi = TESTED[dist]
    v = _version(dist)
    if v is None or dist in _WARNED or _key(lo) <= _key(v) < _key(hi):
        return
    _WARNED.add(dist)
    print(
        f"hvdnb: {dist} {v} is installed; hvdnb's integration was tested with {dist} "
        f">={lo},<{hi} (pip install {pip_target('frameworks')} installs that range)",
        file=sys.stderr,
        flush=True,
    )


def on_import(module: str, hook: Callable[[Any], None]) -> None:
    """Run ``hook(module)`` right after ``module`` is first imported (at once when it is
    already), through ``wrapt``'s post-import hooks: the framework's own import runs
    unchanged, and its names are placed before the importing code reads them."""
    import wrapt  # noqa: PLC0415  only on a rank, when the hooks are installed

    def guarded(mod: Any) -> None:
        try:
            hook(mod)
        except Exception as exc:  # a framework's new layout must never break its import
            print(
                f"hvdnb: could not hook into {module} ({type(exc).__name__}: {exc}); it runs "
                "as it would outside hvdnb",
                file=sys.stderr,
                flush=True,
            )

    wrapt.register_post_import_hook(guarded, module)


def setdefault_env(**values: str) -> None:
    """Set each variable unless the user (or a launcher) already set it."""
    for k, v in values.items():
        os.environ.setdefault(k, v)
