"""JupyterLab's visual debugger on a rank: debugpy's adapter, started when the notebook asks.

The notebook kernel (``hvdnb.notebook.debug``) speaks the Debug Adapter Protocol to each
rank's adapter over TCP and shows the ranks in JupyterLab's debugger. The rank only starts
the adapter and says where it listens (``DEBUG_LISTEN`` -> ``DEBUG_READY``, on the side
channel's thread, so a rank busy in a cell answers too); breakpoints, stepping and variables
are debugpy's own.

The adapter listens on the address the notebook reaches this rank on: loopback when the
notebook is on this host. debugpy has no authentication, so it is never opened wider.

While the debugger is attached, a rank may sit at a breakpoint for as long as a person
reads it, and its peers wait in their next collective: this rank's process groups then
wait ``HELD_TIMEOUT`` instead of ``collective_timeout`` (torch's ``_set_pg_timeout``, read
by each collective as it starts), and get their own timeout back when the debugger is
turned off (``DEBUG_OFF``).

Owns: starting debugpy on this rank, whether ``breakpoint()`` stops in it, and the process
groups' timeouts while it is attached. Never: import debugpy before the notebook asks (it
traces every call once attached).
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hvdnb.host import is_loopback, route_addr
from hvdnb.protocol import kinds

__all__ = [
    "active",
    "breakpoint_here",
    "hold_timeouts",
    "listen",
    "new_cell",
    "on_listen",
    "on_off",
]

_STATE: dict[str, Any] = {"endpoint": None, "error": None, "held": [], "on": False}
#: how long a collective may wait while JupyterLab's debugger is attached
HELD_TIMEOUT = datetime.timedelta(hours=24)
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
        for t in threading.enumerate():  # the engine's own threads, never the user's
            if t is not threading.main_thread():
                t.pydev_do_not_trace = True  # type: ignore[attr-defined]
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
    """JupyterLab's debugger is on (``DEBUG_LISTEN`` came, no ``DEBUG_OFF`` since) and
    attached to this rank's adapter."""
    if _STATE["endpoint"] is None or not _STATE["on"]:
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
    _STATE["on"] = True
    hold_timeouts()
    ch.send(kinds.DEBUG_READY, ask=msg.get("ask"), host=host, port=port, pid=os.getpid())


def _groups() -> list[Any]:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return []
    from torch.distributed import distributed_c10d as c10d  # noqa: PLC0415  loaded above

    return list(c10d._world.pg_map)


def _timeout_of(pg: Any) -> datetime.timedelta | None:
    try:
        return pg._get_backend(next(iter(pg._device_types))).options._timeout  # type: ignore[no-any-return]
    except Exception:  # a backend without options (MPI): it has no timeout to hold
        return None


def new_cell() -> None:
    """A cell starts. A rank interrupted while the debugger held it took the
    KeyboardInterrupt inside debugpy's trace function: Python then stopped tracing the
    thread, and debugpy still counts it as suspended, so it would never stop there again.
    The thread is marked running and traced again. While the debugger is on, groups made
    since it attached wait ``HELD_TIMEOUT`` too."""
    if _STATE["endpoint"] is None:
        return
    info = getattr(threading.current_thread(), "additional_info", None)
    if info is not None and info.pydev_state == 2 and not info.is_in_wait_loop:  # suspended
        info.pydev_state = 1  # pydevd's STATE_RUN
        info.pydev_step_cmd = info.pydev_original_step_cmd = -1
    if _STATE["on"]:
        if sys.gettrace() is None:
            import debugpy  # noqa: PLC0415  imported by listen()

            debugpy.trace_this_thread(True)
        hold_timeouts()  # a group rebuilt since (after a failed cell) waits too


def hold_timeouts() -> None:
    """This rank's process groups wait ``HELD_TIMEOUT`` in a collective (once per attach)."""
    groups = _groups()
    if not groups:
        return
    from torch.distributed import distributed_c10d as c10d  # noqa: PLC0415  loaded: groups exist

    held = _STATE["held"]
    known = {id(pg) for pg, _ in held}
    for pg in groups:
        before = _timeout_of(pg)
        if id(pg) in known or before is None or before >= HELD_TIMEOUT:
            continue
        try:
            c10d._set_pg_timeout(HELD_TIMEOUT, pg)
        except Exception:  # a group this rank is not in, or already destroyed
            continue
        held.append((pg, before))


def on_off(msg: dict[str, Any] | None = None) -> None:
    """The side channel's ``DEBUG_OFF``: ``breakpoint()`` is pdb's again, and the groups get
    their timeouts back."""
    _STATE["on"] = False
    held = _STATE["held"]
    if not held:
        return
    from torch.distributed import distributed_c10d as c10d  # noqa: PLC0415

    for pg, before in held:
        try:
            c10d._set_pg_timeout(before, pg)
        except Exception:  # destroyed since (a restart of the group): its successor has its own
            pass
    held.clear()
