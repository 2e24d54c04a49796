"""``python -m hvdnb.rank.storehost --fd N``: the rendezvous store of an elastic cluster, in
a process of its own.

An elastic cluster must survive any rank's death, rank 0's included, so its torch
``TCPStore`` cannot live on a rank (as a fixed-size cluster's does). The notebook starts
this process beside the engines, handing it a socket already bound and listening (file
descriptor ``N``: the engines are told the port at once, and connect while this process
still imports torch); it serves a master ``TCPStore`` on it until its standard input
closes (the notebook stopped the cluster, or died: the pipe closes with it).

Never: join a process group, or outlive the notebook that started it.
"""

from __future__ import annotations

import socket
import sys
from datetime import timedelta


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    fd = int(args[args.index("--fd") + 1])
    sock = socket.socket(fileno=fd)
    addr, port = sock.getsockname()[:2]
    from torch.distributed import TCPStore  # noqa: PLC0415  torch is heavy: after the socket is known

    store = TCPStore(
        addr,
        port,
        None,
        True,
        timeout=timedelta(seconds=30),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
    sys.stdout.write("serving\n")  # the notebook's spare store is ready from here on
    sys.stdout.flush()
    try:
        while sys.stdin.read(4096):
            pass
    except (OSError, KeyboardInterrupt):
        pass
    del store


if __name__ == "__main__":
    main()
