"""Elastic training on a rank: Horovod's elastic loop, its states, and the new generation
of the process group after a rank leaves.

Horovod's semantics (``horovod/common/elastic.py``), in hvdnb's words:

- ``run_fn(func, reset)`` wraps a training function ``func(state, ...)``: sync the state
  (rank 0's values to every rank), then call ``func``. When a collective fails
  (``HorovodInternalError``) the state is restored to its last commit; when the cluster's
  membership changed (``HostsUpdatedInterrupt``, raised at a commit) nothing is restored.
  Either way ``reset()`` forms the new process group and the state's reset callbacks
  run, then the loop syncs and calls ``func`` again.
- ``State.commit()`` saves the state in memory, then checks for membership changes: rank
  0's view of them is broadcast, so every rank raises ``HostsUpdatedInterrupt`` at the
  same commit.

hvdnb's part is the membership. In an elastic cluster (``%dist start --min-np M``,
``HVDNB_ELASTIC=1``) each rank is a slot (``HVDNB_SLOT``, its ipyparallel engine id, fixed
for its life) and every generation of the process group is a list of slots, decided by
the notebook: when a rank dies or leaves, the notebook sends every survivor an
``elastic_reset`` message with the next generation and its members. ``reset()`` waits
for that message, takes the rank the slot has in it, and re-forms the default group under
the generation's own store prefix (``rendezvous.rejoin``). Outside an elastic cluster
nobody re-forms the group: a failed collective ends the loop with an error saying so.

A rank whose own code raises (anything but the two signals above) leaves the cluster: it
releases its peers at once (their collectives fail, they reset) and tells the notebook,
which takes it out of the next generation.

Never: decide membership (the notebook does), or issue a collective outside ``sync`` (and
``_align_step`` just before it) and ``check_host_updates``.
"""

from __future__ import annotations

import functools
import gc
import os
import queue
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from hvdnb.config import get_config
from hvdnb.protocol import kinds

__all__ = [
    "HorovodInternalError",
    "HostCheck",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "RankRemoved",
    "State",
    "after_reset",
    "cut_peer_links",
    "enabled",
    "in_loop",
    "is_internal",
    "listen",
    "reform",
    "run_fn",
    "slot",
    "wait_for_generation",
]

F = TypeVar("F", bound=Callable[..., Any])


class HorovodInternalError(RuntimeError):
    """A collective failed because a rank of the job failed (Horovod's name). Inside
    ``hvd.elastic.run`` the state is restored and the group re-formed without that rank."""


class HostsUpdatedInterrupt(RuntimeError):
    """The cluster's membership changed (a rank was lost, or ``%dist scale`` added some):
    raised on every rank at the same ``commit()``. ``skip_sync``: the survivors' states are
    the same already (ranks were only removed)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the cluster's ranks changed")
        self.skip_sync = skip_sync


class RankRemoved(SystemExit):
    """This rank is not in the cluster's new generation: it leaves the training loop."""


