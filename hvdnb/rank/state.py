"""Training state that survives ``%dist restart`` (Horovod elastic's State idea).

``state = hvdnb.State(model=model, optimizer=opt, step=0, epoch=0)`` on every rank, then
``state.commit()`` every so often; if a rank dies (killed, out of memory) and the cluster
is restarted, running the same cell again finds the last commit and loads it: the model,
optimizer (anything with ``state_dict``/``load_state_dict``) and the plain fields, so at
most one commit interval of work is lost.

Each rank writes its own snapshot (``rank{R}-of-{N}.pt``, atomically: temp file + rename)
into ``$HVDNB_STATE_DIR``, a 0700 directory that ``hvdnb.Cluster`` creates and keeps
across restarts (it is removed by ``%dist stop``).

In an elastic loop (``hvdnb.elastic.run(train)(state)``) the same object is Horovod's
elastic state too: each commit is also kept in memory, ``restore`` after a lost rank
loads that copy, ``sync`` gives every rank rank 0's objects and fields, and a commit raises
``HostsUpdatedInterrupt`` on every rank when the cluster's membership changed.

Never: issue a collective outside ``sync`` and a commit's membership check (which only an
elastic loop makes), or load a snapshot made for another world size from disk.
"""

from __future__ import annotations

import copy
import os
import queue
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hvdnb.rank import elastic

__all__ = ["State"]

_RESERVED = {
    "_objects",
    "_fields",
    "_memory",
    "_host_messages",
    "_last_updated",
    "_reset_callbacks",
    "_check",
    "restored",
    "commits",
    "path",
    "committed_at",
}


def _state_dir() -> Path:
    d = os.environ.get("HVDNB_STATE_DIR")
    if d:
        return Path(d)
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"hvdnb-state-{uid}"


def _is_stateful(obj: Any) -> bool:
    return hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")


