"""What a collective call is made of before it is negotiated: op codes, dtype codes, names,
the transport that carries a tensor, and the description a mismatch error shows.

Owns: Horovod's op constants (``Average`` ... ``Product``) and their names, the dtype codes
and name hashes that go into headers, auto names (one counter per process set), the names
of a group's members, the choice of transport per tensor (CUDA: torch.distributed; CPU:
MPI under mpiexec, else gloo), and ``describe`` (the lazily built description of a call).
Never: communicate, or hold state beyond the name-hash cache.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch

from hvdnb.torch.process_sets import ProcessSet, check_registered
from hvdnb.torch.rounds import DTYPES, SERIAL
from hvdnb.torch.transport import HDR, Kind, MPITransport, TorchTransport

__all__ = [
    "DCODE",
    "OPNAMES",
    "Adasum",
    "Average",
    "Max",
    "Min",
    "Product",
    "Sum",
    "allreduce_header",
    "auto_name",
    "describe",
    "dtype_code",
    "grouped_names",
    "name_hash",
    "parameter_names",
    "transport_for",
]

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OPNAMES = {0: "Average", 1: "Sum", 2: "Adasum", 3: "Min", 4: "Max", 5: "Product"}
#: header code of each supported dtype (0: none)
DCODE = {d: i + 1 for i, d in enumerate(DTYPES)}
_NAMEHASH: dict[str, int] = {}


def name_hash(name: str) -> int:
    """The 64-bit header word of a name (crc32, cached)."""
    h = _NAMEHASH.get(name)
    if h is None:
        if len(_NAMEHASH) > 100_000:
            _NAMEHASH.clear()
        h = _NAMEHASH[name] = zlib.crc32(name.encode())
    return h


def auto_name(ps: ProcessSet, kind: int) -> str:
    """``<kind>.noname.<n>``: the name of an unnamed call, numbered per process set."""
    # one counter for every kind: a rank that called another kind by mistake stays in step
    with SERIAL:
        c = ps.counters.get(0, 0)
        ps.counters[0] = c + 1
        return f"{Kind.NAMES[kind]}.noname.{c}"


def dtype_code(t: torch.Tensor) -> int:
    """The header code of ``t``'s dtype; TypeError for an unsupported dtype."""
    code = DCODE.get(t.dtype)
    if code is None:
        raise TypeError(
            f"hvdnb.torch does not support dtype {t.dtype}; use one of "
            f"{', '.join(str(d) for d in DTYPES)}"
        )
    return code


def transport_for(ps: ProcessSet, t: torch.Tensor) -> Any:
    """The transport that carries ``t`` on ``ps``; ValueError on a non-member."""
    tr: MPITransport | TorchTransport | None
    if t.is_cuda or ps.mpi is None:
        tr = ps.torch
    else:
        tr = ps.mpi
    if tr is None:
        check_registered(ps)
        raise ValueError(
            f"this rank is not a member of {ps}; only its members may call its collectives"
        )
    return tr


def describe(kind: int, name: str, t: torch.Tensor, **kw: Any) -> Callable[[], dict[str, Any]]:
    """A call's description for mismatch errors, built only when one is raised."""

    def build() -> dict[str, Any]:
        d = {
            "collective": Kind.NAMES[kind],
            "name": name,
            "dtype": str(t.dtype),
            "shape": tuple(t.shape),
            "device": t.device.type,
        }
        d.update(kw)
        return d

    return build


def grouped_names(ps: ProcessSet, name: str | None, kind: int, n: int) -> list[str]:
    """The names of a group's ``n`` members: ``<name>.<i>`` (one auto name when None)."""
    base = name if name is not None else auto_name(ps, kind)
    return [f"{base}.{i}" for i in range(n)]


def parameter_names(param_groups: Any, named_parameters: Any) -> tuple[list[Any], list[str]]:
    """A wrapped optimizer's trainable parameters and the name each is reduced under: its
    name in ``named_parameters`` (Horovod's argument), else ``param.<i>``. Raises
    ValueError on duplicate names or parameters missing from ``named_parameters``."""
    params = [p for g in param_groups for p in g["params"] if p.requires_grad]
    names: dict[torch.Tensor, str] = {}
    if named_parameters is not None:
        named = list(named_parameters)
        dup = {n for n, _ in named if sum(1 for m, _ in named if m == n) > 1}
        if dup:
            raise ValueError(f"named_parameters has duplicate names: {sorted(dup)}")
        names = {p: n for n, p in named}
        missing = [i for i, p in enumerate(params) if p not in names]
        if missing:
            raise ValueError(
                f"{len(missing)} optimizer parameters are missing from named_parameters; "
                "pass model.named_parameters() of the model the optimizer was built on"
            )
    return params, [names.get(p, f"param.{i}") for i, p in enumerate(params)]


def allreduce_header(
    name: str,
    dcode: int,
    op: int,
    shape_key: int,
    numel: int,
    pre: float,
    post: float,
    nbytes: int,
    blocking: int = 0,
) -> bytes:
    """An allreduce's header, the one thing every path sends (or hashes) for it: the general
    path (``reduce.py``) and the plans over MPI and torch.distributed (``plans.py``,
    ``torchplans.py``), so that ranks on different paths still match. ``blocking`` sits
    outside the signature (see ``plans._run_big``)."""
    return HDR.pack(
        Kind.ALLREDUCE,
        name_hash(name),
        dcode,
        op,
        0,
        shape_key,
        numel,
        hash(pre),
        hash(post),
        0,
        0,
        0,
        0,
        nbytes,
        blocking,
        0,
    )
