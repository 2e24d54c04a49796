"""An elastic cluster's membership: which engines are its ranks, generation by generation.

Each engine of an elastic cluster (``%dist start -n N --min-np M``) is a *slot*: its
ipyparallel engine id, given at its start and kept for its life. A generation is a list of
slots in rank order (a slot's rank is its index). When a slot is lost (its process has
exited, or its code raised inside an elastic loop and it left), the notebook decides the
next generation, the survivors in their old order, and sends it to each survivor on the
side channel (``kinds.ELASTIC_RESET``): survivors inside ``hvd.elastic.run`` /
``hvdnb.elastic.run`` re-form their group with it at once; idle ones when the next cell is
sent (``catch_up``). Below ``min_np`` survivors nothing re-forms and the cell fails,
naming the deaths.

Every change is an ``Event`` (when, the generation, who was lost, the new size, why); the
cell prints its line, the panel marks it, ``%dist status`` shows the generation.

Also here, the parts of an elastic cluster's life that ``lifecycle`` calls: its store
process (``StoreHost``), one engine set per slot (``start_slots``, ``slot_processes``) and
``scale``.

Never: talk to a rank without a timeout, or let a process outlive the notebook.
"""

from __future__ import annotations

import asyncio
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from hvdnb.notebook.cluster import launch, sshcheck, sshslots
from hvdnb.notebook.cluster.spec import ClusterError
from hvdnb.notebook.metrics.ranklabels import format_ranks
from hvdnb.protocol import kinds
from hvdnb.protocol.remote import CONNECT_CHANNEL, ELASTIC_REJOIN

__all__ = [
    "LEFT_WINDOW",
    "Event",
    "Membership",
    "StoreHost",
    "connect_new",
    "not_started",
    "request",
    "scale",
    "slot_processes",
    "start_new",
    "start_slots",
]

#: seconds the notebook waits after a rank's code raised in an elastic loop before it takes
#: that rank out: if every rank raises meanwhile the error is the code's, not one rank's,
#: and the ranks stay (the cell fails as any cell does)
LEFT_WINDOW = 0.3

#: across hosts, seconds the notebook waits after a rank on another host was lost for the
#: host's other ranks to follow (a host killed or cut loses them all within a round trip
#: of each other): a host lost is one change, named in one line, not one per rank
HOST_WINDOW = 0.5


@dataclass(frozen=True)
class Event:
    """One membership change."""

    t: float  #: ``time.time()`` when the notebook decided it
    generation: int  #: the generation it formed (the old one was ``generation - 1``)
    lost: tuple[int, ...]  #: the ranks lost, numbered as in the old generation
    size: int  #: ranks in the new generation (0: below ``min_np``, none formed)
    why: str  #: "died", "left" (raised), "scaled"
    cell: int | None = None  #: the cell it happened in (None: between cells)
    errors: dict[int, str] = field(default_factory=dict)  #: lost rank -> its error (left)
    lost_slots: tuple[int, ...] = ()  #: the engines lost (slots)
    #: hosts whose every rank was lost (across hosts: the line names them)
    hosts: tuple[str, ...] = ()

    def line(self, min_np: int) -> str:
        """The one line a person reads."""
        if self.why == "scaled":
            s = "s" if self.size != 1 else ""
            return f"hvdnb: the cluster now has {self.size} rank{s} (generation {self.generation})"
        lost = format_ranks(list(self.lost))
        many = len(self.lost) > 1
        plural = "s" if many else ""
        who = f"rank{plural} {lost}"
        if self.hosts:  # a host lost: named, with its ranks
            who = f"host{'s' if len(self.hosts) > 1 else ''} {', '.join(self.hosts)} ({who})"
            many = many or len(self.hosts) > 1
        verb = {
            "left": f"left ({'their' if many else 'its'} code raised)",
            "hung": f"stopped answering (no heartbeat for 3 s) and {'were' if many else 'was'} "
            "stopped",
            "lost": f"{'were' if many else 'was'} lost (gone from the controller: killed, or "
            "cut off)",
        }.get(self.why, "died")
        if self.size == 0:
            return (
                f"hvdnb: {who} of generation {self.generation - 1} {verb}, which "
                f"leaves fewer than --min-np {min_np} ranks: `%dist scale N` or `%dist "
                "restart` brings the cluster back"
            )
        return (
            f"hvdnb: {who} of generation {self.generation - 1} {verb}; training "
            f"goes on with {self.size} rank{'s' if self.size != 1 else ''} (generation "
            f"{self.generation})"
        )


