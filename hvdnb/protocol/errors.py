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

import traceback
from types import TracebackType

__all__ = ["InputError", "InputTypeError", "InputValueError", "exception_lines", "user_frames"]


def exception_lines(exc: BaseException) -> list[str]:
    """``traceback.format_exception_only``, but a refusal is named by the builtin error it
    is (``TypeError: hvdnb.log: loss must be a number, ...``), not by hvdnb's class."""
    if isinstance(exc, InputError):
        base = TypeError if isinstance(exc, TypeError) else ValueError
        return [f"{base.__name__}: {exc}\n"]
    return traceback.format_exception_only(type(exc), exc)


def user_frames(tb: TracebackType | None) -> list[traceback.FrameSummary]:
    """The frames of ``tb`` less those whose code sets ``__tracebackhide__`` (hvdnb's public
    functions, IPython's own ``run_code``)."""
    kept = []
    frames = traceback.extract_tb(tb)
    t = tb
    for fr in frames:
        assert t is not None
        if not t.tb_frame.f_locals.get("__tracebackhide__"):
            kept.append(fr)
        t = t.tb_next
    return kept


class InputError(Exception):
    """A value given to hvdnb's public API is not one it accepts."""

    def _render_traceback_(self) -> list[str]:
        """IPython shows this: the user's frames, then the message (no hvdnb frame)."""
        lines = ["Traceback (most recent call last):"]
        lines += "".join(traceback.format_list(user_frames(self.__traceback__))).splitlines()
        lines += "".join(exception_lines(self)).splitlines()
        return lines


class InputTypeError(InputError, TypeError):
    """The value is of a type the argument does not take."""


class InputValueError(InputError, ValueError):
    """The value is of the right kind but not a usable one (a tensor of many elements)."""
