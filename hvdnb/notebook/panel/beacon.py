"""What the page drew: a widget that tells the kernel when one of its views renders.

A kernel never sees the page. Whether the panel opened beside the notebook depends on the
front end: JupyterLab with jupyterlab-sidecar draws it in a split of the main area;
Jupyter Notebook 7 has no such area, and a server without the sidecar extension cannot
make its model. In both, the kernel's messages go out the same way and nothing comes
back. So the panel does not guess: beside it, in the side area's output, sits a
``Beacon``, an anywidget whose view sends one message (``{"rendered": ...}``) once a page
shows it (rendered, and in no area the page hides); it takes no room. No message within
``REPORT_WITHIN`` seconds of the panel being opened there, and the ``%dist start`` cell
shows the panel itself (``hvdnb.notebook.panel.layout``).

Owns: the beacon's view code and what it heard. Never: draw anything visible, or need a
build step (anywidget ships its front end as a prebuilt extension).
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["REPORT_WITHIN", "make_beacon"]

#: seconds a page has to report the side area's view before the cell shows the panel
#: (JupyterLab draws the side area ~0.3 s after the kernel opens it; a loaded page 1 s)
REPORT_WITHIN = 2.5

#: the view: reports once it is on the page and shown (connected, laid out, in no hidden
#: area); a front end may draw it in an area it never shows (Notebook 7 puts the side area
#: in its main area, behind the notebook), which is not "beside the notebook"
_ESM = """
function shown(el) {
  return el.isConnected && el.getClientRects().length > 0 && !el.closest(".lm-mod-hidden");
}
function render({ model, el }) {
  el.style.height = "0px";
  el.style.overflow = "hidden";
  let tries = 0;
  const look = () => {
    if (shown(el)) {
      model.send({ rendered: model.get("where"), at: Date.now() });
    } else if (tries++ < 40) {
      setTimeout(look, 250);
    }
  };
  setTimeout(look, 0);
}
export default { render };
"""


def make_beacon(where: str) -> Any:
    """A beacon for the place ``where``, or None when anywidget is not installed (then no
    page can report, and the panel is shown in the cell)."""
    try:
        import anywidget  # noqa: PLC0415  the front end's report: only when a panel is shown
        import traitlets  # noqa: PLC0415  ipywidgets' own dependency
    except ImportError:
        return None

    class Beacon(anywidget.AnyWidget):
        _esm = _ESM
        where = traitlets.Unicode("").tag(sync=True)

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.heard: list[float] = []  # time.monotonic() of each view's report
            #: called after each report, on the thread that took it (the cell that
            #: opened the panel may have ended: nothing else would follow the report)
            self.listeners: list[Any] = []
            self._lock = threading.Lock()
            self.on_msg(self._on_report)

        def _on_report(self, _w: Any, content: Any, _buffers: Any) -> None:
            if isinstance(content, dict) and "rendered" in content:
                with self._lock:
                    self.heard.append(time.monotonic())
                for fn in list(self.listeners):
                    try:
                        fn()
                    except Exception:  # a report never breaks the kernel's comm handling
                        pass

        def heard_since(self, t: float) -> bool:
            """Has a view reported since ``t`` (``time.monotonic()``)?"""
            with self._lock:
                return any(h >= t for h in self.heard)

    return Beacon(where=where)