# ---------------------------------------------------------------------- membership
class _Notices:
    """The newest ``elastic_reset`` the notebook sent this rank, and who waits for it."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.latest: dict[str, Any] | None = None
        self.states: weakref.WeakSet[State] = weakref.WeakSet()

    def on_reset(self, msg: dict[str, Any]) -> None:
        # the states hear of it first: a survivor woken below resets its state, and a
        # message queued after that reset would interrupt its next commit for nothing
        stamp = float(msg.get("t", time.time()))
        removed = bool(msg.get("removed", True))
        for st in list(self.states):
            st.on_hosts_updated(stamp, removed)
        with self.cond:
            if self.latest is None or msg["generation"] > self.latest["generation"]:
                self.latest = dict(msg)
            self.cond.notify_all()
        if removed and enabled() and not _REFORMING[0]:
            _release_now(
                int(msg["generation"]),
                [int(p) for p in msg.get("pids") or ()],
                [str(h) for h in msg.get("lost_hosts") or ()],
            )


def _release_now(generation: int, pids: list[int], hosts: Sequence[str] = ()) -> None:
    """A rank was lost and this one is not re-forming yet: abort the group from the side
    channel's thread. A collective this rank is blocked in then fails at once, even one
    that waits on a survivor (gloo releases the peers of a dead rank, and of a rank that
    aborted, but not a rank two hops away: at 4 ranks one survivor waited out the
    collective timeout with an allreduce in flight). Outside an elastic loop the cell then
    fails, as a death fails it on a fixed-size cluster."""
    from hvdnb.rank import rendezvous  # noqa: PLC0415  rendezvous imports torch's hooks: only when a rank was lost

    if generation > rendezvous.generation():
        rendezvous.release_group()
        cut_peer_links(pids, hosts)


_NOTICES = _Notices()
_REFORMING = [False]  # reform() runs: the training thread lets the group go itself
_AFTER_RESET: list[Callable[[], None]] = []
_BEFORE_RESET: list[Callable[[], None]] = []
_LOOPS = [0]  # elastic loops running on this rank (nested: the outer one resets)


def in_loop() -> bool:
    """Is an elastic loop (``run_fn``'s) running on this rank?"""
    return _LOOPS[0] > 0


def enabled() -> bool:
    """Is this rank part of an elastic cluster (its group can be re-formed)?"""
    return os.environ.get("HVDNB_ELASTIC") == "1"


def slot() -> int:
    """This rank's slot: its number in the first generation, kept for its life."""
    return int(os.environ.get("HVDNB_SLOT", os.environ.get("RANK", "0")))


def listen(ch: Any) -> None:
    """Take the notebook's ``elastic_reset`` messages from the side channel ``ch``."""
    ch.on(kinds.ELASTIC_RESET, _NOTICES.on_reset)


def notice(msg: dict[str, Any]) -> None:
    """A generation given directly (the notebook's remote call between cells)."""
    _NOTICES.on_reset(msg)


def after_reset(fn: Callable[[], None], before: Callable[[], None] | None = None) -> None:
    """Call ``fn`` after every re-formed group (``hvdnb.torch`` rebuilds its transports),
    and ``before`` before the old one is released: whatever still holds the old group
    keeps its connections open, and a peer blocked on this rank is then never released
    (seen at 8 ranks: ranks not next to the dead one waited out the collective timeout)."""
    if fn not in _AFTER_RESET:
        _AFTER_RESET.append(fn)
    if before is not None and before not in _BEFORE_RESET:
        _BEFORE_RESET.append(before)


def pending(current: int) -> dict[str, Any] | None:
    """The newest generation after ``current`` the notebook announced (None: none)."""
    with _NOTICES.cond:
        got = _NOTICES.latest
    return got if got is not None and got["generation"] > current else None


def wait_for_generation(current: int, timeout: float) -> dict[str, Any]:
    """Block until the notebook announces a generation after ``current``; return it."""
    deadline = time.monotonic() + timeout
    with _NOTICES.cond:
        while True:
            got = _NOTICES.latest
            if got is not None and got["generation"] > current:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise HorovodInternalError(
                    f"slot {slot()}: no new generation from the notebook within {timeout:g} s "
                    "after a collective failed (HVDNB_ELASTIC_TIMEOUT). Is the notebook kernel "
                    "still running? `%dist status` shows the cluster."
                )
            _NOTICES.cond.wait(min(left, 0.5))


def left(exc: BaseException) -> None:
    """This rank's own code raised inside an elastic loop: tell the notebook it leaves."""
    from hvdnb.rank import channel  # noqa: PLC0415  the side channel (zmq) only where a loop fails

    try:
        setattr(exc, "hvdnb_left", True)  # noqa: B010  the cell's reply says so
    except AttributeError:  # an exception type without a __dict__
        pass
    ch = channel.get()
    if ch is not None:
        ch.send(kinds.ELASTIC_LEFT, slot=slot(), error=f"{type(exc).__name__}: {exc}"[:500])


# ---------------------------------------------------------------------- failures
#: words of the errors torch's backends raise when a peer has gone (gloo, NCCL, the store)
_PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "socket closed",
    "nccl communicator was aborted",
    "ncclremoteerror",
    "default process group has not been initialized",
    "process group has been destroyed",
    "third_party/gloo",
)


