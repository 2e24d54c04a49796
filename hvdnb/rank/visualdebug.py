"""JupyterLab's visual debugger on a rank: debugpy's adapter, started when the notebook asks.

The notebook kernel (``hvdnb.notebook.debug``) speaks the Debug Adapter Protocol to each
rank's adapter over TCP and shows the ranks in JupyterLab's debugger. The rank only starts
the adapter and says where it listens (``DEBUG_LISTEN`` -> ``DEBUG_READY``, on the side
channel's thread, so a rank busy in a cell answers too); breakpoints, stepping and variables
are debugpy's own.

The adapter listens on the address the notebook reaches this rank on: loopback when the
notebook is on this host. debugpy has no authentication, so it is never opened wider.

Owns: starting debugpy on this rank, and whether ``breakpoint()`` stops in it. Never:
import debugpy before the notebook asks (it traces every call once attached).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hvdnb.host import is_loopback, route_addr
from hvdnb.protocol import kinds

__all__ = ["active", "breakpoint_here", "listen"]

_STATE: dict[str, Any] = {"endpoint": None, "error": None}
_LOCK = threading.Lock()


def _listen_addr() -> str:
    """Loopback when the notebook is on this host, else this host's address toward it."""
    endpoint = os.environ.get("HVDNB_CHANNEL", "")
    host = urlsplit(endpoint.replace("tcp://", "http://", 1)).hostname or "127.0.0.1"
    if is_loopback(host):
        return "127.0.0.1"
    try:
        return route_addr(host)
    except OSError:
        return "127.0.0.1"


def listen() -> tuple[str, int]:
    """Start debugpy's adapter on this rank (once per process); its ``(host, port)``."""
    with _LOCK:
        if _STATE["endpoint"] is not None:
            return _STATE["endpoint"]  # type: ignore[no-any-return]
        # frozen stdlib modules: debugpy warns on stderr at every start (the cell would show
        # it); its breakpoints are in the user's code, which is never frozen
        os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
        plugins = str(Path(__file__).with_name("_debugpy_plugins"))
        if plugins not in sys.path:  # a tensor's value shown as its shape, dtype and device
            sys.path.append(plugins)
        import debugpy  # noqa: PLC0415  debugpy: only once the visual debugger is on

        _add_extensions(plugins)
        debugpy.configure(subProcess=False)  # a DataLoader's workers are not debugged
        host, port = debugpy.listen((_listen_addr(), 0))
        endpoint = (str(host), int(port))
        _STATE["endpoint"] = endpoint
        return endpoint


def _add_extensions(folder: str) -> None:
    """pydevd's extension namespace includes ``folder``'s, even when it was imported first
    (ipykernel imports pydevd on every engine): pydevd reads it when it first shows a value."""
    try:
        import pydevd_plugins  # noqa: PLC0415  debugpy's, on sys.path once debugpy is imported
        import pydevd_plugins.extensions as extensions  # noqa: PLC0415
    except ImportError:
        return
    for pkg, sub in ((pydevd_plugins, "pydevd_plugins"), (extensions, "pydevd_plugins/extensions")):
        path = str(Path(folder, sub))
        if path not in list(pkg.__path__):
            pkg.__path__.append(path)
    try:  # read again at the next value shown, with hvdnb's among them
        from _pydevd_bundle import pydevd_extension_utils  # noqa: PLC0415

        manager = pydevd_extension_utils.EXTENSION_MANAGER_INSTANCE
        manager.loaded_extensions = None
        manager.type_to_instance.clear()
    except (ImportError, AttributeError):
        pass


def active() -> bool:
    """debugpy's adapter runs here and a debugger is attached to it."""
    if _STATE["endpoint"] is None:
        return False
    debugpy = sys.modules.get("debugpy")
    return bool(debugpy is not None and debugpy.is_client_connected())


def breakpoint_here() -> None:
    """``breakpoint()`` with the visual debugger attached: stop in it, in the caller's frame."""
    import debugpy  # noqa: PLC0415  already imported by listen()

    debugpy.breakpoint()


def on_listen(ch: Any, msg: dict[str, Any]) -> None:
    """The side channel's ``DEBUG_LISTEN``: start the adapter, answer ``DEBUG_READY``."""
    try:
        host, port = listen()
    except Exception as exc:  # no debugpy, or its adapter would not start: say why
        ch.send(kinds.DEBUG_READY, ask=msg.get("ask"), error=f"{type(exc).__name__}: {exc}")
        return
    ch.send(kinds.DEBUG_READY, ask=msg.get("ask"), host=host, port=port, pid=os.getpid())