class Membership:
    """The slots of an elastic cluster and their generations.

    Parameters
    ----------
    cluster : the ``Cluster`` (its ``client``, ``channel``, ``generation`` and engine
        processes are read; ``generation`` is advanced here)
    slots : the first generation's slots
    min_np, max_np : the fewest ranks it goes on with; the most ``scale`` may add
    """

    def __init__(
        self,
        cluster: Any,
        slots: list[int],
        min_np: int,
        max_np: int,
        on_started: Callable[[], None] = lambda: None,
    ) -> None:
        self.cluster = cluster
        #: called after new engines started (the watchdog learns them)
        self.on_started = on_started
        self.members = list(slots)
        self.min_np, self.max_np = min_np, max_np
        self.next_slot = max(slots, default=-1) + 1
        self.events: list[Event] = []
        #: slot -> (when, error) of a rank whose code raised in an elastic loop
        self.left: dict[int, tuple[float, str]] = {}
        #: the generation the idle survivors must still be brought to (None: none)
        self.behind: int | None = None
        #: slot -> its engine process (psutil)
        self.procs: dict[int, Any] = {}
        #: slots inside an elastic loop now (``kinds.ELASTIC_LOOP``)
        self.looping: set[int] = set()
        #: the size a ``request_scale`` asked for, not carried out yet (None: none)
        self.wanted: int | None = None
        #: across hosts: where each slot runs (None: every slot on this host)
        self.placement: sshslots.Placement | None = None
        #: slot -> its engine's launcher, where it was started over ssh (``sshslots``)
        self.remote: dict[int, Any] = {}
        #: slot -> when it was first seen lost (``HOST_WINDOW``)
        self.first_seen: dict[int, float] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ reading
    @property
    def size(self) -> int:
        return len(self.members)

    def slot_of(self, rank: int) -> int:
        """The engine id of ``rank`` in the current generation."""
        return self.members[rank]

    def rank_of(self, slot: int) -> int | None:
        """``slot``'s rank in the current generation (None: not a member)."""
        try:
            return self.members.index(slot)
        except ValueError:
            return None

    def on_left(self, msg: dict[str, Any]) -> None:
        """A rank said its code raised inside an elastic loop (channel thread)."""
        slot = msg.get("slot")
        if isinstance(slot, int):
            with self._lock:
                self.left.setdefault(slot, (time.monotonic(), str(msg.get("error", ""))))

    def on_loop(self, msg: dict[str, Any]) -> None:
        """A rank entered or left its elastic loop (channel thread)."""
        slot = msg.get("slot")
        if isinstance(slot, int):
            with self._lock:
                (self.looping.add if msg.get("inside") else self.looping.discard)(slot)

    def all_looping(self) -> bool:
        """Is every member inside an elastic loop (a scale can happen at a commit)?"""
        with self._lock:
            return bool(self.members) and set(self.members) <= self.looping

    def hosts(self, slots: list[int] | None = None) -> list[str] | None:
        """The host of each of ``slots`` (the members by default); None on one host."""
        if self.placement is None:
            return None
        where = self.placement.host_of
        return [where.get(s, "") for s in (self.members if slots is None else slots)]

    def retire(self, s: int) -> None:
        """Take slot ``s`` out for good: its engine process is killed if it still runs
        (over ssh on another host, without waiting for it)."""
        p = self.cluster.slot_processes().get(s)
        if p is not None:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        el = self.remote.get(s)
        if el is not None and el.state == "running":
            sshslots.kill(el)

    def gone(self) -> list[int]:
        """Member slots whose engine process has exited (or left the controller)."""
        return list(self.gone_why())

    def gone_why(self) -> dict[int, str]:
        """Member slots lost, each with ``died`` (its process exited), ``hung`` (the
        controller stopped hearing its heartbeat: a stopped or hung process, which is
        then retired, killed, so that peers blocked on it are released) or, on another
        host, ``lost`` (gone from the controller, not known to have exited)."""
        # kept from when each was first seen: ipyparallel forgets an engine that exited
        for s, p in self.cluster.slot_processes().items():
            self.procs.setdefault(s, p)
        procs = self.procs
        ids = set(self.cluster.client.ids) if self.cluster.client is not None else set()
        out: dict[int, str] = {}
        # on other hosts: ipyparallel drops a launcher whose engine ended, so each is kept
        for s, el in sshslots.slot_launchers(self.cluster.engine_launchers()).items():
            self.remote.setdefault(s, el)
        ended = {s for s, el in self.remote.items() if el.state == "after"}
        for s in self.members:
            p = procs.get(s)
            if (p is not None and not _alive(p)) or s in ended:
                out[s] = "died"
            elif ids and s not in ids:
                # on another host the controller hears of it first (in ~0.1 s after a kill,
                # ssh's waitpid in seconds): killed or cut off, this host cannot tell
                out[s] = "lost" if s in self.remote else "hung"
        return out

    # ------------------------------------------------------------------ deciding
    def watch(self, cell: int | None) -> Event | None:
        """Look for lost slots; when there are, form the next generation (or find it
        below ``min_np``) and return its ``Event``. Called from the notebook's main thread
        (a running cell's wait, a cell's submit)."""
        now = time.monotonic()
        why_of = self.gone_why()
        dead = list(why_of)
        if dead and self._host_may_follow(dead, now):
            return None
        with self._lock:
            raised = {s: v for s, v in self.left.items() if s in self.members and s not in dead}
        due = [s for s, (t, _) in raised.items() if now - t >= LEFT_WINDOW]
        if raised and len(raised) + len(dead) == self.size and not dead:
            # every rank raised: the code's own error, not a fault; nobody is taken out
            with self._lock:
                for s in raised:
                    self.left.pop(s, None)
            return None
        lost = dead + [s for s in due if s not in dead]
        if not lost:
            return None
        errors = {self.members.index(s): raised[s][1] for s in due if s in raised}
        whys = set(why_of.values())
        why = next((w for w in ("died", "hung", "lost") if w in whys), "left")
        return self._form([s for s in self.members if s not in lost], lost, why, cell, errors)

    def _form(
        self,
        survivors: list[int],
        lost: list[int],
        why: str,
        cell: int | None,
        errors: dict[int, str],
    ) -> Event:
        c = self.cluster
        lost_ranks = tuple(sorted(self.members.index(s) for s in lost))
        gone_hosts = self._lost_hosts(survivors, lost)
        for s in lost:
            self.retire(s)  # a rank that raised leaves as if it had died
            with self._lock:
                self.left.pop(s, None)
        _renumber(c, self.members, survivors)
        c.generation += 1
        size = len(survivors) if len(survivors) >= self.min_np else 0
        ev = Event(
            time.time(), c.generation, lost_ranks, size, why, cell, errors, tuple(lost), gone_hosts
        )
        self.members = survivors
        self.events.append(ev)
        if size:
            self.announce(removed=True, why=why, lost_hosts=gone_hosts)
            if c.client is not None:
                c.view = c.client[list(survivors)]
                c.view.block = False
        return ev

    def _host_may_follow(self, dead: list[int], now: float) -> bool:
        """Is a lost rank's host still within ``HOST_WINDOW`` of its first loss, with
        ranks of its own left (they may be lost with it)?"""
        if self.placement is None:
            return False
        where = self.placement.host_of
        for s in dead:
            self.first_seen.setdefault(s, now)
        for s in dead:
            host = where.get(s)
            rest = [m for m in self.members if where.get(m) == host and m not in dead]
            if rest and now - self.first_seen[s] < HOST_WINDOW:
                return True
        return False

    def _lost_hosts(self, survivors: list[int], lost: list[int]) -> tuple[str, ...]:
        """Hosts all of whose member ranks are in ``lost`` (none of the notebook's own)."""
        if self.placement is None:
            return ()
        where = self.placement.host_of
        kept = {where.get(s) for s in survivors}
        gone = dict.fromkeys(where.get(s, "") for s in lost)
        return tuple(h for h in gone if h and h not in kept)

    def announce(
        self,
        removed: bool,
        why: str,
        also: tuple[int, ...] = (),
        lost_hosts: tuple[str, ...] = (),
    ) -> None:
        """Send the current generation to every member (they re-form when they can), with
        the engine processes of every slot seen on this host and the hosts lost whole (a
        survivor cuts its links to them), and each member's host (their local ranks); and
        to the slots ``also`` (ranks ``%dist scale`` takes out: they leave at that reset)."""
        c = self.cluster
        msg = {
            "generation": c.generation,
            "members": list(self.members),
            "hosts": self.hosts(),
            "lost_hosts": list(lost_hosts),
            "t": time.time(),
            "removed": removed,
            "why": why,
            "pids": [p.pid for p in self.procs.values()],
        }
        if c.channel is not None:
            for s in [*self.members, *also]:
                c.channel.send(s, kinds.ELASTIC_RESET, **msg)
        self.behind = c.generation

    def catch_up(self, timeout: float = 60.0) -> None:
        """Bring idle members to the current generation (before a cell is sent): a
        remote call on each; those already there (an elastic loop re-formed) do nothing."""
        if self.behind is None:
            return
        c = self.cluster
        view = c.client[list(self.members)]
        view.apply_async(ELASTIC_REJOIN, c.generation, list(self.members), self.hosts()).get(
            timeout=timeout
        )
        self.behind = None
        c.view = view
        c.view.block = False

    def grew(self, slots: list[int], cell: int | None = None) -> Event:
        """``slots`` joined (``%dist scale``): form the next generation with them."""
        c = self.cluster
        c.generation += 1
        self.members = self.members + list(slots)
        ev = Event(time.time(), c.generation, (), len(self.members), "scaled", cell)
        self.announce(removed=False, why="scaled")
        self.events.append(ev)
        return ev

    def shrink_at_commit(self, n: int, cell: int | None) -> Event:
        """Keep the first ``n`` ranks, while they train in an elastic loop: every rank
        hears of the next generation, all re-form at the same commit, and the ranks past
        ``n`` find themselves out of it and leave their loop (``RankRemoved``); nothing is
        killed until they have (``retire``)."""
        c = self.cluster
        drop = self.members[n:]
        lost = tuple(range(n, len(self.members)))
        _renumber(c, self.members, self.members[:n])
        c.generation += 1
        self.members = self.members[:n]
        ev = Event(time.time(), c.generation, lost, n, "scaled", cell, {}, tuple(drop))
        self.events.append(ev)
        self.announce(removed=False, why="scaled", also=tuple(drop))
        if c.client is not None:
            c.view = c.client[list(self.members)]
            c.view.block = False
        return ev

    def shrank(self, drop: list[int]) -> Event:
        """``drop`` (ranks) are taken out by ``%dist scale``: the next generation is the rest."""
        lost = [self.members[r] for r in drop]
        survivors = [s for s in self.members if s not in lost]
        ev = self._form(survivors, lost, "scaled", None, {})
        return Event(ev.t, ev.generation, ev.lost, ev.size, "scaled")


