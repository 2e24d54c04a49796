"""``hvdnb.metrics(...).to_tensorboard(DIR)``: rows as TensorBoard event files.

Owns: ``RunRows`` (the rows ``hvdnb.metrics()`` returns: ``MetricRows`` plus
``to_tensorboard`` and ``to_trackio``, which ``trackio_export`` writes) and the TensorBoard
export: one event file per run and rank
(``DIR/run<N>/rank<R>``), every series a scalar tag with its step and wall time, and each
run's starting knob values as TensorBoard hyperparameters (the HPARAMS tab), written with
torch's ``SummaryWriter`` (which needs the ``tensorboard`` package).

Never: import torch or tensorboard before an export is asked for.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hvdnb.notebook.metrics.rows import MetricRows
from hvdnb.notebook.metrics.trackio_export import write_trackio

__all__ = ["RunRows", "write_tensorboard"]


class RunRows(MetricRows):
    """``MetricRows`` with ``to_tensorboard`` and ``to_trackio``.

    ``record``: the run store's record when the rows are one stored run
    (``hvdnb.metrics(run=ID)``), else None; copied from ``rows`` when it has one.
    """

    def __init__(self, rows: Any = (), record: dict[str, Any] | None = None) -> None:
        super().__init__(rows)
        self.record: dict[str, Any] | None = (
            record if record is not None else getattr(rows, "record", None)
        )

    def to_trackio(self, project: str, dir: str | Path | None = None) -> Path:
        """Write the rows into trackio project ``project``; returns its database file.

        Parameters
        ----------
        project : the trackio project (``trackio show --project PROJECT``)
        dir : trackio's directory; default ``$TRACKIO_DIR``, else
            ``~/.cache/huggingface/trackio`` (under ``$HF_HOME`` when set)

        Each run becomes a trackio run (named by its run store id, or ``run<N>`` for this
        session's rows), every series per rank a metric (``loss/rank0``), its knobs at
        the start its config. Exporting a run again replaces it; other runs of the
        project are left alone.

        Examples
        --------
        >>> hvdnb.metrics(run="a3f9c1-2").to_trackio("tuning")   # doctest: +SKIP
        PosixPath('/home/me/.cache/huggingface/trackio/tuning.db')
        """
        return write_trackio(self, project, dir, self.record)

    def to_tensorboard(self, path: str | Path) -> Path:
        """Write the rows as TensorBoard event files under ``path``; returns it.

        ``tensorboard --logdir PATH`` shows each rank's series (``run<N>/rank<R>``) and,
        under HPARAMS, each run's knob values with its last mean loss.
        """
        return write_tensorboard(self, Path(path))


def write_tensorboard(rows: MetricRows, path: Path) -> Path:
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415  torch is heavy: loaded when first used
        from torch.utils.tensorboard.summary import hparams  # noqa: PLC0415  torch is heavy: loaded when first used
    except ImportError as exc:
        raise ImportError(
            f"to_tensorboard() needs torch and tensorboard ({exc}): pip install tensorboard"
        ) from None
    path.mkdir(parents=True, exist_ok=True)
    by: dict[tuple[int, int], list[Any]] = {}
    for r in rows:
        by.setdefault((r.run, r.rank), []).append(r)
    for (run, rank), rs in sorted(by.items()):
        w = SummaryWriter(log_dir=str(path / f"run{run}" / f"rank{rank}"))
        try:
            for r in rs:
                if not math.isnan(r.value):
                    w.add_scalar(r.name, r.value, r.step, walltime=r.time)
            if rank == min(k[1] for k in by if k[0] == run):
                knobs = {
                    k: v
                    for k, v in (rs[0].knobs or {}).items()
                    if isinstance(v, (int, float, str, bool))
                }
                losses = [r.value for r in rs if r.name == "loss" and r.value == r.value]
                last = losses[-1] if losses else math.nan
                exp, ssi, sei = hparams(  # type: ignore[no-untyped-call]
                    knobs or {"run": run}, {"hparam/last_loss": last}
                )
                w.add_scalar("hparam/last_loss", last, rs[-1].step)
                fw = w._get_file_writer()  # type: ignore[no-untyped-call]
                for summary in (exp, ssi, sei):
                    fw.add_summary(summary)
        finally:
            w.close()
    return path
