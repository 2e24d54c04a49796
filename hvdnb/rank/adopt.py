"""The command a warm restart's launcher runs in place of an engine: hand this rank to a
standby process (``hvdnb.rank.standby``) that has torch imported already, then stand in for
it until it exits.

Run by path with ``python -I -S`` (stdlib only, ~10 ms): the launcher (mpiexec, a local
engine set) sees this process as the rank, so it passes over what makes the rank: its
environment (PMI rank and size included), working directory, engine arguments, and its
file descriptors 0, 1 and 2 plus MPICH's ``PMI_FD`` socket (``SCM_RIGHTS``). The standby
process becomes the engine with them; this process forwards the signals the launcher sends
(SIGINT, SIGTERM, ...), and exits with the engine's exit code when the engine ends (or
with 1 when the engine died without one).

On a ``--hosts`` cluster each host has its own standby: the socket's path has ``{host}``
in it, filled with this host's name, and the ranks are counted per host.

Where no standby takes the rank (none ready for it, or the standby refused because its
interpreter was started with other import-time variables) it ``exec``s the cold engine, so
a restart never fails for want of a standby: it is only slower.

Never: import anything beyond the standard library, or wait on a standby without a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

#: how long a standby has to take the rank (an idle one answers in milliseconds; the
#: notebook sets ``HVDNB_STANDBY_WAIT`` longer when one is still importing)
TAKE_TIMEOUT = 3.0
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def cold(args: list[str], why: str) -> None:
    """Become the engine the launcher would have run without a standby."""
    os.environ["HVDNB_STARTED"] = f"cold: {why}"
    os.execv(sys.executable, [sys.executable, "-m", "kernels_ext.engine", *args])


def rank_index(per_host: bool = False) -> int | None:
    """This rank's number among the ranks the launcher starts, or among its host's where
    each host has a standby of its own (None: not known)."""
    keys = ("MPI_LOCALRANKID", "HVDNB_LOCAL_RANK") if per_host else ("PMI_RANK", "HVDNB_SLOT")
    for key in keys:
        v = os.environ.get(key, "")
        if v.isdigit():
            return int(v)
    return None


def hand_over(path: str, args: list[str]) -> tuple[socket.socket, int] | None:
    """Give this rank to a standby at ``path``: (the link, its pid), or None if none took it."""
    fds = [0, 1, 2]
    pmi = os.environ.get("PMI_FD", "")
    if pmi.isdigit():
        fds.append(int(pmi))
    payload = {"env": dict(os.environ), "cwd": os.getcwd(), "argv": args, "fds": len(fds)}
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:  # longer when a standby still imports (the notebook's ``standby.engines``)
        s.settimeout(float(os.environ.get("HVDNB_STANDBY_WAIT", TAKE_TIMEOUT)))
    except ValueError:
        s.settimeout(TAKE_TIMEOUT)
    try:
        s.connect(path)
        socket.send_fds(s, [json.dumps(payload).encode() + b"\n"], fds)
        reply = s.recv(256).decode()
        if not reply.startswith("ok "):
            if reply:
                print(f"hvdnb: the standby did not take this rank: {reply[3:]}", file=sys.stderr)
            s.close()
            return None
        s.sendall(b"go")
        s.settimeout(None)
        return s, int(reply.split()[1])
    except OSError as exc:
        print(f"hvdnb: no standby took this rank: {exc}", file=sys.stderr)
        s.close()
        return None


def main() -> None:
    path, args = sys.argv[1], sys.argv[2:]
    per_host = "{host}" in path  # a standby on each host: this host's is ours
    path = path.replace("{host}", socket.gethostname())
    want = os.environ.get("HVDNB_STANDBY_READY", "0")
    index = rank_index(per_host)
    if not want.isdigit() or (index is not None and index >= int(want)):
        cold(args, f"{want} standby processes were ready")
    got = hand_over(path, args)
    if got is None:
        cold(args, "no standby took it")
        return
    link, pid = got

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(pid, signum)
        except OSError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    code = 1  # the engine ended without saying how: it was killed
    buf = b""
    while True:
        try:
            chunk = link.recv(64)
        except InterruptedError:
            continue
        if not chunk:
            break
        buf += chunk
    if buf.startswith(b"exit "):
        code = int(buf.split()[1])
    os._exit(code)


if __name__ == "__main__":
    main()
