"""The "Python 3 (hvdnb)" kernelspec, built by code as ipykernel builds its own.

The kernel starts with the hvdnb extension loaded (``%dist`` and ``%%distributed`` ready)
and with this environment's ``bin/`` first on PATH, so ``mpiexec`` and the engines come
from the same environment as the kernel even when JupyterLab was started from another.

Never: write outside the chosen prefix or user directory; it only writes a kernel.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["DISPLAY_NAME", "KERNEL_NAME", "get_kernel_dict", "install"]

KERNEL_NAME = "hvdnb"
DISPLAY_NAME = "Python 3 (hvdnb)"


def get_kernel_dict(executable: str | None = None) -> dict[str, Any]:
    """The kernel.json content for this Python."""
    exe = executable or sys.executable
    bindir = str(Path(exe).parent)
    return {
        "argv": [
            exe,
            "-m",
            "ipykernel_launcher",
            "-f",
            "{connection_file}",
            "--ext=kernels_ext.autoload",
        ],
        "display_name": DISPLAY_NAME,
        "language": "python",
        "env": {"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"},
        "metadata": {"debugger": True},
    }


def install(user: bool = False, prefix: str | None = None) -> str:
    """Install the kernelspec; returns the directory it was written to.

    Parameters
    ----------
    user : install for this user (``~/.local/share/jupyter``) instead of this environment
    prefix : install under this prefix (default: ``sys.prefix`` unless ``user``)
    """
    from jupyter_client.kernelspec import KernelSpecManager  # noqa: PLC0415  Jupyter's libraries: only for hvdnb run and the kernelspec

    if not user and prefix is None:
        prefix = sys.prefix
    with tempfile.TemporaryDirectory() as td:
        Path(td, "kernel.json").write_text(json.dumps(get_kernel_dict(), indent=1))
        return KernelSpecManager().install_kernel_spec(
            td, KERNEL_NAME, user=user, prefix=None if user else prefix, replace=True
        )
