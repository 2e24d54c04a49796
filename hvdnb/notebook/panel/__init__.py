"""The notebook's live panel (ipywidgets + matplotlib). Nothing here is imported on engines."""

from __future__ import annotations

from hvdnb.notebook.panel.panel import Panel, get_panel, show_panel

__all__ = ["Panel", "get_panel", "show_panel"]
