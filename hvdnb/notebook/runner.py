"""Execute a notebook headless with hvdnb's kernel (``hvdnb run``, the notebook tests).

Owns: a throw-away "Python 3 (hvdnb)" kernelspec for this Python (so the run never
depends on what kernels happen to be installed), the rank count handed to ``%dist start``
(``HVDNB_RANKS``), and stopping the notebook's cluster when the kernel goes away.

Never: modify the input notebook in place unless asked to (``output`` = the same path).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

__all__ = ["NotebookRunError", "run_notebook"]


class NotebookRunError(RuntimeError):
    """A cell of the notebook raised; the message names the cell and the error."""


def run_notebook(
    path: str | os.PathLike[str],
    n: int | None = None,
    output: str | os.PathLike[str] | None = None,
    timeout: float = 600,
    oversubscribe: bool = False,
) -> Path:
    """Run every cell of ``path`` with a cluster of ``n`` ranks; save the executed copy.

    ``oversubscribe`` lets ``%dist start`` put more ranks on the host than it has GPUs (or
    cores): e.g. a 2-rank notebook on a 1-GPU machine (the ranks share it over gloo).

    Returns the path of the executed notebook (default: ``<name>.out.ipynb`` beside it).
    """
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    from kernels_ext.kernelspec import KERNEL_NAME, get_kernel_dict

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no notebook at {path}")
    out = Path(output) if output else path.with_suffix(".out.ipynb")
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as td:
        kdir = Path(td, "kernels", KERNEL_NAME)
        kdir.mkdir(parents=True)
        spec = get_kernel_dict()
        if n is not None:
            spec["env"]["HVDNB_RANKS"] = str(n)
        if oversubscribe:
            spec["env"]["HVDNB_OVERSUBSCRIBE"] = "1"
        (kdir / "kernel.json").write_text(json.dumps(spec))
        km = KernelManager(
            kernel_name=KERNEL_NAME,
            kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kdir.parent)]),
        )
        client = NotebookClient(
            nb,
            km=km,
            timeout=timeout,
            resources={"metadata": {"path": str(path.parent.resolve())}},
        )
        try:
            client.execute()
        except CellExecutionError as exc:
            nbformat.write(nb, out)
            raise NotebookRunError(f"{path.name}: {exc}") from None
    nbformat.write(nb, out)
    return out
