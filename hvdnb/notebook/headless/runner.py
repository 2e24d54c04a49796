"""Execute a notebook headless with hvdnb's kernel (``hvdnb run``, the notebook tests), or
drive that kernel cell by cell as JupyterLab does (``Kernel``: benchmarks, tests).

Owns: a throw-away "Python 3 (hvdnb)" kernelspec for this Python (so the run never
depends on what kernels happen to be installed), the rank count handed to ``%dist start``
(``HVDNB_RANKS``), and stopping the notebook's cluster when the kernel goes away.

Never: modify the input notebook in place unless asked to (``output`` = the same path).
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from hvdnb.config import get_config
from hvdnb.notebook.headless.kernelspec import KERNEL_NAME, get_kernel_dict

__all__ = ["Kernel", "NotebookRunError", "run_notebook"]

#: exit status of ``hvdnb run`` when a cell ran past ``--timeout`` (as coreutils' timeout)
TIMEOUT_EXIT = 124
#: seconds a timed-out ``%%distributed`` cell gets to end itself (interrupt its ranks, print
#: why) before the runner stops the kernel and its cluster: the run ends by S + this + ~3 s
_GRACE = 4.0


class NotebookRunError(RuntimeError):
    """A cell of the notebook raised, ran past its timeout, or the run was stopped by a
    signal; the message says which, ``exit_code`` is what ``hvdnb run`` exits with."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


#: the widget classes of hvdnb's panel and of the ``%dist start`` cell's stand-in
#: (``hvdnb.notebook.panel.layout``)
_PANEL_CLASSES = frozenset({"hvdnb-panel", "hvdnb-stub-box"})
_WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
_WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def static_panel(nb: Any) -> int:
    """Make the panel's outputs in the executed copy ``nb`` its picture: drop the widget
    view from each output of the panel or its stand-in that carries a static fallback.

    nbclient saves the widgets' last state, and then nbconvert, nbviewer and myst-nb draw
    the view with ipywidgets' html-manager, fetched from a CDN: offline (or where the page
    may not load scripts) the ``%dist start`` cell shows nothing, and online a frozen
    panel whose sliders move nothing. No page ever showed the panel in a headless run;
    the picture (every run, the runs chart) is what the file should keep. Widgets made on
    the ranks keep their views. Returns how many outputs were changed."""
    state = nb.get("metadata", {}).get("widgets", {}).get(_WIDGET_STATE, {}).get("state", {})
    changed = 0
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            view = data.get(_WIDGET_VIEW)
            if not view or not ("image/png" in data or "text/html" in data):
                continue
            model = state.get(view.get("model_id"), {}).get("state", {})
            if _PANEL_CLASSES & set(model.get("_dom_classes", ())):
                del data[_WIDGET_VIEW]
                changed += 1
    return changed


