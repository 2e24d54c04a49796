"""The record of a ``%%distributed`` cell that ran, kept on the cluster (``Cluster.history``)
for ``%dist export`` (``hvdnb.notebook.headless.export``), which reads it: the cell's side
writes it and never imports the export. Never: hold a cell's output or values."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ExportCell"]


@dataclass
class ExportCell:
    """One ``%%distributed`` cell as it ran."""

    number: int  # the session's cell number (or the notebook's execution count)
    code: str  # the cell's body (without the %%distributed line)
    ranks: list[int] | None  # the ranks it ran on; None: all
    ok: bool  # every rank ran it without an error