def _renumber(cluster: Any, old: list[int], new: list[int]) -> None:
    """What the notebook keeps per rank (the last cell, the last engine info) follows each
    surviving engine to its rank in the next generation; the lost ranks' entries go."""
    for attr in ("last_cell", "info_seen"):
        per_rank = getattr(cluster, attr, None)
        if isinstance(per_rank, dict):
            kept = {
                new.index(s): per_rank[r] for r, s in enumerate(old) if s in new and r in per_rank
            }
            per_rank.clear()
            per_rank.update(kept)
    notes = getattr(cluster, "death_notes", None)
    if isinstance(notes, dict):
        notes.clear()


def _alive(p: Any) -> bool:
    try:
        return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


class StoreHost:
    """An elastic cluster's rendezvous store (``python -m hvdnb.rank.storehost``): this
    kernel binds the port (so the engines are told it at once) and hands the socket over;
    the process ends when its stdin closes, with this kernel.

    A store process spends most of a second importing torch before it serves, and the
    ranks wait for it. Where the warm standby is on, ``keep_spare`` starts the next
    cluster's store after a start, so that a restart finds one serving already (a fresh
    store: no key of the old cluster is in it)."""

    def __init__(self) -> None:
        self.addr = ""
        #: the address it binds: loopback, or across hosts the cluster's (``spec.ip``)
        self.ip = "127.0.0.1"
        self.proc: subprocess.Popen[bytes] | None = None
        self._spare: tuple[str, subprocess.Popen[bytes]] | None = None
        self._spare_serving = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def spare_pid(self) -> int | None:
        """The spare's process (the watchdog's: it outlives a restart, not the kernel)."""
        return self._spare[1].pid if self._spare is not None else None

    def open(self, ip: str = "127.0.0.1") -> None:
        self.close()
        if ip != self.ip:  # a spare bound elsewhere serves no longer
            self.ip = ip
            self.close_spare()
        spare, self._spare = self._spare, None
        if spare is not None and spare[1].poll() is None:
            self.addr, self.proc = spare
            return
        if spare is not None:
            _end(spare[1])
        self.addr, self.proc = _store_process(self.ip)

    def spare_ready(self) -> bool:
        """Does the spare store serve already (it says so on its standard output)?"""
        if self._spare is None:
            return False
        if self._spare_serving:
            return True
        out = self._spare[1].stdout
        if out is not None and select.select([out], [], [], 0)[0]:
            self._spare_serving = out.readline().startswith(b"serving")
        return self._spare_serving

    def keep_spare(self, wanted: bool) -> None:
        """Start the next cluster's store now, or (``wanted`` False: the standby is off, or
        the cluster is no longer elastic) stop the one kept. Never raises: it is an extra."""
        if not wanted:
            self.close_spare()
        elif self._spare is None:
            self._spare_serving = False
            try:
                self._spare = _store_process(self.ip)
            except Exception:
                self._spare = None

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            _end(proc)

    def close_spare(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            _end(spare[1])


def _store_process(ip: str = "127.0.0.1") -> tuple[str, subprocess.Popen[bytes]]:
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((ip, 0))  # the cluster's address only, never every interface
    sock.listen(128)
    addr = f"{ip}:{sock.getsockname()[1]}"
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hvdnb.rank.storehost", "--fd", str(sock.fileno())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,  # one line, "serving" (``spare_ready``)
            pass_fds=(sock.fileno(),),
        )
    finally:
        sock.close()
    return addr, proc