def is_internal(exc: BaseException, generation: int, grace: float = 0.0) -> bool:
    """Did ``exc`` come from a lost peer rather than from the training code itself?

    True for ``HorovodInternalError``, torch's distributed errors (``DistError`` and its
    kind), an error whose words say a peer went away, and, within ``grace`` seconds, any
    error after which the notebook announces a new generation (a peer was lost).
    """
    if isinstance(exc, HorovodInternalError):
        return True
    names = {c.__name__ for c in type(exc).__mro__}
    if names & {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}:
        return True
    text = str(exc).lower()
    if isinstance(exc, RuntimeError) and any(w in text for w in _PEER_GONE):
        return True
    if grace > 0 and enabled():
        try:
            wait_for_generation(generation, grace)
            return True
        except HorovodInternalError:
            return False
    return pending(generation) is not None


class HostCheck:
    """A commit's membership check: rank 0's view, agreed at a commit every rank names.

    Horovod broadcasts rank 0's view of membership changes at every commit and waits for
    it. Here a broadcast a commit starts (asynchronously) is read at the next commit, long
    done by then, so no commit waits on it; and since starting one still cost 0.15-0.25 ms
    of a rank's time on 2 CPU ranks (the collective's thread wakes on a busy core), not
    every commit starts one. Each broadcast carries, beside the view, rank 0's ``gap``: the
    commits until the next one, as many as fit in ``PERIOD`` seconds at rank 0's last
    commit interval (1 when commits are that far apart, at most ``MAX_GAP``). Every rank
    reads the same gap from the same broadcast, so they start the next at the same commit
    and act on a change at the same commit: within about ``PERIOD`` plus one commit
    interval of rank 0 hearing of it. A failed collective (a death) never waits for this:
    it raises at once. Without a torch.distributed group the check is Horovod's, through
    ``bcast_object``, at every commit.
    """

    #: seconds of commits between two broadcasts (a scale waits at most about this more)
    PERIOD = 0.5
    MAX_GAP = 100

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.pending: tuple[Any, Any] | None = None
        #: commits to let pass before the next broadcast starts (agreed: read from one)
        self.skip = 0
        self._clock = clock
        self._last: float | None = None  # this rank's clock at its last commit
        #: the default group the last broadcast went over, whether it is NCCL's, and (gloo)
        #: the CPU tensor the broadcasts go through, its numpy view and the call's options
        self._group: Any = None
        self._nccl = False
        self._buf: Any = None
        #: the newest membership change this rank heard of, and whether all since the last
        #: one acted on only removed ranks
        self.seen = 0.0
        self.removed_only = True

    def drop(self) -> None:
        """Forget the broadcast in flight (its group is gone after a reset), and its
        tensor: an aborted collective may still write into it. The new group's first
        commit starts a broadcast."""
        self.pending = None
        self.skip = 0
        self._last = None
        self._group = self._buf = None

    def check(
        self, acted: float, messages: Any, bcast_object: Callable[[Any], Any] | None
    ) -> tuple[float, bool] | None:
        """Take this rank's new messages; return ``(stamp, removed_only)`` of a change
        every rank acts on now (None: none). ``acted``: the stamp last acted on."""
        while not messages.empty():
            stamp, removed = messages.get()
            if stamp > self.seen:
                self.seen = stamp
                self.removed_only = self.removed_only and removed
        now = self._clock()
        gap = self._gap(now)
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            view = (acted, self.seen, self.removed_only)
            a, b, r = tuple(bcast_object(view)) if bcast_object is not None else view
            return self._decide(a, b, bool(r))
        got = None
        if self.pending is not None:
            work, t = self.pending
            work.wait()
            a, b, r, g = t.tolist()
            self.pending = None
            got = self._decide(a, b, bool(r))
            acted = got[0] if got is not None else acted
            self.skip = int(g) - 1
        if self.skip <= 0:
            self.pending = self._start(dist, (acted, self.seen, float(self.removed_only), gap))
        else:
            self.skip -= 1
        return got

    def _gap(self, now: float) -> float:
        """Commits until the broadcast after the one this commit may start (rank 0's
        counts): ``PERIOD`` over the interval since this rank's last commit."""
        last, self._last = self._last, now
        if last is None or now - last <= 0:
            return 1.0
        return float(max(1, min(self.MAX_GAP, int(self.PERIOD / (now - last)))))

    def _start(self, dist: Any, view: tuple[float, ...]) -> tuple[Any, Any]:
        """Start broadcasting rank 0's ``view`` over the default group: (work, tensor).

        On gloo, through the group's own call with a tensor made once per group: torch's
        ``dist.broadcast`` and ``get_backend`` cost 0.07 ms of the 0.2 ms this took on 2 CPU
        ranks, and a new tensor per commit as much again."""
        import torch  # noqa: PLC0415  torch is loaded already (its group exists)

        group = dist.distributed_c10d._get_default_group()
        if group is not self._group:
            self._group, self._buf = group, None
            self._nccl = str(dist.get_backend(group)) == "nccl"
        if self._nccl:
            dev = torch.device("cuda", torch.cuda.current_device())
            t = torch.tensor(view, dtype=torch.float64).to(dev)
            return dist.broadcast(t, 0, async_op=True), t
        if self._buf is None:
            buf = torch.zeros(len(view), dtype=torch.float64)
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self._buf = (buf, buf.numpy(), opts)
        t, np_view, opts = self._buf
        np_view[:] = view  # the last broadcast through it has ended: waited for in check
        return group.broadcast([t], opts), t

    def _decide(self, acted: float, seen: float, removed_only: bool) -> tuple[float, bool] | None:
        if seen > acted:
            self.removed_only = True
            return seen, removed_only
        return None


