"""The notebook's one panel: made on first use, hooked to the running cells, and shown.

``get_panel`` makes the kernel's ``Panel`` (``hvdnb.notebook.panel.layout``) and registers
its redraw (and, with a kernel, the live line under the running cell,
``hvdnb.notebook.panel.liveline``) as the cells' wait hooks; ``show_panel`` attaches the
store to a cluster and shows the panel where ``HVDNB_PANEL`` (or ``inline=``) says:
beside the notebook (default), in the cell's output, or not at all.

Runs: the panel overlays the last runs' mean loss (x: step or samples seen), each labelled
with its knob values and changes, the changes marked; "clear old runs" takes all but the
newest off the chart (their points stay in ``hvdnb.metrics()``).

Many ranks (more than ``charts.MAX_LINES``): the loss chart draws the min/max band and
median over all ranks plus one median line per host, and a table gives each host's
min/max (loss, step, step time); per-rank tables show the first ranks only.

Owns: the kernel's panel instance. Never: make a second panel, show anything outside a
Jupyter front end when asked not to (``only_with_frontend``), or import torch.
"""

from __future__ import annotations

from typing import Any

from hvdnb.config import get_config
from hvdnb.notebook.cellout import cells
from hvdnb.notebook.metrics.store import attach
from hvdnb.notebook.panel import kernel as _kernel
from hvdnb.notebook.panel.layout import Panel
from hvdnb.notebook.panel.liveline import LiveLine

__all__ = ["Panel", "flush_pictures", "get_panel", "show_panel"]

_PANEL: Panel | None = None


def get_panel(create: bool = True) -> Panel | None:
    """The notebook's panel (created on first use, registered as a cell wait hook)."""
    global _PANEL
    if _PANEL is None and create:
        _PANEL = Panel()
        cells.add_wait_hook(_PANEL.tick)
        if _kernel.kernel() is not None:  # a terminal would print every update
            _PANEL.line = LiveLine(_PANEL.store)
            _PANEL.line.on_end = _PANEL.cell_ended
            cells.add_wait_hook(_PANEL.line)
            _deliver_around_cells(_PANEL)
    return _PANEL


def flush_pictures(wait: float = 10.0) -> int:
    """Put every training cell's picture still drawing under its line, and bring the
    ``%dist start`` cell's picture up to date (``hvdnb run`` calls it after the last cell;
    ``%dist stop`` does it too). Returns how many cell pictures were put."""
    p = get_panel(create=False)
    if p is None:
        return 0
    put = p.deliver_cell_pictures(wait=wait)
    p.snapshot(if_stale=True)
    return put


def _deliver_around_cells(panel: Panel) -> None:
    """Put drawn cell pictures in before and after every cell too (IPython's events), with
    that cell's parent header: a headless run (nbclient) reads only the running cell's
    messages, and applies a display update to the earlier cell it names."""
    try:
        from IPython import get_ipython  # noqa: PLC0415  IPython: only inside a kernel

        ip = get_ipython()
    except Exception:
        return
    if ip is None:
        return

    def deliver(*_: Any) -> None:
        if panel._cell_pics:
            panel.deliver_cell_pictures()

    ip.events.register("pre_run_cell", deliver)
    ip.events.register("post_run_cell", deliver)


def show_panel(
    cluster: Any = None, *, inline: bool | None = None, only_with_frontend: bool = False
) -> Panel | None:
    """Attach the store to ``cluster`` and display the panel.

    Parameters
    ----------
    cluster : the cluster to watch (default: ``hvdnb.current()``)
    inline : True: in this cell's output; False: beside the notebook (JupyterLab); None:
        as configured (``HVDNB_PANEL``: side, inline or off; default side)
    only_with_frontend : do nothing visible outside a Jupyter kernel (plain IPython, tests)
    """

    attach(cluster)
    if only_with_frontend and _kernel.kernel() is None:
        return None
    mode = get_config().panel.strip().lower()
    if mode not in ("side", "inline", "off"):
        raise ValueError(f"HVDNB_PANEL={mode!r}: use side, inline or off")
    if inline is None and mode == "off":
        return None
    p = get_panel()
    assert p is not None
    side = not inline if inline is not None else mode == "side"
    if side:
        try:
            import sidecar  # noqa: F401, PLC0415  sidecar is optional: only when the panel is shown beside the notebook
        except ImportError:
            print(
                "hvdnb: jupyterlab-sidecar is not installed (pip install sidecar); "
                "showing the panel here"
            )
            side = False
    p.show(inline=not side)
    return p
