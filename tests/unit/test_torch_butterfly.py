"""The butterfly of hvdnb.torch (rounds of more than two ranks) without processes.

Each rank is a thread with its own ``Butterfly`` over an in-memory communicator that
delivers point-to-point messages as MPI would (a persistent send copies its buffer at
``Start``, a receive waits for the next message from its source). Checked for 3 to 9
ranks: the schedule pairs ranks symmetrically, a reduction gives the same bits on every
rank, and whatever mix of signatures the ranks send, every rank reaches the same verdict
(and a failed one leaves the output untouched).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hvdnb.torch.butterfly import CHECK, DATA, Butterfly, signature

HDR = 128
BODY = 4096


class _MPI:
    BYTE = "byte"


class _Req:
    def __init__(self, net: _Net, me: int, peer: int, buf: np.ndarray, send: bool) -> None:
        self.net, self.me, self.peer, self.buf, self.send = net, me, peer, buf, send

    def Start(self) -> None:
        if self.send:
            self.net.box[(self.me, self.peer)].put(self.buf.tobytes())

    def Wait(self) -> None:
        if not self.send:
            data = self.net.box[(self.peer, self.me)].get(timeout=10)
            assert len(data) <= self.buf.nbytes, "a message larger than the receive buffer"
            self.buf[: len(data)] = np.frombuffer(data, np.uint8)

    def Free(self) -> None:
        pass


class _Net:
    def __init__(self, n: int) -> None:
        self.n = n
        self.box = {(a, b): queue.Queue() for a in range(n) for b in range(n)}
        self.gathered: list[bytes] = [b""] * n
        self.barrier = threading.Barrier(n)


class _Comm:
    def __init__(self, net: _Net, rank: int) -> None:
        self.net, self.rank = net, rank

    def Get_size(self) -> int:
        return self.net.n

    def Get_rank(self) -> int:
        return self.rank

    def Recv_init(self, spec: list[Any], src: int, tag: int) -> _Req:
        return _Req(self.net, self.rank, src, spec[0], send=False)

    def Send_init(self, spec: list[Any], dst: int, tag: int) -> _Req:
        return _Req(self.net, self.rank, dst, spec[0], send=True)

    def Allgather(self, send: list[Any], recv: list[Any]) -> None:
        self.net.gathered[self.rank] = send[0].tobytes()
        self.net.barrier.wait()
        recv[0][:] = np.frombuffer(b"".join(self.net.gathered), np.uint8)
        self.net.barrier.wait()


def _run(n: int, body: Callable[[int, Butterfly], Any]) -> list[Any]:
    """``body(rank, butterfly)`` on n threads at once; their results by rank."""
    net = _Net(n)
    flies = [Butterfly(_Comm(net, r), _MPI, BODY, HDR, 17) for r in range(n)]
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def go(r: int) -> None:
        try:
            out[r] = body(r, flies[r])
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert all(not q.qsize() for q in net.box.values()), "a message nobody received"
    return out


def _hdr(word: int) -> bytes:
    return word.to_bytes(8, "little") * (HDR // 8)


@pytest.mark.parametrize("n", range(3, 10))
def test_schedule_pairs_ranks_symmetrically(n: int) -> None:
    flies = _run(n, lambda r, bf: bf)
    for r, bf in enumerate(flies):
        for i, q in enumerate(bf.partners):
            assert flies[q].partners[i] == r  # step i: r and q swap with each other
        if bf.fold >= 0:
            assert flies[bf.fold].fold == r
        # every rank either swaps every step or hands over to a partner that does
        assert bf.partners or flies[bf.fold].partners


@pytest.mark.parametrize("n", range(3, 10))
def test_reduce_gives_every_rank_the_same_sum(n: int) -> None:
    def body(r: int, bf: Butterfly) -> tuple[bool, np.ndarray]:
        x = np.random.default_rng(r).standard_normal(1000).astype(np.float32)
        out = np.empty_like(x)
        w, rv = bf.views(x.dtype, x.size)
        sig = signature(_hdr(7), DATA)
        ok = bf.reduce(sig, x, out, np.add, bf.sends(x.nbytes), w, rv)
        return ok, out

    res = _run(n, body)
    want = sum(np.random.default_rng(r).standard_normal(1000).astype(np.float64) for r in range(n))
    assert all(ok for ok, _ in res)
    assert all(np.array_equal(out, res[0][1]) for _, out in res), "ranks got different bits"
    assert np.allclose(res[0][1], want, atol=1e-4)


@pytest.mark.parametrize("n", range(3, 9))
def test_every_mix_of_signatures_gets_one_verdict(n: int) -> None:
    """Two signatures over n ranks, every assignment (rank 0's fixed): all agree or all
    fail, and a failed in-place reduction leaves the tensor as it was."""
    for pattern in itertools.product((0, 1), repeat=n - 1):
        sigs = (0, *pattern)

        def body(r: int, bf: Butterfly, sigs: tuple[int, ...] = sigs) -> tuple[bool, bool]:
            x = np.full(16, float(r + 1))
            w, rv = bf.views(x.dtype, x.size)
            ok = bf.reduce(signature(_hdr(sigs[r]), DATA), x, x, np.add, bf.sends(x.nbytes), w, rv)
            total = n * (n + 1) / 2
            return ok, bool(np.all(x == (total if ok else r + 1)))

        res = _run(n, body)
        assert {ok for ok, _ in res} == {len(set(sigs)) == 1}, sigs
        assert all(right for _, right in res), sigs


@pytest.mark.parametrize("n", [3, 4, 5])
def test_gather_check_and_data_meet(n: int) -> None:
    """Headers gather when every rank gathers; any rank sending data or a check instead
    makes every rank fall back to the plain Allgather of headers."""
    hdrs = [_hdr(100 + r) for r in range(n)]
    got = _run(n, lambda r, bf: bf.gather(hdrs[r]))
    assert got == [hdrs] * n

    def mixed(r: int, bf: Butterfly) -> list[bytes]:
        if r == n - 1:
            x = np.ones(8)
            w, rv = bf.views(x.dtype, x.size)
            ok = bf.reduce(signature(hdrs[r], DATA), x, x, np.add, bf.sends(64), w, rv)
            assert not ok
        elif r == 1:
            assert not bf.check(signature(hdrs[r], CHECK))
        else:
            assert bf.gather(hdrs[r]) is None
        return bf.fallback(hdrs[r])

    assert _run(n, mixed) == [hdrs] * n
    assert _run(n, lambda r, bf: bf.check(signature(hdrs[0], CHECK))) == [True] * n


def test_butterfly_data_limit_follows_the_hosts_load():
    """Auto (-1): 4 KB with a core per local rank, 64 KB where local ranks outnumber the
    cores (the measured crossovers); a configured value is kept as it is."""
    from types import SimpleNamespace

    from hvdnb.host import cores as host_cores
    from hvdnb.torch.basics import butterfly_bytes

    cores = host_cores()  # the cores this rank may use (issue 32: host's, not os.cpu_count)
    assert butterfly_bytes(-1, SimpleNamespace(local_size=cores)) == 4096
    assert butterfly_bytes(-1, SimpleNamespace(local_size=cores + 1)) == 65536
    assert butterfly_bytes(8192, SimpleNamespace(local_size=cores + 1)) == 8192
    assert butterfly_bytes(0, SimpleNamespace(local_size=1)) == 0
