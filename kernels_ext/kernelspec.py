"""The "Python 3 (hvdnb)" kernelspec: kept at this path for code that imported it here.

The writer lives in ``hvdnb.notebook.headless.kernelspec`` (``hvdnb run`` and ``hvdnb
install-kernel`` use it); ``kernels_ext`` sits on hvdnb and never the reverse.
"""

from __future__ import annotations

from hvdnb.notebook.headless.kernelspec import DISPLAY_NAME, KERNEL_NAME, get_kernel_dict, install

__all__ = ["DISPLAY_NAME", "KERNEL_NAME", "get_kernel_dict", "install"]
