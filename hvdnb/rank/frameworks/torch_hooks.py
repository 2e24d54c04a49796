"""PyTorch's own tutorial code on a rank: ``init_process_group``, ``destroy_process_group``
and ``torch.multiprocessing.spawn`` in a cell.

The DDP tutorial starts its ranks with ``mp.spawn``, calls ``init_process_group`` in each
and ``destroy_process_group`` at the end. On a rank the group exists already (hvdnb made
it when the cluster started) and the ranks are running, so:

- ``init_process_group(...)`` whose world size and rank are the cluster's keeps the
  cluster's group and says so in one line, naming the backend that serves it (``"mpi"``
  on a torch without MPI: gloo serves torch's collectives, and ``hvdnb.torch`` sends CPU
  tensors over MPI); a request the cluster cannot serve (``nccl`` without a GPU per rank,
  another world size or rank) raises one ``ValueError`` saying what differs and what to
  change. With no group yet (hvdnb's own rebuild after a failed cell) it is torch's call.
- ``destroy_process_group()`` of the default group keeps it for the next cells (one line
  says so); another group is destroyed. hvdnb's own teardown calls
  ``destroy_default_group``, which is torch's.
- ``torch.multiprocessing.spawn(fn, args, nprocs)`` runs ``fn(local_rank, *args)`` once on
  this rank when ``nprocs`` is the number of ranks on this host; any other count raises at
  once, naming both counts. It never starts processes.

torch has no seam for these, so this is a patch of three names of ``torch.distributed``
and ``torch.multiprocessing``, written for torch 2.13 (their signatures since 2.2).
Never: start a process, or change a call made while no group exists.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from hvdnb.rank.frameworks.common import Place, note, setdefault_env

__all__ = [
    "destroy_default_group",
    "install",
    "move",
]

_ORIG: dict[str, Any] = {}
_PLACE: Place | None = None


def install(p: Place) -> None:
    """Put the three guards in place (once per process)."""
    global _PLACE
    import torch  # noqa: PLC0415  torch is heavy: loaded when first used
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used
    import torch.distributed.distributed_c10d as c10d  # noqa: PLC0415  torch is heavy: loaded when first used
    import torch.multiprocessing as tmp  # noqa: PLC0415  torch is heavy: loaded when first used

    if _ORIG:
        return
    _PLACE = p
    # as torchrun does: frameworks that find it unset pick a count of their own and warn
    # (Accelerate: "OMP_NUM_THREADS/MKL_NUM_THREADS unset"); hvdnb set torch's already
    setdefault_env(OMP_NUM_THREADS=str(torch.get_num_threads()))
    # (getattr: torch's stubs do not list these as the modules' own attributes)
    _ORIG["init"] = getattr(c10d, "init_process_group")  # noqa: B009
    _ORIG["destroy"] = getattr(c10d, "destroy_process_group")  # noqa: B009
    _ORIG["spawn"] = getattr(tmp, "spawn")  # noqa: B009
    _ORIG["init_sig"] = inspect.signature(_ORIG["init"])
    guards: dict[str, Any] = {
        "init_process_group": _init_process_group,
        "destroy_process_group": _destroy_process_group,
    }
    for mod in (dist, c10d):  # torch.distributed re-exports c10d's names
        for name, fn in guards.items():
            setattr(mod, name, fn)
    # torch.multiprocessing re-exports its submodule's spawn
    for holder in (tmp, sys.modules.get("torch.multiprocessing.spawn")):
        if holder is not None:
            setattr(holder, *("spawn", _spawn))


def destroy_default_group() -> None:
    """Destroy the default group with torch's own call (hvdnb's teardown and rebuild)."""
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

    _ORIG.get("destroy", getattr(dist, "destroy_process_group"))()  # noqa: B009


def _backend_words(name: str) -> str:
    return {"gloo": "gloo", "nccl": "NCCL", "mpi": "MPI"}.get(name, name)


def _asked_backend(backend: Any) -> str:
    return str(backend).lower() if backend is not None else ""


def _init_process_group(*args: Any, **kwargs: Any) -> None:
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

    if not dist.is_initialized():
        return _ORIG["init"](*args, **kwargs)  # type: ignore[no-any-return]
    asked = _ORIG["init_sig"].bind_partial(*args, **kwargs).arguments
    have, size, rank = str(dist.get_backend()), dist.get_world_size(), dist.get_rank()
    want_size = asked.get("world_size", -1)
    want_rank = asked.get("rank", -1)
    fix = "leave it out (hvdnb set RANK and WORLD_SIZE on every rank)"
    if want_size not in (-1, None) and int(want_size) != size:
        raise ValueError(
            f"init_process_group(world_size={want_size}) on rank {rank}: the cluster has "
            f"{size} ranks, and this cell runs on each of them. Pass world_size={size} or "
            f"{fix}; for {want_size} ranks, %dist restart -n {want_size}"
        )
    if want_rank not in (-1, None) and int(want_rank) != rank:
        raise ValueError(
            f"init_process_group(rank={want_rank}) on rank {rank}: each rank of the cluster "
            f"has its own number. Pass rank=int(os.environ['RANK']) or {fix}"
        )
    want = _asked_backend(asked.get("backend"))
    if "nccl" in want and "nccl" not in have:
        import torch  # noqa: PLC0415  torch is heavy: loaded when first used

        why = (
            "its ranks share a GPU (NCCL needs one GPU per rank)"
            if torch.cuda.is_available()
            else "its ranks have no GPU"
        )
        raise ValueError(
            f"init_process_group({want!r}) on rank {rank}: this cluster's group is {have}, "
            f"as {why}. Ask for 'gloo' (or torch.distributed.get_default_backend_for_device"
            "('cpu')), or start one rank per GPU on a GPU node"
        )
    where = f"{_backend_words(have)}, {size} rank{'s' if size != 1 else ''}"
    if want == "mpi" and not dist.is_mpi_available():
        note(
            f"init_process_group('mpi'): this torch has no MPI backend; the cluster's group "
            f"({where}) serves torch.distributed, and hvdnb.torch sends CPU tensors over MPI"
        )
    elif want and want not in have and not ("gloo" in want and "nccl" in have):
        note(f"init_process_group({want!r}): kept the cluster's group ({where})")
    elif "gloo" in want and "nccl" in have:
        note(
            f"init_process_group('gloo'): kept the cluster's group ({where}): CUDA tensors "
            "go over NCCL; for CPU tensors, %dist restart --backend gloo"
        )
    else:
        note(f"init_process_group({want or ''!r}): kept the cluster's group ({where})")
    return None


def _destroy_process_group(group: Any = None) -> None:
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

    if group is None or group is dist.group.WORLD:
        if dist.is_initialized():
            note(
                "destroy_process_group(): the cluster's group stays, for the next cells "
                "(%dist stop ends it)"
            )
        return
    _ORIG["destroy"](group)


class _Finished:
    """What ``spawn(..., join=False)`` returns once the function has run on this rank."""

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        return True

    def pids(self) -> list[int]:
        return []


def _spawn(
    fn: Any,
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> Any:
    p = _PLACE
    assert p is not None
    if int(nprocs) != p.local_size:
        raise ValueError(
            f"torch.multiprocessing.spawn(nprocs={nprocs}) on rank {p.rank}: this cell "
            f"already runs on every rank, {p.local_size} on this host ({p.size} in all), and "
            f"hvdnb starts no processes inside a rank. Call spawn(fn, args, nprocs="
            f"{p.local_size}) to run fn once per rank, or call "
            f"fn(int(os.environ['LOCAL_RANK']), ...) yourself; for {nprocs} ranks, "
            f"%dist restart -n {nprocs}"
        )
    note(f"torch.multiprocessing.spawn: fn runs once on each of the {p.size} ranks, no fork")
    fn(p.local_rank, *args)
    return None if join else _Finished()


def move(p: Place) -> None:
    """The rank's place changed (an elastic cluster's new generation)."""
    global _PLACE
    if _PLACE is not None:
        _PLACE = p
