"""Rounds of more than two ranks over MPI point-to-point: the butterfly every call starts with.

Owns: the schedule of a process set of n > 2 ranks (recursive doubling over the largest
power of two; each extra rank first hands its message to a partner and gets the result
back last), the same steps for every call whatever it carries, so ranks that called
different things still meet, never wait for a message that does not come, and never
receive one larger than their buffer; the 16-byte check prefix every message starts with
(the sender's signature word and a flag: some rank on the way saw another signature); and
what a round carries: every rank's header (``gather``), the data of a small allreduce,
reduced on the way (``reduce``: no header round), or the prefix alone (``check``, before a
large MPI allreduce). Every rank reaches the same verdict (the flag is set on every rank
or on none): the signatures agreed, or they did not and every rank gathers the plain
headers with one ``MPI_Allgather`` (``fallback``) for the caller to settle.

Never: know Horovod semantics (headers are opaque bytes here, reductions numpy ufuncs),
write a caller's output before the verdict (a mismatch leaves in-place tensors untouched),
or free a request a plan still holds (``make_sends`` hands ownership to the caller).
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["CHECK", "DATA", "PRE", "Butterfly", "free_all", "signature"]

#: bytes of the check prefix: int64 words [signature, flag] (see ``Butterfly.reduce``)
PRE = 16
#: signature modes (a gather sends 0, which no signature equals)
DATA, CHECK = 1, 2
_SIGW = struct.Struct("<12q")
_MASK = (1 << 62) - 1
_PLAIN, _SENDER, _RECEIVER = 0, 1, 2
# reductions over another call's bytes (a mismatch, discarded) or over sums that overflow
# (silent in MPI, NCCL and Horovod too) must not warn
warnings.filterwarnings("ignore", r"(overflow|invalid value) encountered", RuntimeWarning, __name__)


def signature(hdr: bytes, mode: int) -> int:
    """The check word of a header's 12 signature words in ``mode``: 62 bits, never 0.

    Equal on every rank for equal signatures: tuples of ints hash without a per-process salt.
    """
    return (hash((mode, *_SIGW.unpack_from(hdr))) & _MASK) | 1


class Butterfly:
    """The butterfly of one communicator of n > 2 ranks: buffers, schedule, receives.

    ``sbuf`` holds this rank's running message (prefix + body), ``rbuf`` the last one
    received; both hold the largest message any call sends (a small allreduce's data or
    every rank's header), so a rank that called something else is still received whole.
    """

    def __init__(self, comm: Any, MPI: Any, body_bytes: int, hdr_bytes: int, tag: int) -> None:
        self.MPI, self.comm, self.tag, self.hdr_bytes = MPI, comm, tag, hdr_bytes
        n = self.size = comm.Get_size()
        r = self.rank = comm.Get_rank()
        p = 1 << (n.bit_length() - 1)
        extra = n - p
        new = r - extra
        self.role, self.fold = _PLAIN, -1
        if r < 2 * extra:  # pairs (0, 1), (2, 3) ...: the even rank hands over to the odd one
            self.role = _SENDER if r % 2 == 0 else _RECEIVER
            self.fold = r + 1 if r % 2 == 0 else r - 1
            new = -1 if r % 2 == 0 else r // 2
        self.partners: list[int] = []
        mask = 1
        while new >= 0 and mask < p:
            q = new ^ mask
            self.partners.append(q * 2 + 1 if q < extra else q + extra)
            mask <<= 1
        self.gather_bytes = n * hdr_bytes
        cap = PRE + max(body_bytes, self.gather_bytes)
        self.sbuf = np.zeros(cap, np.uint8)
        self.rbuf = np.zeros(cap, np.uint8)
        self.smv = self.sbuf.data
        #: the prefix words of sbuf and rbuf as Python ints: [signature, flag]
        self.sq = self.smv[:PRE].cast("q")
        self.rq = self.rbuf.data[:PRE].cast("q")
        self._sends: dict[int, list[Any]] = {}
        self._views: dict[tuple[Any, int], tuple[np.ndarray, np.ndarray]] = {}
        rspec = [self.rbuf, MPI.BYTE]
        self.rreqs = [comm.Recv_init(rspec, q, tag) for q in self.partners]
        self.frreq: Any = comm.Recv_init(rspec, self.fold, tag) if self.fold >= 0 else None
        self.gmsg = self.sbuf[: PRE + self.gather_bytes]
        self.gw, self.grw = self.views(np.dtype(np.uint64), self.gather_bytes // 8)
        self.gsends = self.make_sends(self.gather_bytes)
        self.csends = self.make_sends(0)
        self.empty = np.zeros(0, np.uint64)
        self.allh = np.zeros(self.gather_bytes, np.uint8)

    # -- building blocks -----------------------------------------------------------------
    def make_sends(self, nbytes: int) -> list[Any]:
        """Persistent sends of ``sbuf[:PRE + nbytes]``: one per swap, then the fold's.

        The caller owns them (``free_all``); ``sends`` keeps a bounded cache of its own.
        """
        spec = [self.sbuf[: PRE + nbytes], self.MPI.BYTE]
        dests = self.partners + ([self.fold] if self.fold >= 0 else [])
        return [self.comm.Send_init(spec, q, self.tag) for q in dests]

    def sends(self, nbytes: int) -> list[Any]:
        """``make_sends(nbytes)``, cached here (the general path's sizes)."""
        s = self._sends.get(nbytes)
        if s is None:
            if len(self._sends) >= 64:
                for old in self._sends.values():
                    free_all(old)
                self._sends.clear()
            s = self._sends[nbytes] = self.make_sends(nbytes)
        return s

    def views(self, dtype: Any, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The bodies of ``sbuf`` and ``rbuf`` as ``count`` elements of ``dtype``."""
        key = (dtype, count)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 256:
                self._views.clear()
            nb = count * np.dtype(dtype).itemsize
            v = self._views[key] = (
                self.sbuf[PRE : PRE + nb].view(dtype),
                self.rbuf[PRE : PRE + nb].view(dtype),
            )
        return v

    def free(self) -> None:
        """Free every request this object owns (before MPI finalizes; idempotent)."""
        reqs = [*self.rreqs, *self.gsends, *self.csends]
        if self.frreq is not None:
            reqs.append(self.frreq)
        for s in self._sends.values():
            reqs.extend(s)
        free_all(reqs)
        self.rreqs, self.gsends, self.csends, self.frreq = [], [], [], None
        self._sends.clear()

    # -- rounds ----------------------------------------------------------------------------
    def reduce(
        self,
        sig: int,
        x: np.ndarray,
        out: np.ndarray,
        ufunc: Callable[..., Any],
        sends: list[Any],
        w: np.ndarray,
        rv: np.ndarray,
    ) -> bool:
        """One round reducing ``x`` into ``out`` (either may be ``w``); True when every
        rank sent ``sig``.

        ``sends`` send ``sbuf``'s prefix and body (``make_sends`` of ``x.nbytes``); ``w`` /
        ``rv`` are the bodies of ``sbuf`` / ``rbuf`` as ``x``'s dtype and size (``views``).
        ``x`` is copied into ``sbuf`` first (measured: sending the tensor's own memory as
        an MPI struct type with the prefix saves 0.3 us at 4 KB, and costs 25 us at 64 KB
        on 4 ranks sharing 2 cores). On False, ``out`` is untouched and every rank must
        call ``fallback``.

        The prefix's flag: a rank sets it when a message's signature differs from its own
        or came flagged, and forwards its own signature. Every block of ranks that the
        butterfly has joined so far is either of one signature or flagged in every member
        (each member of one half meets one of the other), so at the end every rank is
        flagged or none is.
        """
        sq, rq = self.sq, self.rq
        if x is not w:
            np.copyto(w, x)
        sq[0] = sig
        sq[1] = 0
        role = self.role
        if role == _SENDER:
            fr, s = self.frreq, sends[0]
            fr.Start()
            s.Start()
            fr.Wait()
            s.Wait()
            if rq[1] or rq[0] != sig:
                return False
            np.copyto(out, rv)
            return True
        flag = 0
        if role == _RECEIVER:
            fr = self.frreq
            fr.Start()
            fr.Wait()
            if rq[1] or rq[0] != sig:
                flag = sq[1] = 1
            ufunc(w, rv, out=w)
        rreqs = self.rreqs
        last = len(rreqs) - 1
        for i in range(last + 1):
            rr, s = rreqs[i], sends[i]
            rr.Start()
            s.Start()
            rr.Wait()
            s.Wait()
            if rq[1] or rq[0] != sig:
                flag = sq[1] = 1
            if i < last:
                ufunc(w, rv, out=w)
            elif not flag:
                ufunc(w, rv, out=w if role == _RECEIVER else out)
        if role == _RECEIVER:
            s = sends[-1]
            s.Start()
            s.Wait()
            if not flag:
                np.copyto(out, w)
        return not flag

    def gather(self, hdr: bytes) -> list[bytes] | None:
        """Every rank's header, by rank; None when some rank sent data or a check instead
        (then every rank got None, and every rank must call ``fallback``)."""
        hb = self.hdr_bytes
        self.gmsg.fill(0)
        o = PRE + self.rank * hb
        self.smv[o : o + hb] = hdr
        gw = self.gw
        if not self.reduce(0, gw, gw, np.bitwise_or, self.gsends, gw, self.grw):
            return None
        raw = self.sbuf[PRE : PRE + self.gather_bytes].tobytes()
        return [raw[i * hb : (i + 1) * hb] for i in range(self.size)]

    def check(self, sig: int) -> bool:
        """A round of prefixes alone: whether every rank sent ``sig``."""
        e = self.empty
        return self.reduce(sig, e, e, np.bitwise_or, self.csends, e, e)

    def fallback(self, hdr: bytes) -> list[bytes]:
        """Every rank's header by one ``MPI_Allgather`` (every rank got the same verdict)."""
        MPI = self.MPI
        self.comm.Allgather([np.frombuffer(hdr, np.uint8), MPI.BYTE], [self.allh, MPI.BYTE])
        raw = self.allh.tobytes()
        hb = self.hdr_bytes
        return [raw[i * hb : (i + 1) * hb] for i in range(self.size)]


def free_all(reqs: list[Any]) -> None:
    """Free persistent requests (none once MPI is finalized: they went with it)."""
    try:
        from mpi4py import MPI  # noqa: PLC0415  mpi4py initialises MPI on import: only where MPI is used

        if MPI.Is_finalized():
            return
        for q in reqs:
            q.Free()
    except Exception:  # interpreter teardown: MPI may be gone
        pass
