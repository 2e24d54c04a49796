"""The warm standby of one other host: its standby processes, started and watched there.

``python -m hvdnb.rank.standby_pool DIR_TEMPLATE``, run by the notebook over ssh
(``hvdnb.notebook.cluster.hoststandby``) on each host of a ``--hosts`` cluster. It makes the
directory ``DIR_TEMPLATE`` with ``{host}`` replaced by this host's name (mode 0700: only
this user hands ranks over), listens on ``standby.sock`` there, and starts standby
processes (``hvdnb.rank.standby``) that share that socket, as the notebook does for its own
host. A warm restart's stand-in (``hvdnb.rank.adopt``), started on this host by hydra's
proxy, finds the same directory from the same template.

It speaks lines over its stdin and stdout (the ssh session):

- in: ``spawn`` (start one more standby process), ``import MODULE`` (every standby imports
  it), ``end N`` (drop standby N unless it is a rank now);
- out: ``listening PATH``, then per standby ``N pid PID``, ``N ready PID``, ``N taken``,
  ``N imported MODULE``, ``N failed MODULE KIND``, ``N exit CODE``.

Its stdin closing (the notebook ended, or its ssh was cut) ends every standby process not
taken, and removes the directory; the taken ones are ranks, which their launcher owns.

Never: import torch itself, or outlive its ssh session.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading

from hvdnb.protocol.handover import send_line

__all__ = ["main"]

_OUT = threading.Lock()


def _say(line: str) -> None:
    with _OUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class _Child:
    def __init__(self, index: int, listener: socket.socket) -> None:
        self.index = index
        ours, theirs = socket.socketpair()
        self.popen = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hvdnb.rank.standby",
                str(listener.fileno()),
                str(theirs.fileno()),
                *MODULES,
            ],
            pass_fds=(listener.fileno(), theirs.fileno()),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a signal to this pool's session is not for it
        )
        theirs.close()
        self.control = ours
        self.taken = False
        _say(f"{index} pid {self.popen.pid}")
        threading.Thread(target=self._relay, daemon=True).start()

    def _relay(self) -> None:
        """What the standby says, prefixed with its number; its exit when it ends."""
        for line in self.control.makefile("r", errors="replace"):
            words = line.split()
            if words[:1] == ["taken"]:
                self.taken = True
            if words:
                _say(f"{self.index} {' '.join(words)}")
        _say(f"{self.index} exit {self.popen.wait()}")

    def send(self, line: str) -> None:
        send_line(self.control, line)

    def end(self) -> None:
        if self.taken:
            return
        try:
            self.control.shutdown(socket.SHUT_RDWR)  # it exits on EOF ...
        except OSError:
            pass
        try:
            self.popen.kill()  # ... or now, mid-import
        except OSError:
            pass


MODULES: list[str] = []


def main() -> None:
    template = sys.argv[1]
    folder = template.replace("{host}", socket.gethostname())
    os.makedirs(folder, mode=0o700)
    path = os.path.join(folder, "standby.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    os.environ["PYTHONUNBUFFERED"] = "1"
    children: dict[int, _Child] = {}
    _say(f"listening {path}")
    try:
        for line in sys.stdin:
            words = line.split()
            if words == ["spawn"]:
                child = _Child(len(children), listener)
                children[child.index] = child
            elif len(words) == 2 and words[0] == "import":
                if words[1] not in MODULES:
                    MODULES.append(words[1])
                for c in children.values():
                    c.send(line.strip())
            elif len(words) == 2 and words[0] == "end" and words[1].isdigit():
                ended = children.get(int(words[1]))
                if ended is not None:
                    ended.end()
    finally:
        for c in children.values():
            c.end()
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