class State:
    """Objects and fields to commit on every rank and restore after a restart.

    Parameters
    ----------
    **kwargs : objects with ``state_dict``/``load_state_dict`` (models, optimizers,
        schedulers) and plain fields (step, epoch, best loss, ...: anything torch.save
        can store). Fields read and write as attributes: ``state.step += 1``.

    Examples
    --------
    >>> state = hvdnb.State(model=model, optimizer=opt, step=0)   # doctest: +SKIP
    >>> while state.step < 1000:                                  # doctest: +SKIP
    ...     train_one_step(); state.step += 1
    ...     if state.step % 100 == 0:
    ...         state.commit()
    """

    def __init__(self, **kwargs: Any) -> None:
        objects = {k: v for k, v in kwargs.items() if _is_stateful(v)}
        fields = {k: v for k, v in kwargs.items() if k not in objects}
        bad = _RESERVED.intersection(kwargs)
        if bad:
            raise ValueError(f"hvdnb.State: {sorted(bad)} are reserved names; pick others")
        object.__setattr__(self, "_objects", objects)
        object.__setattr__(self, "_fields", fields)
        object.__setattr__(self, "restored", False)
        object.__setattr__(self, "commits", 0)
        object.__setattr__(self, "committed_at", None)
        object.__setattr__(self, "_memory", None)  # the last commit, for an elastic restore
        object.__setattr__(self, "_host_messages", queue.Queue())
        object.__setattr__(self, "_last_updated", 0.0)
        object.__setattr__(self, "_reset_callbacks", [])
        object.__setattr__(self, "_check", elastic.HostCheck())
        rank = os.environ.get("RANK", "0")
        size = os.environ.get("WORLD_SIZE", "1")
        object.__setattr__(self, "path", _state_dir() / f"rank{rank}-of-{size}.pt")
        # a rank that joined a running elastic cluster has no commit of its own: the file
        # under its rank number is another engine's, of an earlier generation; it takes
        # rank 0's state at its elastic loop's first sync
        if self.path.exists() and os.environ.get("HVDNB_ELASTIC_JOIN") != "1":
            self.restore()

    def __getattr__(self, name: str) -> Any:
        fields = object.__getattribute__(self, "_fields")
        if name in fields:
            return fields[name]
        objects = object.__getattribute__(self, "_objects")
        if name in objects:
            return objects[name]
        raise AttributeError(f"hvdnb.State has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._objects:
            self._objects[name] = value
        else:
            self._fields[name] = value

    def commit(self) -> None:
        """Snapshot every object and field to this rank's file (atomic)."""
        import torch  # noqa: PLC0415  torch is heavy: loaded when first used

        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        snap = {
            "objects": {k: v.state_dict() for k, v in self._objects.items()},
            "fields": dict(self._fields),
            "time": time.time(),
        }
        if elastic.enabled():  # the restore after a lost rank; a fixed cluster reads the file
            object.__setattr__(self, "_memory", copy.deepcopy(snap))
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        torch.save(snap, tmp)
        os.replace(tmp, self.path)
        object.__setattr__(self, "commits", self.commits + 1)
        object.__setattr__(self, "committed_at", snap["time"])
        if elastic.in_loop():  # every rank of the loop commits at the same step
            self.check_host_updates()

    def restore(self) -> bool:
        """Load the last commit into the objects and fields; False when there is none.
        In an elastic loop the commit kept in memory is loaded (the rank's number and the
        world's size may have changed since: the file is named for the old ones)."""
        import torch  # noqa: PLC0415  torch is heavy: loaded when first used

        if self._memory is not None:
            self._load(copy.deepcopy(self._memory))
            return True
        if not self.path.exists():
            return False
        snap = torch.load(self.path, map_location="cpu", weights_only=False)
        missing = set(self._objects) - set(snap["objects"])
        if missing:
            raise ValueError(
                f"hvdnb.State: the last commit has no {sorted(missing)}; it was made with "
                f"{sorted(snap['objects'])}. Use the same names, or state.clear() to start over."
            )
        for k, obj in self._objects.items():
            obj.load_state_dict(snap["objects"][k])
        self._fields.update(snap["fields"])
        object.__setattr__(self, "restored", True)
        object.__setattr__(self, "committed_at", snap["time"])
        age = time.time() - snap["time"]
        shown = ", ".join(f"{k}={v!r}" for k, v in snap["fields"].items() if _short(v))
        print(f"hvdnb.State: restored the commit from {age:.0f} s ago ({shown})", flush=True)
        return True

    def _load(self, snap: dict[str, Any]) -> None:
        for k, obj in self._objects.items():
            if k in snap["objects"]:
                obj.load_state_dict(snap["objects"][k])
        self._fields.update(snap["fields"])
        object.__setattr__(self, "restored", True)

    # ------------------------------------------------------------------ elastic
    def sync(self) -> None:
        """Give every rank rank 0's objects and fields (collective: the start of an
        elastic loop, and after each reset); then keep them as the commit in memory."""
        import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

        snap = {
            "objects": {k: v.state_dict() for k, v in self._objects.items()},
            "fields": dict(self._fields),
            "time": time.time(),
        }
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [snap]
            dist.broadcast_object_list(box, src=0)
            snap = box[0]
            self._load(snap)
        object.__setattr__(self, "restored", False)
        object.__setattr__(self, "_memory", copy.deepcopy(snap))

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after every reset of an elastic loop."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        object.__setattr__(self, "_host_messages", queue.Queue())
        self._check.drop()
        for cb in self._reset_callbacks:
            cb()

    def on_hosts_updated(self, timestamp: float, removed: bool) -> None:
        self._host_messages.put((timestamp, removed))

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank at the same commit when rank 0
        heard of a membership change (``elastic.HostCheck``: agreed a commit or more late)."""
        got = self._check.check(self._last_updated, self._host_messages, None)
        if got is not None:
            object.__setattr__(self, "_last_updated", got[0])
            raise elastic.HostsUpdatedInterrupt(got[1])

    def clear(self) -> None:
        """Forget this rank's commit (the next State starts fresh)."""
        self.path.unlink(missing_ok=True)

    def __repr__(self) -> str:
        return (
            f"<hvdnb.State objects={sorted(self._objects)} fields={self._fields} "
            f"commits={self.commits} restored={self.restored}>"
        )


def _short(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool)) and len(repr(v)) < 40
