"""What a rank says to the warm-standby machinery.

- Its exit code, to its stand-in (``hvdnb.rank.adopt``: the process its launcher started
  and still watches) when a standby (``hvdnb.rank.standby``) became this rank, so the
  launcher sees the code a cold engine would have exited with.
- The frameworks it imports, to the notebook, so the standby imports them too.

Never: block an exit or a training step (one message per framework, on its first import).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

__all__ = ["FRAMEWORKS", "announce_imports", "report_exit", "set_link"]

#: modules whose import costs a rank seconds: when a rank imports one, the notebook's
#: standby imports it too (``announce_imports``)
FRAMEWORKS = (
    "tensorflow",
    "keras",
    "lightning",
    "pytorch_lightning",
    "transformers",
    "accelerate",
    "torchvision",
    "sklearn",
)

_LINK: list[socket.socket] = []


def set_link(link: socket.socket) -> None:
    """This process became a rank through ``link`` (the stand-in's connection)."""
    _LINK.append(link)


def report_exit(code: int) -> None:
    """Tell the stand-in this engine's exit code (nothing in a cold engine)."""
    if _LINK:
        try:
            _LINK[0].sendall(f"exit {code}".encode())
        except OSError:
            pass


def announce_imports() -> None:
    """Tell the notebook when a framework is first imported on this rank, so its standby
    imports it too (nothing where ``HVDNB_STANDBY=0`` turned the standby off)."""
    if os.environ.get("HVDNB_STANDBY", "").strip().lower() in ("0", "off", "false", "no"):
        return
    import wrapt  # noqa: PLC0415  a rank's dependency, not the stand-in's

    from hvdnb.protocol import kinds  # noqa: PLC0415
    from hvdnb.rank import channel  # noqa: PLC0415

    def said(name: str) -> Any:
        def hook(_mod: Any) -> None:
            ch = channel.get()
            if ch is not None:
                ch.send(kinds.IMPORTED, module=name)

        return hook

    # a module imported already (a warm rank's standby preloaded it: the notebook knows)
    # is not announced: its hook would fire now, during the bootstrap, and connect the side
    # channel before the engine holds its session key; every message of that channel,
    # its hello included, would then be refused (a warm restart after `import accelerate`
    # waited out its 30 s for the ranks' hello)
    for name in FRAMEWORKS:
        if name not in sys.modules:
            wrapt.register_post_import_hook(said(name), name)