def _end(proc: subprocess.Popen[bytes]) -> None:
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(2)
    except Exception:
        proc.kill()
        try:
            proc.wait(2)
        except Exception:
            pass


def slot_processes(launchers: list[Any]) -> dict[int, Any]:
    """The engine process (psutil) of each slot whose engine set (``slot<N>``) runs."""
    out: dict[int, Any] = {}
    for es in launchers:
        sid = str(getattr(es, "engine_set_id", ""))
        if not sid.startswith("slot"):
            continue
        for el in list(getattr(es, "launchers", {}).values()):
            proc = getattr(el, "process", None)
            if proc is not None:
                try:
                    out[int(sid[4:])] = psutil.Process(proc.pid)
                except (psutil.NoSuchProcess, ValueError):
                    pass
    return out


async def start_slots(
    cluster: Any, slots: list[int], size: int, join: bool, hosts: list[str] | None = None
) -> None:
    """Start one engine set of one engine per slot, each told its slot and the store;
    across hosts (``hosts``: one per slot), each over ssh on its host (``sshslots``)."""
    c = cluster.ipp
    name = c.engine_launcher_class.__name__
    base_env = dict(c.config[name].environment)
    m: Membership | None = cluster.membership
    first = m.placement.first(size) if m is not None and m.placement is not None else None
    starts = []
    if hosts is not None:  # their shared ssh connections first (``sshslots.open_shared``)
        await asyncio.get_running_loop().run_in_executor(None, sshslots.open_shared, hosts)
    try:
        for i, s in enumerate(slots):
            env = {**base_env, **launch.elastic_env(s, size, cluster.store_host.addr, join)}
            if hosts is not None and m is not None and m.placement is not None:
                m.placement.host_of[s] = hosts[i]
                if not join and first is not None:
                    env.update(m.placement.env(s, first))
                # a shared home: the connection files are there already, never copied
                c.config[name].engines = {hosts[i]: {"n": 1, "to_send": []}}
            c.config[name].environment = env
            # side by side (over ssh, ``sshlauncher``): the set is made from this config
            # before the task's first wait, which this sleep lets it reach
            starts.append(asyncio.ensure_future(c.start_engines(1, engine_set_id=f"slot{s}")))
            await asyncio.sleep(0)
        await asyncio.gather(*starts)
    finally:
        c.config[name].environment = base_env