# ---------------------------------------------------------------------- states
class State:
    """Horovod's elastic state: what a training loop commits, restores and syncs.

    Parameters
    ----------
    bcast_object : ``fn(obj) -> obj`` returning rank 0's ``obj`` on every rank
    get_rank : ``fn() -> int``, this rank in the current generation
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: queue.Queue[tuple[float, bool]] = queue.Queue()
        self._last_updated_timestamp = 0.0
        self._reset_callbacks: list[Callable[[], None]] = []
        self._check = HostCheck()
        _NOTICES.states.add(self)

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after every reset (to rescale a learning rate, ...)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """After a new group formed: reset the state's parts, then the callbacks."""
        self._host_messages = queue.Queue()
        self._check.drop()
        self.reset()
        for cb in self._reset_callbacks:
            cb()

    def on_hosts_updated(self, timestamp: float, removed: bool) -> None:
        """The notebook announced a membership change at ``timestamp``."""
        self._host_messages.put((timestamp, removed))

    def commit(self) -> None:
        """Save the state (memory), then check for membership changes (collective)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank at the same commit when rank 0
        heard of a membership change (``HostCheck``: agreed a commit or more late)."""
        got = self._check.check(
            self._last_updated_timestamp, self._host_messages, self._bcast_object
        )
        if got is not None:
            self._last_updated_timestamp = got[0]
            raise HostsUpdatedInterrupt(got[1])

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Re-read what depends on the world (rank, size); nothing by default."""


class ObjectState(State):
    """A state of plain attributes (``epoch=0, batch=0``): saved by value, synced from
    rank 0 with ``bcast_object``."""

    def __init__(
        self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int], **kwargs: Any
    ) -> None:
        self._bcast_object = bcast_object
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {k: getattr(self, k) for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for k, v in self._saved_state.items():
            setattr(self, k, v)


# ---------------------------------------------------------------------- the loop
def run_fn(func: F, reset: Callable[[], None], generation: Callable[[], int]) -> F:
    """Horovod's elastic loop around ``func(state, *args, **kwargs)`` (see the module
    docstring); ``reset`` forms the next group, ``generation`` tells the current one."""

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
        _NOTICES.states.add(state)
        _LOOPS[0] += 1
        if _LOOPS[0] == 1:
            _say_inside(True)
        try:
            return _loop(state, args, kwargs)
        finally:
            _LOOPS[0] -= 1
            if _LOOPS[0] == 0:
                _say_inside(False)

    def _loop(state: Any, args: Any, kwargs: Any) -> Any:
        skip_sync = False
        while True:
            gen = generation()
            try:
                if not skip_sync:
                    if enabled():
                        _align_step()
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            except RankRemoved:
                raise
            except BaseException as exc:
                if isinstance(exc, (KeyboardInterrupt, SystemExit)) or not enabled():
                    raise  # outside an elastic cluster nobody re-forms the group
                if not is_internal(exc, gen, grace=_grace()):
                    left(exc)  # leaves as if it had died; the peers go on
                    raise
                state.restore()
                skip_sync = False
            reset()
            state.on_reset()

    return wrapper  # type: ignore[return-value]


def _say_inside(inside: bool) -> None:
    """Tell the notebook this rank entered or left its outermost elastic loop: a scale
    asked for while a cell runs happens at a commit only while every rank is in one."""
    if not enabled():
        return
    from hvdnb.rank import channel  # noqa: PLC0415  the side channel (zmq): only on an elastic cluster

    ch = channel.get()
    if ch is not None:
        ch.send(kinds.ELASTIC_LOOP, slot=slot(), inside=inside)


def _grace() -> float:
    """Seconds an unrecognised error waits for a new generation before it counts as the
    training code's own (a peer's death the backend worded in a way not listed)."""
    return float(get_config().elastic_grace)


def timeout() -> float:
    """Seconds a survivor waits for the notebook's next generation (``HVDNB_ELASTIC_TIMEOUT``)."""
    return float(get_config().elastic_timeout)


