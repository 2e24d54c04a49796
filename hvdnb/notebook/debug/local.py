"""The notebook's own debugpy, started as ipykernel starts it, but with its error kept.

ipykernel's ``Debugger.start`` picks a free port (binding and unbinding a ZMQ socket), runs
``debugpy.listen`` on the kernel's shell thread and answers ``initialize`` with
``success: False`` and no reason when that fails. On a loaded machine the port can be taken
between the unbind and the debugpy adapter's bind (CI saw one such failure). This starts it
the same way, tries a fresh port when the first fails, and returns the error otherwise, so
the page's answer can say what went wrong.

Owns: nothing past the start. Never: start a rank's debugpy (``hvdnb.rank.visualdebug``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["start_notebook_debugpy"]

#: how many fresh ports are tried before the debugger says it cannot start
ATTEMPTS = 3


def start_notebook_debugpy(debugger: Any) -> str | None:
    """Run ``debugpy.listen`` in the kernel as ipykernel would; None once it listens, else
    the last error ("RuntimeError: ..."). Leaves ``debugger.debugpy_initialized`` set on
    success, so ipykernel's own start skips straight to connecting."""
    if getattr(debugger, "debugpy_initialized", False):
        return None
    import zmq  # noqa: PLC0415  zmq, ipykernel: only inside a kernel
    from ipykernel.compiler import get_tmp_directory  # noqa: PLC0415

    Path(get_tmp_directory()).mkdir(mode=0o700, parents=True, exist_ok=True)  # dumped cells
    client = debugger.debugpy_client
    error = "debugpy.listen did not answer"
    for _ in range(ATTEMPTS):
        host, port = client.get_host_port()
        code = f"import debugpy;debugpy.listen(({host!r},{int(port)}))"
        debugger.session.send(
            debugger.shell_socket,
            "execute_request",
            {"code": code, "silent": True},
            None,
            debugger.shell_socket.getsockopt(zmq.ROUTING_ID),
        )
        _ident, msg = debugger.session.recv(debugger.shell_socket, mode=0)
        content = (msg or {}).get("content") or {}
        if content.get("status") == "ok":
            debugger.debugpy_initialized = True
            return None
        error = f"{content.get('ename', 'error')}: {content.get('evalue', '')}".strip()
        client.debugpy_port = -1  # the next try binds a fresh port
    return error
