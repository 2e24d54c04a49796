"""Wire level of hvdnb.torch: headers, negotiation and the two transports.

Owns: the fixed 128-byte header every collective sends before (or with) its data, the
header exchange, the count of negotiated calls (``negotiated_calls``, the stall detector's
progress counter, registered with ``hvdnb.rank.hooks.count_negotiated``), and the
per-process-set transports: ``MPITransport`` (mpi4py over a private communicator, CPU
tensors, zero-copy through numpy views) and ``TorchTransport`` (torch.distributed: NCCL for
CUDA tensors, gloo without MPI). Never: decide Horovod semantics (scaling, averaging,
names), allocate per call what can be cached, or issue a collective outside the SPMD order
of the caller.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any, ClassVar

import numpy as np
import torch

from hvdnb.rank import hooks
from hvdnb.torch.butterfly import DATA, Butterfly, signature
from hvdnb.torch.timing import GlooClock

__all__ = [
    "CALLS",
    "HDR",
    "HDR_BYTES",
    "SIG_BYTES",
    "TAG",
    "UFUNCS",
    "Kind",
    "MPITransport",
    "TorchTransport",
    "negotiated_calls",
]

#: 12 signature words (must be equal on every rank) + 4 per-rank words
HDR = struct.Struct("<16q")
HDR_BYTES = HDR.size
#: collectives negotiated by this process so far: the stall detector reads it (from another
#: thread) as evidence that a rank is still making progress
CALLS = [0]
SIG_BYTES = 12 * 8
TAG = 17
#: numpy reductions by op code (Average sums; callers divide)
UFUNCS = {0: np.add, 1: np.add, 3: np.minimum, 4: np.maximum, 5: np.multiply}
#: what MPITransport may move over gloo instead (types gloo reduces; op codes as above)
_GLOO = frozenset(
    (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int8, torch.uint8)
)


def negotiated_calls() -> int:
    """How many collectives this process has negotiated so far (``CALLS``); safe to call
    from any thread (the stall detector's progress counter)."""
    return CALLS[0]


hooks.count_negotiated(negotiated_calls)  # the rank's stall report reads it from there


class Kind:
    """Collective kinds as they appear in headers and messages."""

    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    ALLTOALL = 4
    REDUCESCATTER = 5
    BARRIER = 6
    JOIN = 7
    #: a rank with queued async ops (or several ops to settle) asks for a full round
    ROUND = 8
    NAMES: ClassVar[dict[int, str]] = {
        1: "allreduce",
        2: "allgather",
        3: "broadcast",
        4: "alltoall",
        5: "reducescatter",
        6: "barrier",
        7: "join",
        8: "round",
    }


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory, detached first when it requires grad."""
    return (t.detach() if t.requires_grad else t).numpy()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a flat uint8 tensor, for the byte-moving collectives.

    An empty tensor may carry any stride (numpy gives a zero-size array stride 0), which
    ``view(torch.uint8)`` refuses: it gets a fresh empty byte tensor, so a rank with
    nothing to send still enters the collective its peers have entered. A tensor that
    requires grad (a parameter) is detached first: numpy refuses it otherwise.
    """
    flat = (t.detach() if t.requires_grad else t).reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)


