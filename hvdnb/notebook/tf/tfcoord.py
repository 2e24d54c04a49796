"""``hvdnb.ClusterCoordinator``: TensorFlow's ``ClusterCoordinator``, reporting to the panel.

A ParameterServerStrategy cluster (``%dist start --tf-ps K``) runs no training loop on its
ranks: the coordinator (this kernel) schedules functions, TensorFlow runs each on whichever
worker is free (in that worker's ``tf.distribute.Server`` threads, not in a cell), and the
variables live on the parameter servers. So the ranks' recorders see no steps; the
coordinator does. This wrapper schedules each function wrapped to also return the pid of
the process that ran it (``/proc/self/stat``, read by the worker itself), and when the
coordinator collects the results (``join``, or ``done`` when it says True) it writes, into
the notebook's store, for each finished step on the rank of the worker that ran it:

- ``loss``: what the step returned (a scalar; the first item of a tuple or list; a dict's
  ``"loss"``), at the coordinator's step number (the order of ``schedule`` calls, from 0);
- ``ps/steps``: that worker's running count of finished steps (its last value is the
  worker's steps done; summed over workers it is the number of steps collected).

Each rank's role (``tf_role``: ps or worker) reaches the panel's parameter-server table
(``hvdnb.notebook.panel.pstable``), and so does each parameter server's RSS: its heartbeat
starts when the coordinator is made (``hvdnb.rank.tfconfig.report_role``, run on every rank).
One coordinator is one run on the panel's runs chart (a ``%%distributed`` cell that logs in
between starts its own; the coordinator's next steps then start another).

Owns: the wrapped functions, the pending results, and (``StepBook``) the per-worker counts
and the messages. Never: block in ``schedule`` (results are read only where TensorFlow's own
calls wait: ``join``, ``done``), import tensorflow before it is made, or change what the
user's function computes.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from hvdnb.notebook.cluster.lifecycle import Cluster
from hvdnb.notebook.metrics.store import MetricsStore, attach
from hvdnb.notebook.panel.panel import get_panel
from hvdnb.notebook.tf.tfps import ps_cluster
from hvdnb.protocol.remote import RemoteCall

__all__ = ["ClusterCoordinator", "Scheduled", "StepBook", "loss_of"]

#: tag each rank's messages with its role; a ps starts its memory heartbeat
REPORT_ROLE = RemoteCall("hvdnb.rank.tfconfig:report_role")
#: the first field is the pid of the process reading it: the worker's, read on the worker
_STAT = "/proc/self/stat"


def loss_of(out: Any) -> float | None:
    """The loss in what a scheduled step returned (fetched: numpy values), or None."""
    if isinstance(out, dict):
        out = out.get("loss")
    elif isinstance(out, (tuple, list)):
        out = out[0] if out else None
    try:
        a = np.asarray(out)
    except Exception:  # not array-like: no loss to show
        return None
    if a.size != 1 or a.dtype.kind not in "fiu":
        return None
    return float(a.reshape(()))


class Scheduled:
    """What ``ClusterCoordinator.schedule`` returns: TensorFlow's ``RemoteValue`` of the
    function's own result (``fetch``, ``get``), its coordinator step and, once collected,
    the rank of the worker that ran it."""

    __slots__ = ("rank", "remote", "step")

    def __init__(self, remote: Any, step: int) -> None:
        self.remote = remote
        self.step = step
        self.rank: int | None = None

    def fetch(self) -> Any:
        """The function's result as numpy values (waits for it, as TensorFlow's does)."""
        return self.remote.fetch()[0]

    def get(self) -> Any:
        """The function's result as tensors (waits for it, as TensorFlow's does)."""
        return self.remote.get()[0]


class StepBook:
    """Which worker ran which step, and the store's messages that say so: the coordinator's
    bookkeeping, apart from TensorFlow and the cluster (tested without either).

    Parameters
    ----------
    pids : every rank's pid, in rank order
    n_ps : ranks ``0..n_ps-1`` are parameter servers, the others workers
    """

    def __init__(self, pids: list[int], n_ps: int) -> None:
        self._pids = [int(p) for p in pids]
        self._rank_of_pid = {p: r for r, p in enumerate(self._pids)}
        self._index = {r: r - n_ps for r in range(n_ps, len(self._pids))}
        #: steps done per worker rank: finished steps collected so far
        self.steps: dict[int, int] = dict.fromkeys(self._index, 0)
        #: collected steps whose pid was no worker's (never expected; counted, not hidden)
        self.unplaced = 0

    def rank_of(self, pid: int) -> int | None:
        """The worker rank of process ``pid`` (None: no worker's)."""
        rank = self._rank_of_pid.get(int(pid))
        return rank if rank in self.steps else None

    def messages(
        self,
        done: list[tuple[int, Any, int]],
        now: float,
        idle: bool,
        rank_info: dict[int, dict[str, Any]],
    ) -> list[dict[str, Any]]:
        """Count ``done`` ((step, what it returned, pid), in schedule order) and return one
        ``metrics`` message per worker rank that ran any: ``loss`` and ``ps/steps`` rows,
        and the rank's role, index and steps done in its ``meta``."""
        cols: dict[int, dict[str, list[list[float]]]] = {}
        for step, out, pid in done:
            rank = self.rank_of(pid)
            if rank is None:
                self.unplaced += 1
                continue
            self.steps[rank] += 1
            mine = cols.setdefault(rank, {"ps/steps": [[], [], []]})
            for name, v in (("loss", loss_of(out)), ("ps/steps", float(self.steps[rank]))):
                if v is not None:
                    col = mine.setdefault(name, [[], [], []])
                    col[0].append(step)
                    col[1].append(now)
                    col[2].append(v)
        return [
            {
                "rank": rank,
                "cols": c,
                "step": int(c["ps/steps"][0][-1]),
                "idle": idle,
                "pid": self._pids[rank],
                "backend": rank_info.get(rank, {}).get("backend"),
                "meta": {
                    "tf_role": "worker",
                    "tf_index": self._index[rank],
                    "ps_steps": self.steps[rank],
                },
            }
            for rank, c in cols.items()
        ]


class ClusterCoordinator:
    """TensorFlow's ``tf.distribute.coordinator.ClusterCoordinator`` for a ``--tf-ps``
    cluster, with the steps each worker ran and their loss on the panel.

    Parameters
    ----------
    strategy : the ``tf.distribute.ParameterServerStrategy`` built on
        ``hvdnb.tf_cluster_resolver()``
    cluster : the cluster (default: ``hvdnb.current()``)

    Every other attribute is TensorFlow's coordinator's (``create_per_worker_dataset``,
    ...). Examples
    --------
    >>> coordinator = hvdnb.ClusterCoordinator(strategy)  # doctest: +SKIP
    >>> results = [coordinator.schedule(step, args=(it,)) for _ in range(200)]  # doctest: +SKIP
    >>> coordinator.join()  # doctest: +SKIP
    >>> coordinator.steps  # doctest: +SKIP
    {1: 104, 2: 96}
    """

    def __init__(self, strategy: Any, cluster: Cluster | None = None) -> None:
        c = ps_cluster(cluster)
        import tensorflow as tf  # noqa: PLC0415 (optional, and seconds to import)

        self._tf = tf
        self.strategy = strategy
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        pids = c.client[:].apply_sync(os.getpid)  # engine id is the rank
        self.book = StepBook(pids, int(c.spec.tf_ps or 0))
        #: steps scheduled so far (the next step's number)
        self.scheduled = 0
        self._pending: deque[Scheduled] = deque()
        self._wrapped: dict[Any, Any] = {}
        c.client[:].apply_sync(REPORT_ROLE)
        self._store: MetricsStore = attach(c)
        self._store.begin_cell(None)  # this coordinator's steps are one run
        self._run: int | None = None  # that run, once its first step is in

    def __getattr__(self, name: str) -> Any:
        if name == "coordinator":  # not made (its __init__ failed): no recursion
            raise AttributeError(name)
        return getattr(self.coordinator, name)

    def _wrap(self, fn: Callable[..., Any]) -> Any:
        w = self._wrapped.get(fn)
        if w is None:
            tf = self._tf

            def with_pid(*args: Any, **kwargs: Any) -> Any:
                pid = tf.strings.split(tf.io.read_file(_STAT))[0]
                return fn(*args, **kwargs), tf.strings.to_number(pid, tf.int64)

            w = self._wrapped[fn] = tf.function(with_pid)
        return w

    def schedule(self, fn: Callable[..., Any], args: Any = None, kwargs: Any = None) -> Scheduled:
        """Schedule ``fn`` on a free worker (TensorFlow's ``schedule``); never waits."""
        remote = self.coordinator.schedule(self._wrap(fn), args=args, kwargs=kwargs)
        s = Scheduled(remote, self.scheduled)
        self.scheduled += 1
        self._pending.append(s)
        return s

    def join(self) -> None:
        """Wait for every scheduled step (TensorFlow's ``join``), then put them on the panel."""
        self.coordinator.join()
        self._collect()
        self._store.end_cell("done")

    def done(self) -> bool:
        """Whether every scheduled step finished (TensorFlow's ``done``); if so they go on
        the panel."""
        finished = bool(self.coordinator.done())
        if finished:
            self._collect()
        return finished

    def fetch(self, value: Any) -> Any:
        """TensorFlow's ``fetch`` (of a value or a nest of them), also of what ``schedule``
        returned here."""
        tf, coordinator = self._tf, self.coordinator
        return tf.nest.map_structure(
            lambda v: v.fetch() if isinstance(v, Scheduled) else coordinator.fetch(v), value
        )

    @property
    def steps(self) -> dict[int, int]:
        """The finished steps collected so far, per worker rank."""
        return self.book.steps

    @property
    def unplaced(self) -> int:
        """Collected steps whose pid was no worker's (never expected; counted, not hidden)."""
        return self.book.unplaced

    def _collect(self) -> None:
        """Every finished pending step into the store: one message per worker rank."""
        done = []
        while self._pending:
            s = self._pending.popleft()
            out, pid = s.remote.fetch()
            s.rank = self.book.rank_of(pid)
            done.append((s.step, out, int(pid)))
        store = self._store
        msgs = self.book.messages(done, time.time(), not self._pending, store.rank_info)
        if not msgs:
            return
        if self._run is not None and store.run_id != self._run:
            store.begin_cell(None)  # a cell logged a run of its own since: a new one
        for msg in msgs:
            store.ingest(msg)
        self._run = store.run_id
        panel = get_panel(create=False)
        if panel is not None:  # an ordinary cell: no cell wait hook redraws it
            panel.tick()