def scale(cluster: Any, n: int) -> Event:
    """Take an elastic cluster to ``n`` ranks, between cells: the highest ranks leave, or
    new engines start and join; either way the next generation forms on every rank.
    Raises ClusterError for a fixed-size cluster or an ``n`` outside ``--min-np``..``--max-np``."""
    m = _checked(cluster, n)
    m.wanted = None
    cluster.watch_members(None)  # deaths since the last cell first
    if n < m.size:
        ev = m.shrank(list(range(n, m.size)))
    elif n > m.size:
        ev = _grow(cluster, m, n)
    else:
        return Event(time.time(), cluster.generation, (), m.size, "scaled")
    m.catch_up(timeout=cluster.timeout + 30)
    return ev


def request(cluster: Any, n: int) -> str:
    """``Cluster.request_scale``: remember ``n`` for the running cell's wait (it carries it
    out at the elastic loop's next commit) or the next cell's start. Any thread."""
    m = _checked(cluster, n)
    m.wanted = n
    ranks = f"{n} rank{'s' if n != 1 else ''}"
    if m.all_looping():
        return f"scaling to {ranks} at the elastic loop's next commit"
    return (
        f"scaling to {ranks} when the ranks enter an elastic loop (hvd.elastic.run), or "
        "before the next cell"
    )


