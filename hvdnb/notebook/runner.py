"""Execute a notebook headless with hvdnb's kernel (``hvdnb run``, the notebook tests), or
drive that kernel cell by cell as JupyterLab does (``Kernel``: benchmarks, tests).

Owns: a throw-away "Python 3 (hvdnb)" kernelspec for this Python (so the run never
depends on what kernels happen to be installed), the rank count handed to ``%dist start``
(``HVDNB_RANKS``), and stopping the notebook's cluster when the kernel goes away.

Never: modify the input notebook in place unless asked to (``output`` = the same path).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Kernel", "NotebookRunError", "run_notebook"]


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
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no notebook at {path}")
    out = Path(output) if output else path.with_suffix(".out.ipynb")
    nb = nbformat.read(path, as_version=4)
    env = {"HVDNB_RANKS": str(n)} if n is not None else {}
    if oversubscribe:
        env["HVDNB_OVERSUBSCRIBE"] = "1"
    with tempfile.TemporaryDirectory() as td:
        km = _kernel_manager(td, env)
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


def _kernel_manager(td: str, env: dict[str, str]) -> Any:
    """A KernelManager for a "Python 3 (hvdnb)" kernelspec written under ``td`` for this
    Python, with ``env`` added to the kernel's environment."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    from kernels_ext.kernelspec import KERNEL_NAME, get_kernel_dict

    kdir = Path(td, "kernels", KERNEL_NAME)
    kdir.mkdir(parents=True)
    spec = get_kernel_dict()
    spec["env"].update(env)
    (kdir / "kernel.json").write_text(json.dumps(spec))
    return KernelManager(
        kernel_name=KERNEL_NAME,
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kdir.parent)]),
    )


@dataclass
class CellRun:
    """One cell executed by ``Kernel.run``."""

    seconds: float  #: from the execute request to the kernel's idle status for it
    first_stream: float | None  #: from the request to its first output (stream or display)
    text: str  #: every stream message's text, in order
    error: str | None  #: "ename: evalue" of an error reply
    displays: int  #: display_data / update_display_data messages
    #: the latest text/plain of each display (by display id; ``%%px`` shows output so)
    displayed: dict[str, str] = field(default_factory=dict)


class Kernel:
    """The "Python 3 (hvdnb)" kernel, started from its kernelspec and driven over
    jupyter_client as JupyterLab drives it: execute requests on the shell channel, every
    IOPub message of a request read until the kernel's ``idle`` status for it.

    Examples
    --------
    >>> with Kernel({"HVDNB_PANEL": "inline"}) as k:          # doctest: +SKIP
    ...     k.run("%dist start -n 2")
    ...     print(k.run("%%distributed\nprint(1)").text)
    """

    def __init__(self, env: dict[str, str] | None = None, timeout: float = 120) -> None:
        self._td = tempfile.TemporaryDirectory()
        self.km = _kernel_manager(self._td.name, dict(env or {}))
        self.km.start_kernel()
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=timeout)

    def run(self, code: str, timeout: float = 300.0) -> CellRun:
        """Execute ``code`` and wait for the kernel's idle status for it."""
        import queue

        t0 = time.perf_counter()
        msg_id = self.kc.execute(code)
        first: float | None = None
        text: list[str] = []
        error = None
        displays = 0
        displayed: dict[str, str] = {}
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no idle after {timeout} s for {code[:40]!r}") from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                if first is None:
                    first = time.perf_counter() - t0
                text.append(content["text"])
            elif kind in ("display_data", "update_display_data"):
                displays += 1
                if first is None:
                    first = time.perf_counter() - t0
                key = (content.get("transient") or {}).get("display_id") or f"#{displays}"
                displayed[key] = content.get("data", {}).get("text/plain", "")
            elif kind == "error":
                error = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle":
                return CellRun(
                    time.perf_counter() - t0, first, "".join(text), error, displays, displayed
                )

    def close(self) -> None:
        """Stop the notebook's cluster (if any) and the kernel."""
        try:
            self.run("%dist stop", timeout=60)
        except Exception:
            pass
        finally:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=False)
            self._td.cleanup()

    def __enter__(self) -> Kernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
