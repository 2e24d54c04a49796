"""``hvdnb.require_ranks``: a lesson that needs more ranks says so at once, in words.

A notebook that teaches a parameter server needs a server and a worker; at world size 1
(the default on a one-GPU node) it would otherwise wait forever in a ``recv``. Its first
``%%distributed`` cell calls ``hvdnb.require_ranks(2, "a server and a worker")``: every rank
raises the same ``NotEnoughRanks`` naming the command that gives it enough ranks, before any
work starts.

Owns: the check and its wording. Never: issue a collective (every rank decides alone from
the world size it already knows, so all of them raise or none does).
"""

from __future__ import annotations

import os

from hvdnb.protocol.errors import InputValueError

__all__ = ["NotEnoughRanks", "require_ranks"]


class NotEnoughRanks(RuntimeError):
    """The job has fewer ranks than the code that raised it needs."""


NotEnoughRanks.__module__ = "hvdnb"  # shown as hvdnb.NotEnoughRanks, where users find it


def _world_size() -> int:
    try:
        import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except ImportError:
        pass
    return int(os.environ.get("WORLD_SIZE", "1"))


def require_ranks(n: int, why: str = "") -> int:
    """Raise ``NotEnoughRanks`` on every rank unless the job has at least ``n`` ranks.

    Parameters
    ----------
    n : the fewest ranks the code needs
    why : what the ranks are for, said in the error (e.g. "a server and a worker")

    Returns
    -------
    int
        The world size, when it is enough.

    Examples
    --------
    >>> hvdnb.require_ranks(2, "a server and at least one worker")  # doctest: +SKIP
    """
    if not isinstance(n, int) or n < 1:
        raise InputValueError(f"require_ranks needs a number of ranks >= 1, not {n!r}")
    size = _world_size()
    if size >= n:
        return size
    what = f" ({why})" if why else ""
    raise NotEnoughRanks(
        f"this notebook needs at least {n} ranks{what}; the cluster has {size}. "
        f"Run `%dist restart -n {n}` (add --oversubscribe where this host has fewer cores "
        f"or GPUs than {n}), then run the notebook again from the top"
    )
