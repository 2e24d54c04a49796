"""Loaded by the "Python 3 (hvdnb)" kernel at start (``--ext=kernels_ext.autoload``).

It registers hvdnb's magics under its own name, so a notebook's own ``%load_ext hvdnb``
(kept so notebooks also run in a plain Python kernel) loads quietly instead of printing
"already loaded".
"""

from __future__ import annotations

import os
from typing import Any

from hvdnb.notebook.cellout import automode, introspect
from hvdnb.notebook.debug import router
from hvdnb.notebook.ipython.magics import DistMagics


def load_ipython_extension(ipython: Any) -> None:
    # TensorFlow's C++ INFO log at import (a dozen "I0000 ..." lines); the kernel imports
    # TensorFlow when a rank's value of a Keras type is shown here. The user's level is kept
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    ipython.register_magics(DistMagics)
    automode.install(ipython)
    introspect.install(ipython)
    router.install(ipython)  # JupyterLab's visual debugger reaches the ranks
