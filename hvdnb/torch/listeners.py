"""Hooks for observers of ``hvdnb.torch``: collectives completed, optimizer steps taken.

The lists and their functions are the rank side's (``hvdnb.rank.hooks``: ``hvdnb.torch``
registers into the runtime it sits on, never the reverse); this module names them for
``hvdnb.torch``'s own modules and its public API (``hvd.add_comm_listener``). ``LISTENERS``
is the same list object as ``hvdnb.rank.hooks.COMM_LISTENERS``: the collectives' hot paths
check it and do nothing else when it is empty.
"""

from __future__ import annotations

from hvdnb.rank.hooks import (
    COMM_LISTENERS,
    STEP_LISTENERS,
    CommListener,
    StepListener,
    add_comm_listener,
    add_step_listener,
    after_step,
    notify,
    remove_comm_listener,
    remove_step_listener,
)

__all__ = [
    "LISTENERS",
    "STEP_LISTENERS",
    "CommListener",
    "StepListener",
    "add_comm_listener",
    "add_step_listener",
    "after_step",
    "notify",
    "remove_comm_listener",
    "remove_step_listener",
]

#: the comm listeners (``hvdnb.rank.hooks.COMM_LISTENERS``: one list, owned there)
LISTENERS = COMM_LISTENERS
