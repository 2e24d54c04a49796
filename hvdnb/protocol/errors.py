"""The refusal of a bad argument, as both sides raise and show it.

``InputError`` (raised as ``InputTypeError`` or ``InputValueError``, so that ``except
TypeError`` still catches it) is what hvdnb's public functions raise for a value they do not
take: the message says what was wrong and what is accepted. Its traceback ends at the user's
line: the public function re-raises it from its own frame, which sets ``__tracebackhide__``
(as pytest and IPython read it), and ``user_frames`` leaves such frames out. A rank's cell
report uses ``user_frames``; IPython, in the notebook's kernel, shows ``_render_traceback_``.

Owns: the error classes and ``user_frames``. Never: import either side, torch or IPython.
"""

from __future__ import annotations

import os
import traceback
from types import TracebackType

__all__ = [
    "InputError",
    "InputTypeError",
    "InputValueError",
    "UserFacing",
    "exception_lines",
    "refusal",
    "user_frames",
]

#: hvdnb's own directory: a user-facing error's frames in it are not the user's
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def exception_lines(exc: BaseException) -> list[str]:
    """``traceback.format_exception_only``, but a refusal is named by the builtin error it
    is (``TypeError: hvdnb.log: loss must be a number, ...``), not by hvdnb's class."""
    if isinstance(exc, InputError):
        base = TypeError if isinstance(exc, TypeError) else ValueError
        return [f"{base.__name__}: {exc}\n"]
    if isinstance(exc, UserFacing):
        return [f"{type(exc).__name__}: {exc}\n"]
    return traceback.format_exception_only(type(exc), exc)


def user_frames(tb: TracebackType | None, ours: bool = True) -> list[traceback.FrameSummary]:
    """The frames of ``tb`` less those whose code sets ``__tracebackhide__`` (hvdnb's public
    functions, IPython's own ``run_code``); ``ours`` False: less hvdnb's own frames too."""
    kept = []
    frames = traceback.extract_tb(tb)
    t = tb
    for fr in frames:
        assert t is not None
        hidden = t.tb_frame.f_locals.get("__tracebackhide__")
        if not hidden and (ours or not fr.filename.startswith(_PACKAGE)):
            kept.append(fr)
        t = t.tb_next
    return kept


class UserFacing:
    """An error whose message says what to do: IPython shows the user's frames and the
    message (``_render_traceback_``), none of hvdnb's (``ClusterError``, ``InputError``)."""

    def _render_traceback_(self) -> list[str]:
        assert isinstance(self, BaseException)
        lines = ["Traceback (most recent call last):"]
        frames = user_frames(self.__traceback__, ours=False)
        lines += "".join(traceback.format_list(frames)).splitlines()
        lines += "".join(exception_lines(self)).splitlines()
        return lines


class InputError(UserFacing, Exception):
    """A value given to hvdnb's public API is not one it accepts."""


def refusal(where: str, exc: BaseException) -> InputError:
    """A validator's ``TypeError`` / ``ValueError`` as the public function's refusal, named
    by it (``hvdnb.knobs: ...``): raise it ``from None`` in the public function."""
    if isinstance(exc, InputError):
        return exc
    cls = InputTypeError if isinstance(exc, TypeError) else InputValueError
    return cls(f"{where}: {exc}")


class InputTypeError(InputError, TypeError):
    """The value is of a type the argument does not take."""


class InputValueError(InputError, ValueError):
    """The value is of the right kind but not a usable one (a tensor of many elements)."""
