"""Training state that survives ``%dist restart`` (Horovod elastic's State idea).

``state = hvdnb.State(model=model, optimizer=opt, step=0, epoch=0)`` on every rank, then
``state.commit()`` every so often; if a rank dies (killed, out of memory) and the cluster
is restarted, running the same cell again finds the last commit and loads it: the model,
optimizer (anything with ``state_dict``/``load_state_dict``) and the plain fields, so at
most one commit interval of work is lost.

Each rank writes its own snapshot (``rank{R}-of-{N}.pt``, atomically: temp file + rename)
into ``$HVDNB_STATE_DIR``, a 0700 directory that ``hvdnb.Cluster`` creates and keeps
across restarts (it is removed by ``%dist stop``).

Never: issue a collective (commit and restore are local to each rank), or load a snapshot
made for another world size.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["State"]

_RESERVED = {"_objects", "_fields", "restored", "commits", "path", "committed_at"}


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
        rank = os.environ.get("RANK", "0")
        size = os.environ.get("WORLD_SIZE", "1")
        object.__setattr__(self, "path", _state_dir() / f"rank{rank}-of-{size}.pt")
        if self.path.exists():
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
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        torch.save(snap, tmp)
        os.replace(tmp, self.path)
        object.__setattr__(self, "commits", self.commits + 1)
        object.__setattr__(self, "committed_at", snap["time"])

    def restore(self) -> bool:
        """Load the last commit into the objects and fields; False when there is none."""
        import torch  # noqa: PLC0415  torch is heavy: loaded when first used

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