def _checked(cluster: Any, n: int) -> Membership:
    m: Membership | None = cluster.membership
    if m is None:
        raise ClusterError(
            "`%dist scale` is for an elastic cluster (`%dist start -n N --min-np M`); this "
            f"one has a fixed size: `%dist restart -n {n}` starts {n} fresh ranks"
        )
    if isinstance(n, bool) or not isinstance(n, int) or not m.min_np <= n <= m.max_np:
        raise ClusterError(
            f"`%dist scale {n}`: this cluster takes {m.min_np} to {m.max_np} ranks (its "
            "--min-np and --max-np); `%dist restart -n N --min-np M --max-np K` changes them"
        )
    return m


def _grow(cluster: Any, m: Membership, n: int) -> Event:
    new = start_new(cluster, m, n)
    deadline = time.monotonic() + cluster.timeout
    while not set(new) <= set(cluster.client.ids):
        if time.monotonic() > deadline:
            raise ClusterError(not_started(cluster))
        time.sleep(0.02)
    connect_new(cluster, new, deadline)
    return m.grew(new)


def start_new(cluster: Any, m: Membership, n: int) -> list[int]:
    """Start the engines that take ``m`` to ``n`` ranks (they join when told); their slots."""
    new = list(range(m.next_slot, m.next_slot + n - m.size))
    hosts = None
    if m.placement is not None:  # across hosts: free slots on hosts that answer ssh
        try:
            hosts = m.placement.free(
                m.members, len(new), lambda h: not sshcheck.unreachable([h], 10.0)
            )
        except LookupError as exc:
            raise ClusterError(f"`%dist scale {n}`: {exc}") from None
    m.next_slot += len(new)
    cluster.run_async(start_slots(cluster, new, n, join=True, hosts=hosts), cluster.timeout + 30)
    m.on_started()  # they die with this kernel too
    return new


def not_started(cluster: Any) -> str:
    return (
        f"the new rank(s) did not start within {cluster.timeout:.0f} s; `%dist status` "
        "shows the cluster, `%dist restart` starts every rank afresh"
    )


def connect_new(cluster: Any, new: list[int], deadline: float) -> None:
    """Connect the registered engines ``new`` to the side channel (they say hello)."""
    cluster.client[new].apply_sync(CONNECT_CHANNEL)
    while cluster.channel is not None and not set(new) <= set(cluster.channel.ranks):
        if time.monotonic() > deadline:
            break
        time.sleep(0.005)
