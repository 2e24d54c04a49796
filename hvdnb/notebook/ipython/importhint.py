"""A missing optional module in an ordinary cell of the notebook kernel: IPython's usual
traceback, plus the line that installs it (``hvdnb.extras``), e.g. for ``import tensorflow``
in notebook 08 without the ``[tf]`` extra.

``load_ipython_extension`` installs it with IPython's ``set_custom_exc`` for
ModuleNotFoundError only. IPython keeps one such handler: when another one is registered
(by the user or another extension), it is left alone and nothing is installed. The handler
shows the traceback through ``showtraceback`` as IPython does for any error (``%debug``,
``%pdb`` and the kernel's error reply work as before), with the hint as an exception note
(PEP 678; printed after the traceback on Python 3.10). A module hvdnb does not know gets the
plain traceback.

Never: change what is raised or caught, or replace another handler.
"""

from __future__ import annotations

import sys
from typing import Any

from hvdnb.extras import hint

__all__ = ["install", "uninstall"]

_INSTALLED: set[int] = set()  # id() of the shells whose handler is ours


def _show(shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: Any = None) -> None:
    tip = hint(getattr(value, "name", None) or "")
    add_note = getattr(value, "add_note", None)  # Python 3.11+
    if tip and add_note is not None:
        if tip not in getattr(value, "__notes__", ()):
            add_note(tip)
        tip = None
    shell.showtraceback((etype, value, tb), tb_offset=tb_offset, running_compiled_code=True)
    if tip:
        print(tip, file=sys.stderr)


def install(shell: Any) -> bool:
    """Add the hint to ModuleNotFoundError tracebacks in ``shell``; False (and nothing
    done) when another custom exception handler is registered there."""
    current = tuple(getattr(shell, "custom_exceptions", ()))
    if current == (ModuleNotFoundError,) and id(shell) in _INSTALLED:
        return True  # %reload_ext: ours already
    if current:
        return False
    shell.set_custom_exc((ModuleNotFoundError,), _show)
    _INSTALLED.add(id(shell))
    return True


def uninstall(shell: Any) -> None:
    """Remove the handler ``install`` registered (another one is left alone)."""
    if id(shell) in _INSTALLED:
        _INSTALLED.discard(id(shell))
        if tuple(getattr(shell, "custom_exceptions", ())) == (ModuleNotFoundError,):
            shell.set_custom_exc((), None)
