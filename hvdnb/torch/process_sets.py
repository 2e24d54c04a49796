"""Process sets: subsets of ranks that run collectives among themselves (Horovod's API).

Owns: ``ProcessSet`` (its ranks, its MPI and torch transports, its auto-name counters),
``global_process_set``, ``add_process_set`` / ``remove_process_set``,
``build_transports``, and the job state that ``init`` fills (``STATE``). Never: run a
collective on behalf of a non-member, or create a group on some ranks only (group
creation is collective on every rank of the job).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hvdnb.torch.transport import MPITransport, TorchTransport

__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]


class _State:
    """The job state ``init`` fills (one instance: ``STATE``)."""

    def __init__(self) -> None:
        self.initialized = False
        self.world: Any = None
        self.comm: Any = None  # private Dup of MPI COMM_WORLD, None without mpiexec
        self.ctrl: Any = None  # gloo group for headers when the default group is NCCL, no MPI
        self.inline_bytes = 0  # 2 ranks: header and data in one exchange up to this size
        self.butterfly_bytes = 0  # more ranks: the butterfly carries data up to this size
        #: under MPI, a set across hosts: CPU allreduces from this size go over gloo (0: never)
        self.gloo_bytes = 0
        self.hosts: list[str] = []  # under MPI: each rank's hostname, in rank order
        self.next_id = 1
        self.sets: dict[int, ProcessSet] = {}
        #: the planned allreduces (plans.py; they hold transports): cleared when
        #: transports go away
        self.plans: dict[Any, Any] = {}


STATE = _State()


class ProcessSet:
    """A set of global ranks that run collectives together.

    Parameters
    ----------
    ranks : sorted global ranks; ``None`` means every rank (the global set)

    Examples
    --------
    >>> evens = hvd.add_process_set([0, 2])          # doctest: +SKIP
    >>> hvd.allreduce(t, process_set=evens)          # doctest: +SKIP
    """

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks: list[int] | None = sorted(int(r) for r in ranks) if ranks is not None else None
        self.process_set_id: int | None = None
        self.mpi: MPITransport | None = None
        self.torch: TorchTransport | None = None
        self.counters: dict[int, int] = {}

    def included(self) -> bool:
        """Whether this process is a member."""
        check_registered(self)
        assert self.ranks is not None
        return STATE.world.rank in self.ranks

    def size(self) -> int:
        """Number of ranks in the set."""
        check_registered(self)
        assert self.ranks is not None
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set (-1 for non-members)."""
        check_registered(self)
        assert self.ranks is not None
        r = STATE.world.rank
        return self.ranks.index(r) if r in self.ranks else -1

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()


def check_registered(ps: ProcessSet) -> None:
    """ValueError unless hvdnb.torch is initialised and ``ps`` is registered."""
    if not STATE.initialized:
        raise ValueError("hvdnb.torch is not initialised: call hvd.init() first")
    if ps.process_set_id is None:
        raise ValueError(
            f"process set {ps.ranks} is not registered: call hvd.add_process_set(ranks) "
            "on every rank first"
        )


def build_transports(ps: ProcessSet, ranks: list[int]) -> None:
    """Create the transports of ``ps``; collective on every rank of the job."""
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

    w = STATE.world
    ps.ranks = ranks
    member = w.rank in ranks
    if STATE.comm is not None:
        if len(ranks) == w.size:
            sub = STATE.comm.Dup()
        else:
            from mpi4py import MPI  # noqa: PLC0415  mpi4py initialises MPI on import: only where MPI is used

            sub = STATE.comm.Split(color=0 if member else MPI.UNDEFINED, key=w.rank)
            if sub == MPI.COMM_NULL:
                sub = None
        if sub is not None:
            inline = STATE.inline_bytes if sub.Get_size() <= 2 else STATE.butterfly_bytes
            ps.mpi = MPITransport(sub, inline)
    if dist.is_initialized():
        if len(ranks) == w.size:
            group = dist.group.WORLD
        else:
            group = dist.new_group(ranks)
        if member:
            ps.torch = TorchTransport(group, ranks, STATE.ctrl or group, ps.mpi)
        if STATE.gloo_bytes and len({STATE.hosts[r] for r in ranks}) > 1:
            # every rank of the job decides alike (limits and hosts were agreed in init), as
            # new_group needs: a group of its own, never DDP's default group, whose calls
            # the user's code orders
            big = dist.new_group(ranks, backend="gloo")
            if ps.mpi is not None:
                ps.mpi.use_gloo(big, STATE.gloo_bytes)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set; collective: every rank of the job calls it, same ranks.

    Parameters
    ----------
    process_set : a ``ProcessSet`` or a sequence of global ranks

    Returns
    -------
    ProcessSet
        Registered, with its ``process_set_id`` set.
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if not STATE.initialized:
        raise ValueError("call hvd.init() before hvd.add_process_set()")
    assert ps.ranks is not None
    bad = [r for r in ps.ranks if not 0 <= r < STATE.world.size]
    if bad or len(set(ps.ranks)) != len(ps.ranks) or not ps.ranks:
        raise ValueError(
            f"process set ranks {ps.ranks} must be distinct ranks in 0..{STATE.world.size - 1}"
        )
    for other in STATE.sets.values():
        if other.ranks == ps.ranks:
            raise ValueError(f"a process set with ranks {ps.ranks} exists already: {other}")
    build_transports(ps, ps.ranks)
    ps.process_set_id = STATE.next_id
    STATE.next_id += 1
    STATE.sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (collective on every rank). Returns False if unknown."""
    pid = process_set.process_set_id
    if pid is None or pid == 0 or pid not in STATE.sets:
        return False
    del STATE.sets[pid]
    STATE.plans.clear()
    if process_set.mpi is not None:
        process_set.mpi.free()
    process_set.mpi = process_set.torch = None
    process_set.process_set_id = None
    return True
