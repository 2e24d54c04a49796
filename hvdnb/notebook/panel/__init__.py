"""The notebook's live panel (ipywidgets + inline SVG, matplotlib for the saved picture).

Modules, each importing only those before it: ``kernel`` (subshell, comm routing, idle
timer), ``charts`` (one data model per chart), ``svg`` (the live picture), ``png`` (the
saved picture), ``tables`` (header and tables), ``controls`` (knob and view controls),
``layout`` (the ``Panel`` widget tree and redraw schedule), ``liveline`` (the line under
the running cell) and ``panel`` (the kernel's one panel: ``get_panel``, ``show_panel``).
Nothing here is imported on engines.
"""

from __future__ import annotations

from hvdnb.notebook.panel.panel import Panel, get_panel, show_panel

__all__ = ["Panel", "get_panel", "show_panel"]