class MPITransport:
    """mpi4py on a private duplicate communicator of the process set's members.

    With exactly two ranks, negotiation is one ``Sendrecv`` with the peer into a fixed
    staging buffer: a message is never larger than the buffer, so ranks that disagree on
    sizes still receive each other's header and both see the mismatch. Small allreduces
    ride in the same message (header + data), which beats MPI_Allreduce here. With more,
    the same idea on a butterfly of point-to-point messages (``butterfly.py``): headers
    are gathered on it, and small allreduces are reduced on it with a check prefix in
    each message instead of a header round.
    """

    backend = "mpi"

    def __init__(self, comm: Any, inline_bytes: int) -> None:
        from mpi4py import MPI  # noqa: PLC0415  mpi4py initialises MPI on import: only where MPI is used

        self.MPI = MPI
        self.comm = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.peer = 1 - self.rank if self.size == 2 else -1
        #: allreduces up to this many bytes travel with their check (no header round)
        self.inline = inline_bytes if self.size >= 2 else 0
        cap = HDR_BYTES + (self.inline if self.size == 2 else 0)
        self.sbuf = np.zeros(cap, np.uint8)
        self.rbuf = np.zeros(cap, np.uint8)
        self.smv = self.sbuf.data  # memoryview(ndarray), spelled so numpy's stubs accept it
        self.rmv = self.rbuf.data
        self.rspec = [self.rbuf, MPI.BYTE]
        self._sspecs: dict[int, list[Any]] = {}
        self.saddr = self.sbuf.ctypes.data
        self.rbuf_t = torch.from_numpy(self.rbuf)
        self.status = MPI.Status()
        self._views: dict[tuple[torch.dtype, torch.Size], torch.Tensor] = {}
        self.ops = {1: MPI.SUM, 3: MPI.MIN, 4: MPI.MAX, 5: MPI.PROD, 0: MPI.SUM}
        #: async ops submitted on this rank, not yet negotiated (see rounds.py)
        self.pending: list[Any] = []
        #: more than two ranks: every round's first step (butterfly.py)
        self.bfly = Butterfly(comm, MPI, self.inline, HDR_BYTES, TAG) if self.size > 2 else None
        #: a set across hosts (``build_transports``): allreduces of at least ``gloo_bytes``
        #: move their data over this gloo group (``hvdnb.torch.basics.gloo_bytes`` says why)
        self.gloo_group: Any = None
        self.gloo_bytes = 0
        self.gloo_ops: dict[int, Any] = {}
        self.clock = GlooClock()  # the listeners' timing of those gloo works

    def use_gloo(self, group: Any, nbytes: int) -> None:
        """Move allreduces of at least ``nbytes`` over ``group`` (gloo, the set's ranks)."""
        import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

        R = dist.ReduceOp
        self.gloo_ops = {0: R.SUM, 1: R.SUM, 3: R.MIN, 4: R.MAX, 5: R.PRODUCT}
        self.gloo_group, self.gloo_bytes = group, nbytes

    def free(self) -> None:
        """Free this transport's persistent requests and communicator (collective)."""
        if self.bfly is not None:
            self.bfly.free()
        self.comm.Free()

    # -- negotiation -------------------------------------------------------------------
    def exchange(self, hdr: bytes, payload: torch.Tensor | None = None) -> list[bytes]:
        """Every rank's header, by rank; with 2 ranks the peer's payload stays in rbuf."""
        CALLS[0] += 1
        if self.size == 1:
            return [hdr]
        if self.size == 2:
            n = HDR_BYTES
            self.sbuf.data.cast("B")[:HDR_BYTES] = hdr
            if payload is not None:
                nb = payload.numel() * payload.element_size()
                ctypes.memmove(self.saddr + HDR_BYTES, payload.data_ptr(), nb)
                n += nb
            self.comm.Sendrecv(
                [self.sbuf[:n], self.MPI.BYTE],
                self.peer,
                TAG,
                [self.rbuf, self.MPI.BYTE],
                self.peer,
                TAG,
                self.status,
            )
            peer = self.rbuf[:HDR_BYTES].tobytes()
            return [hdr, peer] if self.rank == 0 else [peer, hdr]
        bf = self.bfly
        assert bf is not None
        hdrs = bf.gather(hdr)
        return hdrs if hdrs is not None else bf.fallback(hdr)

    def exchange_inline(self, hdr: bytes, payload: torch.Tensor, nbytes: int) -> bool:
        """Two ranks: swap header + payload with the peer; True when signatures match.

        The hot path of small allreduces: one ``Sendrecv``, no allocation.
        """
        CALLS[0] += 1
        self.smv[:HDR_BYTES] = hdr
        ctypes.memmove(self.saddr + HDR_BYTES, payload.data_ptr(), nbytes)
        spec = self._sspecs.get(nbytes)
        if spec is None:
            spec = self._sspecs[nbytes] = [self.sbuf[: HDR_BYTES + nbytes], self.MPI.BYTE]
        self.comm.Sendrecv(spec, self.peer, TAG, self.rspec, self.peer, TAG)
        return self.rmv[:SIG_BYTES] == self.smv[:SIG_BYTES]

    def reduce_inline(
        self, hdr: bytes, x: torch.Tensor, out: torch.Tensor, op: int
    ) -> list[bytes] | None:
        """More than two ranks: allreduce small ``x`` into ``out`` (may be ``x``) in one
        butterfly round checked by ``hdr``'s signature; None when done, else every rank's
        header (signatures differed; ``out`` is untouched)."""
        CALLS[0] += 1
        bf = self.bfly
        assert bf is not None
        xa = (x.detach() if x.requires_grad else x).numpy().reshape(-1)
        oa = (out.detach() if out.requires_grad else out).numpy().reshape(-1)
        w, rv = bf.views(xa.dtype, xa.size)
        s = bf.sends(xa.nbytes)
        if bf.reduce(signature(hdr, DATA), xa, oa, UFUNCS[op], s, w, rv):
            return None
        return bf.fallback(hdr)

    def peer_view(self, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """The peer's inline payload (received by ``exchange``) as a tensor, no copy."""
        key = (dtype, shape)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 256:
                self._views.clear()
            n = shape.numel() * torch.empty((), dtype=dtype).element_size()
            v = self.rbuf_t[HDR_BYTES : HDR_BYTES + n].view(dtype).view(shape)
            self._views[key] = v
        return v

    def gather_objects(self, obj: Any) -> list[Any]:
        """Pickled allgather: only for slow paths (error reports, object helpers)."""
        out: list[Any] = self.comm.allgather(obj)
        return out

    # -- data ----------------------------------------------------------------------------
    @staticmethod
    def np(t: torch.Tensor) -> np.ndarray:
        """A numpy view of a contiguous CPU tensor (half types must be converted first)."""
        return _np(t)

    def via_gloo(self, nbytes: int, dtype: torch.dtype) -> bool:
        """Whether an allreduce of ``nbytes`` of ``dtype`` goes over the gloo group: the
        same answer on every rank of the set (sizes and limits agree, or the round failed)."""
        return self.gloo_group is not None and nbytes >= self.gloo_bytes and dtype in _GLOO

    def data_backend(self, nbytes: int, dtype: torch.dtype) -> str:
        """What an allreduce of this size moves its data over: "gloo" or "mpi"."""
        return "gloo" if self.via_gloo(nbytes, dtype) else "mpi"

    def allreduce(self, send: torch.Tensor, out: torch.Tensor, op: int, nonblocking: bool) -> Any:
        big = self.gloo_group is not None
        if big and self.via_gloo(out.numel() * out.element_size(), out.dtype):
            import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

            res = out.detach()  # a parameter's in-place reduction, as MPI's numpy view does
            if send is not out:
                res.copy_(send.detach())
            work = dist.all_reduce(res, op=self.gloo_ops[op], group=self.gloo_group, async_op=True)
            if nonblocking:
                return work
            work.wait()
            return None
        MPI = self.MPI
        # a parameter (requires grad) is detached: at 1 rank, where no inline round takes
        # small tensors, hvd.allreduce_async(param) raised numpy's "requires grad" error
        sbuf = MPI.IN_PLACE if send is out else _np(send)
        # always the nonblocking call: MPI never matches a blocking collective with a
        # nonblocking one, and Horovod lets one rank use allreduce_async where another
        # uses allreduce for the same tensor
        req = self.comm.Iallreduce(sbuf, _np(out), self.ops[op])
        if nonblocking:
            return req
        req.Wait()
        return None

    def allgatherv(self, send: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        MPI = self.MPI
        s = _bytes(send).numpy()
        r = _bytes(out).numpy()
        displs = np.cumsum([0, *counts[:-1]]).tolist()
        self.comm.Allgatherv([s, MPI.BYTE], [r, (counts, displs), MPI.BYTE])

    def bcast(self, t: torch.Tensor, root: int) -> None:
        self.comm.Bcast([_bytes(t).numpy(), self.MPI.BYTE], root=root)

    def alltoallv(
        self, send: torch.Tensor, scounts: list[int], out: torch.Tensor, rcounts: list[int]
    ) -> None:
        MPI = self.MPI
        sd = np.cumsum([0, *scounts[:-1]]).tolist()
        rd = np.cumsum([0, *rcounts[:-1]]).tolist()
        s = _bytes(send).numpy()
        r = _bytes(out).numpy()
        self.comm.Alltoallv([s, (scounts, sd), MPI.BYTE], [r, (rcounts, rd), MPI.BYTE])

    def alltoall_counts(self, counts: list[int]) -> list[int]:
        return list(self.comm.alltoall(counts))

    def barrier(self) -> None:
        self.comm.Barrier()


class TorchTransport:
    """torch.distributed on the process set's group: NCCL for CUDA tensors, gloo otherwise.

    Headers travel over ``ctrl`` (a gloo group when the data group is NCCL, so negotiation
    never touches the GPU stream), or over MPI when the job has it.
    """

    def __init__(self, group: Any, ranks: list[int], ctrl: Any, mpi: MPITransport | None) -> None:
        import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

        self.dist = dist
        self.group = group
        self.ranks = ranks
        self.ctrl = ctrl
        self.mpi = mpi
        self.size = len(ranks)
        self.rank = ranks.index(dist.get_rank()) if dist.get_rank() in ranks else -1
        self.backend = str(dist.get_backend(group))
        R = dist.ReduceOp
        self.ops = {0: R.SUM, 1: R.SUM, 3: R.MIN, 4: R.MAX, 5: R.PRODUCT}
        # headers over MPI: one queue of async ops for both transports (one round order)
        self.pending: list[Any] = mpi.pending if mpi is not None else []
        self.clock = GlooClock()

    def exchange(self, hdr: bytes) -> list[bytes]:
        if self.mpi is not None:
            return self.mpi.exchange(hdr)
        if self.size == 1:
            return [hdr]
        mine = torch.frombuffer(bytearray(hdr), dtype=torch.uint8)
        outs = [torch.empty_like(mine) for _ in range(self.size)]
        self.dist.all_gather(outs, mine, group=self.ctrl)
        return [bytes(o.numpy().tobytes()) for o in outs]

    def gather_objects(self, obj: Any) -> list[Any]:
        if self.mpi is not None:
            return self.mpi.gather_objects(obj)
        out: list[Any] = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def allreduce(self, send: torch.Tensor, out: torch.Tensor, op: int, nonblocking: bool) -> Any:
        if send is not out:
            out.copy_(send)
        work = self.dist.all_reduce(out, op=self.ops[op], group=self.group, async_op=nonblocking)
        return work if nonblocking else None

    def allgatherv(self, send: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        # gloo refuses unequal sizes: pad every rank's bytes to the largest, then trim
        m = max(counts)
        s = _bytes(send)
        pad = torch.zeros(m, dtype=torch.uint8, device=send.device)
        pad[: s.numel()] = s
        parts = [torch.empty_like(pad) for _ in counts]
        self.dist.all_gather(parts, pad, group=self.group)
        torch.cat([p[:c] for p, c in zip(parts, counts)], out=_bytes(out))

    def bcast(self, t: torch.Tensor, root: int) -> None:
        b = _bytes(t)
        self.dist.broadcast(b, src=self.ranks[root], group=self.group)
        if b.data_ptr() != t.data_ptr():  # pragma: no cover - views share storage
            t.copy_(b.view(t.dtype).view(t.shape))

    def alltoallv(
        self, send: torch.Tensor, scounts: list[int], out: torch.Tensor, rcounts: list[int]
    ) -> None:
        s = _bytes(send)
        r = _bytes(out)
        self.dist.all_to_all_single(r, s, rcounts, scounts, group=self.group)

    def alltoall_counts(self, counts: list[int]) -> list[int]:
        return [row[self.rank] for row in self.gather_objects(counts)]

    def barrier(self) -> None:
        self.dist.barrier(group=self.ctrl if self.ctrl is not None else self.group)