def run_after_reset() -> None:
    """The hooks registered with ``after_reset``, in order."""
    for fn in list(_AFTER_RESET):
        fn()


def reform() -> None:
    """After a lost peer: release the group, wait for the notebook's next generation, and
    form it (this rank's place is its slot's index among the members). Raises
    ``RankRemoved`` when this slot is not among them."""
    from hvdnb.rank import frameworks, rendezvous  # noqa: PLC0415  rendezvous imports torch's hooks: only when a group re-forms

    if not enabled():
        raise HorovodInternalError(
            "a collective failed and this cluster is not elastic, so its group cannot be "
            "re-formed without the lost rank: start with `%dist start -n N --min-np M`"
        )
    _REFORMING[0] = True
    try:
        for fn in list(_BEFORE_RESET):
            fn()
        rendezvous.release_group()
        # what the failed step left in reference cycles goes now: a DDP wrapper of the old
        # group kept its hooks on the parameters, and the next generation's backward fired
        # them ("marked as ready twice": the walk's DDP cell failed so)
        gc.collect()
        with _NOTICES.cond:
            pids = list((_NOTICES.latest or {}).get("pids") or ())
            lost = list((_NOTICES.latest or {}).get("lost_hosts") or ())
        cut_peer_links([int(p) for p in pids], lost)  # peers blocked on this rank fail now
        current = rendezvous.generation()
        me = slot()
        while True:
            got = wait_for_generation(current, timeout())
            gen, members = int(got["generation"]), [int(m) for m in got["members"]]
            if me not in members:
                raise RankRemoved(f"slot {me} is not in generation {gen}: it leaves")
            if _all_arrived(gen, len(members)):
                break
            current = gen  # a newer generation replaced this one (another rank was lost)
        w = rendezvous.rejoin(
            gen,
            members.index(me),
            len(members),
            place=place_of(members, got.get("hosts"), me),
        )
    finally:
        _REFORMING[0] = False
    frameworks.move(rendezvous.place(w, _device()))
    run_after_reset()