#: the hidden last cell of ``hvdnb run`` (``run_notebook``)
_FLUSH = "import hvdnb.notebook.panel.panel as _hvdnb_panel\n_hvdnb_panel.flush_pictures()"


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

    ``timeout`` (seconds per cell) also reaches the kernel: a ``%%distributed`` cell without
    its own ``--timeout`` interrupts its ranks after it and says where each rank was (the
    stall report, due after at most half of it). A cell still running ``_GRACE`` s later
    (ranks blocked in C ignore the interrupt) gets the kernel and its cluster stopped.
    SIGTERM and SIGINT stop them too. Every way out saves the notebook with the output so
    far and leaves no process behind.

    Returns the path of the executed notebook (default: ``<name>.out.ipynb`` beside it).

    Raises
    ------
    NotebookRunError
        a cell raised (``exit_code`` 1), timed out (124), or a signal stopped the run
        (128 + the signal: 143 for SIGTERM, 130 for SIGINT).
    """
    import nbformat  # noqa: PLC0415  Jupyter's libraries: only for hvdnb run and export
    from nbclient.exceptions import CellExecutionError, CellTimeoutError  # noqa: PLC0415  Jupyter's libraries: only for hvdnb run

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no notebook at {path}")
    out = Path(output) if output else path.with_suffix(".out.ipynb")
    nb = nbformat.read(path, as_version=4)
    env = {"HVDNB_RANKS": str(n)} if n is not None else {}
    if oversubscribe:
        env["HVDNB_OVERSUBSCRIBE"] = "1"
    if timeout and timeout > 0:
        env["HVDNB_CELL_TIMEOUT"] = f"{timeout:g}"
        stall = get_config().stall_after
        if stall > 0:  # the stall report must come before the timeout ends the cell
            env["HVDNB_STALL_AFTER"] = f"{min(stall, max(timeout / 2, 0.5)):g}"
    tree = _ProcessTree()
    error: NotebookRunError | None = None
    # a last cell of its own puts in the pictures still drawing when the last training cell
    # ended (nbclient reads only a running cell's messages, and applies each display update
    # to the earlier cell it names); taken out of the saved copy
    nb.cells.append(nbformat.v4.new_code_cell(_FLUSH, metadata={"hvdnb": "flush"}))
    with tempfile.TemporaryDirectory() as td:
        client = _client(nb, _kernel_manager(td, env, run=True), timeout, path, tree)
        try:
            client.execute()
        except CellTimeoutError:
            error = NotebookRunError(
                f"{path.name}: a cell ran past --timeout {timeout:g} s and did not end when "
                "interrupted; the kernel and its cluster were stopped",
                TIMEOUT_EXIT,
            )
        except CellExecutionError as exc:
            timed_out = f"cell timed out after {timeout:g} s" in str(exc)
            error = NotebookRunError(f"{path.name}: {exc}", TIMEOUT_EXIT if timed_out else 1)
        except BaseException as exc:  # a signal cancels the run (asyncio.CancelledError)
            if client.stopped_by is None:
                raise
            name = signal.Signals(client.stopped_by).name
            error = NotebookRunError(
                f"{path.name}: stopped by {name}; the kernel and its cluster were stopped",
                128 + client.stopped_by,
            )
            del exc
        finally:
            tree.stop()
            nb.cells = [c for c in nb.cells if c.get("metadata", {}).get("hvdnb") != "flush"]
            if error is not None and error.exit_code != 1:
                client.note(str(error).split(": ", 1)[-1])
            static_panel(nb)
            nbformat.write(nb, out)
    if error is not None:
        raise error
    return out


def _client(nb: Any, km: Any, timeout: float, path: Path, tree: _ProcessTree) -> Any:
    """An nbclient ``NotebookClient`` that stops the kernel's whole process tree (the
    cluster's controller, mpiexec and engines live in sessions of their own) when a cell
    times out or a signal comes, and can write a note under the running cell."""

    import nbformat  # noqa: PLC0415  Jupyter's libraries: only for hvdnb run and export
    from nbclient import NotebookClient  # noqa: PLC0415  Jupyter's libraries: only for hvdnb run

    class Client(NotebookClient):
        stopped_by: int | None = None
        cell: Any = None

        def note(self, text: str) -> None:
            if self.cell is not None:
                self.cell.outputs.append(
                    nbformat.v4.new_output("stream", name="stderr", text=f"hvdnb run: {text}\n")
                )

        async def _async_handle_timeout(self, timeout: int, cell: Any = None) -> Any:
            self.shutdown_kernel = "immediate"
            return await super()._async_handle_timeout(timeout, cell)

        async def _async_cleanup_kernel(self) -> None:
            pid = getattr(getattr(self.km, "provisioner", None), "pid", None)
            if self.shutdown_kernel == "immediate" and pid:
                _pause(int(pid))  # it must start nothing between this look and its end
            tree.sample()
            await super()._async_cleanup_kernel()
            tree.reap()

    def on_start(**_: Any) -> None:
        # replace nbclient's own handlers, which only schedule a cleanup and let the cell
        # wait on (a blocked cell never ends, so neither did the run)
        loop, task = asyncio.get_running_loop(), asyncio.current_task()

        def on_signal(signum: int) -> None:
            if client.stopped_by is None:
                client.stopped_by = signum
                client.shutdown_kernel = "immediate"
                if task is not None:
                    task.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, on_signal, sig)
            except (RuntimeError, ValueError):  # not the main thread: no signals to take
                pass
        tree.start(getattr(getattr(client.km, "provisioner", None), "pid", None))

    def on_cell(cell: Any, **_: Any) -> None:
        client.cell = cell

    client = Client(
        nb,
        km=km,
        timeout=timeout + _GRACE if timeout and timeout > 0 else None,
        resources={"metadata": {"path": str(path.parent.resolve())}},
        on_notebook_start=on_start,
        on_cell_execute=on_cell,
    )
    return client


def _pause(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGSTOP)
    except OSError:
        pass


class _ProcessTree:
    """Every process the kernel started (looked at twice a second from a thread, and once
    more before the kernel is stopped), so that all of them can be ended afterwards: an
    engine whose mpiexec died no longer descends from the kernel."""

    def __init__(self) -> None:
        self.procs: dict[int, Any] = {}
        self.root: int | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hvdnb-run-tree", daemon=True)

    def start(self, kernel_pid: int | None) -> None:
        self.root = kernel_pid
        if kernel_pid and not self._thread.is_alive():
            self._thread.start()

    def _loop(self) -> None:
        while not self._done.wait(0.5):
            self.sample()

    def sample(self) -> None:
        if self.root is None:
            return
        try:
            root = psutil.Process(self.root)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        for p in procs:
            self.procs.setdefault(p.pid, p)

    def reap(self, wait: float = 1.5) -> None:
        """End what is still running: SIGTERM, SIGKILL after ``wait`` s. The cluster's
        watchdog goes last (it removes the cluster's files once the rest is gone)."""

        def running(p: Any) -> bool:
            try:
                return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
            except psutil.Error:  # gone between the two looks: one less to end
                return False

        def gone_within(group: list[Any], timeout: float) -> list[Any]:
            # not psutil.wait_procs: it waits out a zombie too (its pid stays until a parent
            # reaps it, and an orphan's new parent need not), which cost each hvdnb run ~3 s
            deadline = time.monotonic() + timeout
            left = [p for p in group if running(p)]
            while left and time.monotonic() < deadline:
                time.sleep(0.02)
                left = [p for p in left if running(p) and not idle_launcher(p)]
            return left

        def idle_launcher(p: Any) -> bool:
            # an mpiexec whose ranks have all ended has nothing left to do, but MPICH's
            # gforker takes ~1.5 s to act on SIGTERM: end it now
            try:
                if p.name().startswith("mpiexec") and not p.children():
                    p.kill()
                    return True
            except psutil.Error:
                return True
            return False

        procs = [p for p in self.procs.values() if running(p)]
        watchdogs = [p for p in procs if _is_watchdog(p)]
        for group in ([p for p in procs if p not in watchdogs], watchdogs):
            if group is watchdogs:
                group = gone_within(group, wait)
            for p in group:
                try:
                    p.terminate()
                except psutil.Error:
                    pass
            for p in gone_within(group, wait):
                try:
                    p.kill()
                except psutil.Error:
                    pass
            gone_within(group, wait)

    def stop(self) -> None:
        self._done.set()
        self.sample()
        self.reap()


def _is_watchdog(p: Any) -> bool:
    try:
        return "hvdnb.notebook.cluster.watchdog" in " ".join(p.cmdline())
    except Exception:
        return False


def _kernel_manager(
    td: str,
    env: dict[str, str],
    run: bool = False,
    prefix: list[str] | None = None,
    ip: str | None = None,
) -> Any:
    """A KernelManager for a "Python 3 (hvdnb)" kernelspec written under ``td`` for this
    Python, with ``env`` added to the kernel's environment. ``run``: the asyncio one that
    nbclient needs (with the blocking one, nbclient's waits block its event loop, and its
    per-cell timeout never fires while a cell hangs). ``prefix``: words put before the
    kernelspec's command (the tests' "login node" enters its namespaces so); ``ip``: the
    address the kernel listens on (loopback by default)."""
    from jupyter_client.kernelspec import KernelSpecManager  # noqa: PLC0415  Jupyter's libraries: only for hvdnb run and the kernelspec
    from jupyter_client.manager import AsyncKernelManager, KernelManager  # noqa: PLC0415  Jupyter's libraries: only for hvdnb run and the kernelspec

    kdir = Path(td, "kernels", KERNEL_NAME)
    kdir.mkdir(parents=True)
    spec = get_kernel_dict()
    spec["env"].update(env)
    spec["argv"] = [*(prefix or []), *spec["argv"]]
    (kdir / "kernel.json").write_text(json.dumps(spec))
    return (AsyncKernelManager if run else KernelManager)(
        kernel_name=KERNEL_NAME,
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kdir.parent)]),
        **({"ip": ip} if ip else {}),
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
    #: every display message's content, in order (display_data, update_display_data)
    display_msgs: list[dict[str, Any]] = field(default_factory=list)
    #: the comms opened (``comm_open`` contents: widgets made on a rank arrive so)
    comm_opens: list[dict[str, Any]] = field(default_factory=list)
    #: the error reply's traceback as the front end draws it (its lines joined)
    traceback: str = ""


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

    def __init__(
        self,
        env: dict[str, str] | None = None,
        timeout: float = 120,
        prefix: list[str] | None = None,
        reach: str | None = None,
    ) -> None:
        self._td = tempfile.TemporaryDirectory()
        # a kernel reached at another namespace's address listens on all of its own (the
        # manager refuses an address it does not have itself)
        ip = "0.0.0.0" if reach else None
        self.km = _kernel_manager(self._td.name, dict(env or {}), prefix=prefix, ip=ip)
        self.km.start_kernel()
        self.kc = self.km.client()
        if reach:
            self.kc.ip = reach
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=timeout)

    def run(self, code: str, timeout: float = 300.0) -> CellRun:
        """Execute ``code`` and wait for the kernel's idle status for it."""

        t0 = time.perf_counter()
        msg_id = self.kc.execute(code)
        first: float | None = None
        text: list[str] = []
        error = None
        displays = 0
        displayed: dict[str, str] = {}
        display_msgs: list[dict[str, Any]] = []
        comm_opens: list[dict[str, Any]] = []
        tb = ""
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
                display_msgs.append({"msg_type": kind, **content})
            elif kind == "comm_open":
                comm_opens.append(content)
            elif kind == "error":
                error = f"{content['ename']}: {content['evalue']}"
                tb = "\n".join(content.get("traceback") or [])
            elif kind == "status" and content["execution_state"] == "idle":
                return CellRun(
                    time.perf_counter() - t0,
                    first,
                    "".join(text),
                    error,
                    displays,
                    displayed,
                    display_msgs,
                    comm_opens,
                    tb,
                )

    def debug_request(self, seq: int, command: str, **arguments: Any) -> dict[str, Any]:
        """A ``debug_request`` on the control channel, as JupyterLab's debugger sends one;
        the content of its reply."""
        msg = self.kc.session.msg(
            "debug_request",
            {"type": "request", "seq": seq, "command": command, "arguments": arguments},
        )
        self.kc.control_channel.send(msg)
        while True:
            rep = self.kc.control_channel.get_msg(timeout=60)
            if rep["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return dict(rep["content"])

    def complete(self, code: str, cursor_pos: int | None = None) -> list[str]:
        """The matches of a ``complete_request`` (what Tab offers in JupyterLab)."""
        reply = self.kc.complete(code, cursor_pos, reply=True, timeout=30)
        return list(reply["content"]["matches"])

    def inspect(self, code: str, cursor_pos: int | None = None) -> dict[str, Any]:
        """The content of an ``inspect_request`` (what Shift-Tab shows in JupyterLab)."""
        reply = self.kc.inspect(code, cursor_pos, reply=True, timeout=30)
        return dict(reply["content"])

    def page(self) -> Any:
        """A second connection to this kernel, as a reloaded page or a second tab makes:
        a client with a session of its own (``km.client()`` would share this one's, and its
        record of the signatures it has seen), channels started; stop them when done."""
        from jupyter_client.blocking.client import BlockingKernelClient  # noqa: PLC0415  Jupyter's libraries: only for tests and benches

        page = BlockingKernelClient(connection_file=self.km.connection_file)
        page.load_connection_file()
        page.start_channels()
        return page

    @staticmethod
    def widget_states(page: Any, timeout: float) -> dict[str, Any] | None:
        """What a loading page asks of ipywidgets (the ``jupyter.widget.control`` comm's
        ``request_states``), sent over ``page``: every widget's state, or None if no answer
        came within ``timeout`` seconds."""
        comm_id = uuid.uuid4().hex
        page.shell_channel.send(
            page.session.msg(
                "comm_open",
                {"comm_id": comm_id, "target_name": "jupyter.widget.control", "data": {}},
                metadata={"version": "1.0.0"},  # ipywidgets' control protocol
            )
        )
        page.shell_channel.send(
            page.session.msg("comm_msg", {"comm_id": comm_id, "data": {"method": "request_states"}})
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = page.get_iopub_msg(timeout=0.5)
            except queue.Empty:
                continue
            data = msg["content"].get("data") or {}
            if (
                msg["msg_type"] == "comm_msg"
                and msg["content"].get("comm_id") == comm_id
                and data.get("method") == "update_states"
            ):
                return dict(data["states"])
        return None

    def send_comm(self, comm_id: str, data: dict[str, Any]) -> None:
        """A ``comm_msg`` from the front end (as JupyterLab sends a widget's change)."""
        msg = self.kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
        self.kc.shell_channel.send(msg)

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
