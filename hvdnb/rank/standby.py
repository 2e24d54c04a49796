"""A warm standby: a process that has imported torch (and the frameworks the session's ranks
imported) and waits to become a rank at the next ``%dist restart``.

``python -m hvdnb.rank.standby LISTEN_FD CONTROL_FD [MODULE ...]``, started by the
notebook's ``hvdnb.notebook.cluster.standby``. It imports the modules, says ``ready`` on
its control socket, then waits in ``accept()`` on the listening socket it shares with the
other standby processes. A restart's launcher runs ``hvdnb.rank.adopt`` in place of each
engine; the one standby that accepts receives that rank's environment, working directory,
arguments and file descriptors, takes them as its own, and runs the engine
(``hvdnb.rank.engine.main``) exactly as a cold start would from there on: MPI, the
rendezvous and ipyparallel's registration all happen after the hand-over, so a standby is
never a rank, never in a collective and never seen by the controller.

Control lines from the notebook: ``import MODULE`` (a rank imported a framework: import it
too, so the next restart finds it loaded). The control socket closing before a hand-over
means the notebook has dropped this standby (or died): the process exits.

Refuses a hand-over (the launcher then starts a cold engine) when the rank's environment
differs from this interpreter's start in a variable read at start-up or import time
(``PYTHON*``, ``LD_*``, thread-count variables): those cannot be changed after the fact.

Never: initialise MPI, CUDA or torch.distributed before a hand-over, or outlive the
notebook kernel that started it.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
from typing import Any

from hvdnb.protocol.handover import import_time_diff
from hvdnb.rank import standin

__all__ = ["main"]

_ADOPTED = threading.Event()


def _control(sock: socket.socket) -> None:
    """Serve the notebook's control lines; exit with it while nobody has taken us."""
    f = sock.makefile("r")
    for line in f:
        words = line.split()
        if len(words) == 2 and words[0] == "import":
            try:
                importlib.import_module(words[1])
                sock.sendall(f"imported {words[1]}\n".encode())
            except Exception as exc:  # reported, never fatal: the rank imports it itself
                sock.sendall(f"failed {words[1]} {type(exc).__name__}\n".encode())
    if not _ADOPTED.is_set():
        os._exit(0)


def _watch_link(link: socket.socket) -> None:
    """The stand-in was killed (SIGKILL from a launcher): so is this rank."""
    while True:
        try:
            if not link.recv(64):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    os._exit(1)


def _take(listener: socket.socket, started: dict[str, str]) -> dict[str, Any]:
    """Wait for a rank to be handed over; return its payload with its descriptors."""
    while True:
        conn, _ = listener.accept()
        fds: list[int] = []  # this hand-over's (never a refused one's, closed already)
        try:
            conn.settimeout(5.0)
            msg, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 8)
            while not msg.endswith(b"\n"):
                more = conn.recv(1 << 20)
                if not more:
                    raise OSError("the stand-in left mid-message")
                msg += more
            payload: dict[str, Any] = json.loads(msg)
            diff = import_time_diff(started, payload["env"])
            if diff or len(fds) != payload["fds"]:
                why = f"its interpreter started with other {', '.join(diff)}" if diff else "fds"
                conn.sendall(f"no {why}".encode())
                raise OSError(why)
            conn.sendall(f"ok {os.getpid()}".encode())
            if conn.recv(2) != b"go":
                raise OSError("the stand-in gave up")
            conn.settimeout(None)
            payload["fds"], payload["link"] = fds, conn
            return payload
        except (OSError, ValueError):
            for fd in fds:
                os.close(fd)
            conn.close()


def _become(payload: dict[str, Any]) -> list[str]:
    """Take the handed-over rank's descriptors, environment and directory as our own."""
    fds: list[int] = payload["fds"]
    for target, fd in zip((0, 1, 2), fds[:3], strict=True):
        os.dup2(fd, target)
        os.close(fd)
    env: dict[str, str] = payload["env"]
    if len(fds) > 3:  # MPICH's PMI socket, under whatever number it arrived as
        os.set_inheritable(fds[3], True)
        env["PMI_FD"] = str(fds[3])
    os.environ.clear()
    os.environ.update(env)
    os.environ["HVDNB_STARTED"] = "warm"
    os.chdir(payload["cwd"])
    sys.path[0] = payload["cwd"]
    args: list[str] = payload["argv"]
    sys.argv = [sys.argv[0], *args]
    return args


def _spawn_nanny() -> subprocess.Popen[bytes]:
    """ipyparallel's per-engine nanny (it relays signals to the engine), started now: it
    imports, then waits on its stdin for what it watches (a fresh one costs a rank 0.2 s
    of its registration)."""
    return subprocess.Popen(
        [sys.executable, "-m", "ipyparallel.engine.nanny"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # as ipyparallel starts it: the engine's signals are not its
    )


def _use_nanny(nanny: subprocess.Popen[bytes]) -> None:
    """Have the engine take the nanny started in standby (``start_nanny``'s protocol:
    its arguments pickled on stdin, its URL read back), or start one as usual if it died."""
    import ipyparallel.engine.app as app  # noqa: PLC0415

    cold = app.start_nanny

    def warm(**kwargs: Any) -> tuple[str, subprocess.Popen[bytes]]:
        if nanny.poll() is not None or nanny.stdin is None or nanny.stdout is None:
            return cold(**kwargs)  # type: ignore[no-any-return]
        kwargs["pid"] = os.getpid()
        nanny.stdin.write(pickle.dumps(kwargs))
        nanny.stdin.close()
        url = nanny.stdout.readline().decode().strip()
        if not url:
            raise RuntimeError("nanny failed")
        return url, nanny

    app.start_nanny = warm


def main() -> None:
    listen_fd, control_fd, *modules = sys.argv[1:]
    listener = socket.socket(fileno=int(listen_fd))
    control = socket.socket(fileno=int(control_fd))
    started = dict(os.environ)
    for name in ["torch", *modules]:
        try:
            importlib.import_module(name)
        except Exception as exc:
            control.sendall(f"failed {name} {type(exc).__name__}\n".encode())
    # what the engine itself loads before it registers
    import ipyparallel.engine.app  # noqa: F401, PLC0415

    import hvdnb.rank.engine  # noqa: F401, PLC0415

    nanny = _spawn_nanny()
    control.sendall(f"ready {os.getpid()}\n".encode())
    threading.Thread(target=_control, args=(control,), name="hvdnb-standby", daemon=True).start()
    payload = _take(listener, started)
    _ADOPTED.set()
    control.sendall(b"taken\n")
    listener.close()
    link: socket.socket = payload["link"]
    standin.set_link(link)
    threading.Thread(target=_watch_link, args=(link,), name="hvdnb-adopted", daemon=True).start()
    args = _become(payload)
    _use_nanny(nanny)
    from hvdnb.rank.engine import main as engine_main  # noqa: PLC0415

    engine_main(args)


if __name__ == "__main__":
    main()