def _all_arrived(gen: int, size: int) -> bool:
    """Wait on the store until every member of generation ``gen`` has arrived (True), or
    until the notebook announces a newer one (False): a member that died meanwhile would
    otherwise hold the others in the group's own rendezvous until its timeout."""
    from hvdnb.rank import rendezvous  # noqa: PLC0415  rendezvous imports torch's hooks: only when a group re-forms

    store = rendezvous.store()
    key = f"hvdnb-elastic/{gen}/arrived"  # beside the group's own prefix, never in it
    store.add(key, 1)
    deadline = time.monotonic() + timeout()
    while store.add(key, 0) < size:
        if pending(gen) is not None:
            return False
        if time.monotonic() > deadline:
            raise HorovodInternalError(
                f"generation {gen}: not every one of its {size} ranks arrived within "
                f"{timeout():g} s (HVDNB_ELASTIC_TIMEOUT)"
            )
        time.sleep(0.005)
    return True


def _align_step() -> None:
    """Give every rank rank 0's step in progress (the step the panel puts a collective's
    timing at): a rank that joined a running loop is at step 0 until its first
    ``hvdnb.log``, so its first timed collectives were drawn at step 0, far left of the
    loop's. One 8-byte broadcast at each sync (not timed: it is not a hvdnb.torch
    collective); a rank that has logged in this loop keeps its own count."""
    import torch  # noqa: PLC0415  torch is heavy: loaded when first used
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

    from hvdnb.rank.metrics.recorder import get_recorder  # noqa: PLC0415  the recorder: only where a loop syncs

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    rec = get_recorder()
    # a CUDA tensor for NCCL only: a gloo group on a GPU host broadcasts from the CPU
    dev = _device() if str(dist.get_backend()) == "nccl" else "cpu"
    t = torch.tensor([rec.cur_step], dtype=torch.int64, device=dev)
    dist.broadcast(t, src=0)
    if rec.cur_step == 0:
        rec.cur_step = int(t.item())


def _device() -> str:
    import torch  # noqa: PLC0415  torch is heavy: loaded when first used

    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def place_of(
    members: list[int], hosts: Sequence[str] | None, me: int
) -> tuple[int, int, int, int] | None:
    """Slot ``me``'s (local rank, local size, cross rank, cross size) in a generation whose
    ``members`` (slots, in rank order) run on ``hosts`` (one name per member; None: all on
    one host, and None is returned). Hosts are numbered in the order their first rank
    comes, ranks within a host in rank order, as hydra numbers them."""
    if not hosts or len(hosts) != len(members):
        return None
    mine = hosts[members.index(me)]
    order = list(dict.fromkeys(hosts))
    local = [m for m, h in zip(members, hosts) if h == mine]
    return local.index(me), len(local), order.index(mine), len(order)


def _addresses(hosts: Sequence[str]) -> set[str]:
    """The IP addresses of ``hosts`` (names or addresses), as this host resolves them."""
    out: set[str] = set()
    for h in hosts:
        try:
            out.update(str(a[4][0]) for a in socket.getaddrinfo(h, None, proto=socket.IPPROTO_TCP))
        except OSError:
            continue
    return out


def cut_peer_links(pids: list[int], hosts: Sequence[str] = ()) -> int:
    """Shut down this process's TCP connections to the processes ``pids`` (the other ranks
    of an elastic cluster, on this host) and to every process on ``hosts`` (hosts whose
    ranks were all lost, none of the notebook's own: a host lost to a cut link never
    closes its end, and its pids mean nothing here): gloo's pairs. Returns how many.

    gloo's ``abort`` does not wake a collective blocked on this rank, nor close its pairs
    (a peer two hops from a dead rank then waits out the collective timeout), and
    destroying the group closes them only when nothing else holds it (an async ``Work``
    in a frame does). A shut-down socket fails the collective on both of its ends at once.
    The connections to the store, the notebook and the controller are not to ranks.
    """
    import psutil  # noqa: PLC0415  psutil is only needed when a rank was lost

    peers: set[tuple[str, int]] = set()
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            peers.update(
                (c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
            )
        except psutil.Error:
            continue
    far = _addresses(hosts)
    cut = 0
    for c in psutil.Process().net_connections("tcp"):
        if c.fd < 0 or not c.raddr:
            continue
        if (c.raddr.ip, c.raddr.port) not in peers and c.raddr.ip not in far:
            continue
        try:
            with socket.socket(fileno=os.dup(c.fd)) as sk:
                sk.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            continue
    return cut
