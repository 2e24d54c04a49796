"""Hugging Face Accelerate on the ranks: ``Accelerator()`` sees every rank.

Accelerate reuses a process group that exists and reads its place from torchrun's
variables, which hvdnb sets. Two of its own switches do the rest:

- ``ACCELERATE_USE_CPU=1`` on CPU ranks: without it Accelerate picks MULTI_CPU only when
  told to use the CPU, and on a machine without a GPU every rank trained alone, silently
  (``DistributedType.NO``). With a GPU per rank it is left unset (MULTI_GPU).
- ``FORK_LAUNCHED=1``, the flag of Accelerate's own notebook launcher: ``end_training()``
  then leaves the process group to whoever made it (hvdnb), and the next cell's collectives
  work.

``notebook_launcher(fn, args, num_processes)`` in a cell runs ``fn(*args)`` once on each
rank when ``num_processes`` is the number of ranks on this host (or not given), and raises
at once otherwise: it never forks. That one is a patch (written for accelerate 1.15), as
Accelerate has no seam for it.

``tracker()`` (``hvdnb.accelerate_tracker()``) is a ``GeneralTracker`` for
``Accelerator(log_with=...)``: what ``accelerator.log`` logs (on the main process only, as
Accelerate calls trackers) reaches the panel, a ``loss`` as ``loss_main``.

Never: import accelerate before the user does.
"""

from __future__ import annotations

from typing import Any

from hvdnb.extras import require
from hvdnb.protocol.kinds import MAIN_LOSS
from hvdnb.rank.frameworks.common import Place, note, on_import, setdefault_env, warn_version

__all__ = [
    "install",
    "move",
    "tracker",
]

_PLACE: Place | None = None


def install(p: Place) -> None:
    """Set Accelerate's switches for this rank; hook ``notebook_launcher`` on its import."""
    global _PLACE
    _PLACE = p
    if p.device == "cpu":
        setdefault_env(ACCELERATE_USE_CPU="1")
    setdefault_env(FORK_LAUNCHED="1")
    on_import("accelerate", _hook)


def _hook(accelerate: Any) -> None:
    warn_version("accelerate")
    import accelerate.launchers as launchers  # noqa: PLC0415  accelerate is imported already (post-import hook)

    launchers.notebook_launcher = _notebook_launcher
    accelerate.notebook_launcher = _notebook_launcher


def _notebook_launcher(
    function: Any, args: tuple[Any, ...] = (), num_processes: Any = None, **_: Any
) -> None:
    p = _PLACE
    assert p is not None
    if num_processes is not None and int(num_processes) != p.local_size:
        raise ValueError(
            f"accelerate.notebook_launcher(num_processes={num_processes}) on rank {p.rank}: "
            f"this cell already runs on every rank, {p.local_size} on this host ({p.size} in "
            f"all), and hvdnb forks no processes inside a rank. Call notebook_launcher(fn, "
            f"args, num_processes={p.local_size}), or call fn(*args) directly; for "
            f"{num_processes} ranks, %dist restart -n {num_processes}"
        )
    note(f"accelerate.notebook_launcher: the function runs once on each of the {p.size} ranks")
    function(*args)


def tracker() -> Any:
    """A tracker for ``Accelerator(log_with=hvdnb.accelerate_tracker())``.

    Each ``accelerator.log(values, step=...)`` sends ``values`` to the panel from the main
    process (Accelerate calls trackers there only): a ``loss`` becomes ``loss_main``, drawn
    as the main process's loss (a mean over ranks when the code logs one); every other
    number keeps its name. Without ``step`` the calls are counted.

    Returns
    -------
    accelerate.tracking.GeneralTracker

    Raises
    ------
    ModuleNotFoundError
        accelerate is not installed (the message names ``pip install 'hvdnb[frameworks]'``).

    Examples
    --------
    >>> accelerator = Accelerator(log_with=hvdnb.accelerate_tracker())   # doctest: +SKIP
    >>> accelerator.init_trackers("my-run")                              # doctest: +SKIP
    >>> accelerator.log({"loss": loss.item()}, step=step)                # doctest: +SKIP
    """
    tracking = require("accelerate.tracking", "hvdnb.accelerate_tracker")
    GeneralTracker = tracking.GeneralTracker

    from hvdnb.rank.metrics.recorder import log  # noqa: PLC0415  the recorder, on first use

    class HvdnbTracker(GeneralTracker):  # type: ignore[misc, valid-type]
        name = "hvdnb"
        requires_logging_directory = False
        main_process_only = True

        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        @property
        def tracker(self) -> Any:
            return self

        def store_init_configuration(self, values: dict[str, Any]) -> None:
            pass

        def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
            self.calls += 1
            nums = {k: float(v) for k, v in values.items() if _is_number(v)}
            if "loss" in nums:
                nums[MAIN_LOSS] = nums.pop("loss")
            if nums:
                log(self.calls - 1 if step is None else int(step), **nums)

    return HvdnbTracker()


def _is_number(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return not isinstance(v, (str, bytes))


def move(p: Place) -> None:
    """The rank's place changed (an elastic cluster's new generation)."""
    global _PLACE
    if _PLACE is not None:
        _PLACE = p
