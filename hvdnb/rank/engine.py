"""Engine-side extension: bootstrap an ipyparallel engine for training, and run cells.

``python -m hvdnb.rank.engine [ipengine args]`` is the command hvdnb's launchers run under
mpiexec. Before the stock ``IPEngine`` starts (and registers with the controller), it finds
its rank, sets the torchrun-style variables, pins its GPU, sets torch's thread count and
initialises the default torch.distributed process group, and sets TensorFlow's
``TF_CONFIG`` (``hvdnb.rank.tfconfig``). So by the time an engine is
visible to the client, the first cell can train; and the slow ``import torch`` overlaps the
controller's own start.

``run_cell`` is what a ``%%distributed`` cell calls on every rank: IPython's transforms
(magics, ``!cmd``), the value of a trailing expression, and on an exception a compact
report naming the rank instead of a raised error, so the client can merge identical
tracebacks. After an error the rank tears its process group down so that peers blocked
in a gloo collective are released at once; the client then rebuilds the group on every
rank (``rebuild_group``) before the next cell.

Never: start processes, open listening sockets other than torch's rendezvous store, or
import anything from the notebook side (hvdnb.notebook.ipython.magics, widgets).
"""

from __future__ import annotations

import ast
import faulthandler
import linecache
import os
import pickle
import re
import socket
import sys
import threading
import time
import traceback
from typing import Any

from hvdnb.protocol import kinds
from hvdnb.protocol.errors import InputError, exception_lines, user_frames
from hvdnb.protocol.replies import CellReply, EngineInfo
from hvdnb.rank import (
    channel,
    debugger,
    elastic,
    frameworks,
    hooks,
    iostream,
    rendezvous,
    standin,
    tfconfig,
    visualdebug,
)
from hvdnb.rank import nvtx as _nvtx
from hvdnb.rank.frameworks.torch_hooks import destroy_default_group
from hvdnb.rank.metrics import fingerprint, recorder, stop

__all__ = [
    "bootstrap",
    "connect_channel",
    "elastic_rejoin",
    "engine_info",
    "join_cell",
    "main",
    "rebuild_group",
    "run_cell",
]

_STATE: dict[str, Any] = {"backend": None, "last_cell": None, "device": "cpu"}


def bootstrap(backend: str | None = None) -> None:
    """Rendezvous and initialise torch.distributed on this rank, then set TensorFlow's
    ``TF_CONFIG`` (collective)."""

    w = rendezvous.discover()
    # at once, before the slow imports: a rank killed between MPI_Init and this unlink
    # (a cluster stopped while it starts) leaves MPICH's segment in /dev/shm for good
    _release_shm_names()
    import torch  # noqa: F401, PLC0415   (the import is the slow part; do it before registering)  torch is heavy: loaded when first used

    rendezvous.init_process_group(backend or None)
    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

    _STATE["backend"] = (
        dist.get_backend() if dist.is_initialized() else backend or rendezvous.default_backend(w)
    )
    _STATE["device"] = rendezvous.setup_device(w)
    tfconfig.setup(w)  # before any cell can import tensorflow
    frameworks.install(rendezvous.place(w, _STATE["device"]))  # DDP, Accelerate, HF, Lightning
    standin.announce_imports()
    _release_shm_names()  # any segment MPI made since (the rendezvous's collectives)


def _release_shm_names(barrier: bool = True) -> None:
    """Unlink MPICH's shared-memory segment names once every local rank has mapped them.

    MPICH removes ``/dev/shm/mpich_shm_*`` in MPI_Finalize, which an engine never reaches
    (it ``os._exit``s, or is killed): each stopped cluster left a 2 MB file behind, and a
    later job whose segment name collided with a leftover failed in MPI_Init ("Out of
    memory"). The mappings stay valid after the unlink, so nothing changes for this job.

    ``barrier=False`` is for a rank that is about to exit after a failed start: its peers
    may never reach a barrier, and a segment only it still maps must go anyway.
    """
    if "mpi4py.MPI" not in sys.modules:
        return
    MPI = sys.modules["mpi4py.MPI"]
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    # every rank of this mpiexec runs this (per-host engine sets and srun tasks have their
    # own COMM_WORLD): after the barrier every local rank has attached the segment
    if barrier:
        MPI.COMM_WORLD.Barrier()
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/dev/shm/mpich_shm_" in line}
    except OSError:  # not Linux
        return
    for path in paths:
        try:
            os.unlink(path)
        except OSError:  # another local rank was first
            pass


def main(argv: list[str] | None = None) -> None:
    """Entry point: bootstrap, then hand over to ipyparallel's own IPEngine."""
    argv = list(sys.argv[1:] if argv is None else argv)
    backend = os.environ.get("HVDNB_BACKEND") or None
    try:
        bootstrap(backend)
    except Exception as exc:
        rank = (
            os.environ.get("RANK")
            or os.environ.get("PMI_RANK")
            or os.environ.get("SLURM_PROCID", "?")
        )
        print(
            f"hvdnb: rank {rank} could not initialise torch.distributed "
            f"(backend={backend or 'auto'}): {type(exc).__name__}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        try:  # os._exit skips MPI_Finalize, which would unlink MPICH's segment
            _release_shm_names(barrier=False)
        except Exception:
            pass
        _exit(3)
    from ipyparallel.engine.app import IPEngine  # noqa: PLC0415  ipyparallel is heavy: loaded only where it is used

    _use_engine_kernel()
    # ipykernel does not capture fd 1/2 (C-level output) under pytest; an engine is never
    # under pytest itself, but inherits the variable when the notebook side is: engines
    # behave the same whoever started them
    os.environ.pop("PYTEST_CURRENT_TEST", None)

    w = rendezvous.discover()
    _start_rank_log(w.rank)
    if w.source in ("slurm", "sets", "elastic") and not any(
        a.startswith("--IPEngine.id") for a in argv
    ):
        # MPI does not number these ranks (ipyparallel's --mpi would use a per-set or
        # per-task rank of 0): register under the global rank, so engine id == rank
        argv.append(f"--IPEngine.id={w.rank}")
    code = 0
    try:
        IPEngine.launch_instance(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except RuntimeError as exc:
        # ipyparallel stops its loop on shutdown/SIGTERM, which surfaces as this error
        if "Event loop stopped" not in str(exc):
            traceback.print_exc()
            code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    # skip interpreter teardown (torch's takes ~1 s); the nanny exits with its parent
    _exit(code)


def _exit(code: int) -> None:
    """End this engine now, telling a warm start's stand-in the code (``standin``)."""
    standin.report_exit(code)
    os._exit(code)


def _start_rank_log(rank: int) -> None:
    """This rank's log for ``%dist logs``: ``$HVDNB_STATE_DIR/logs/rank<N>.log`` (0600),
    appended across restarts. Everything the process writes to stderr outside a cell goes
    there as well as to the launcher (a tee of fd 2), and a fatal signal (SIGSEGV, SIGABRT,
    ...) dumps every thread's Python stack into it (faulthandler), so a rank that died
    without a traceback leaves one here. Output during a cell goes to the cell, as before."""

    d = os.environ.get("HVDNB_STATE_DIR")
    if not d:
        return
    try:
        os.makedirs(os.path.join(d, "logs"), mode=0o700, exist_ok=True)
        path = os.path.join(d, "logs", f"rank{rank}.log")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        log = os.fdopen(fd, "ab", buffering=0)
        log.write(
            f"hvdnb: rank {rank} started, pid {os.getpid()} on {socket.gethostname()} "
            f"at {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode()
        )
        faulthandler.enable(file=log, all_threads=True)
        read_end, write_end = os.pipe()
        launcher = os.dup(2)
        os.dup2(write_end, 2)
        os.close(write_end)
    except OSError:
        return

    def tee() -> None:
        while True:
            try:
                data = os.read(read_end, 65536)
            except OSError:
                return
            if not data:
                return
            for out in (log.write, lambda b: os.write(launcher, b)):
                try:
                    out(data)
                except OSError:
                    pass

    threading.Thread(target=tee, name="hvdnb-rank-log", daemon=True).start()


def _use_engine_kernel() -> None:
    """Make ipyparallel's engine build its kernel from a subclass that skips "busy".

    ipykernel publishes "busy" before every shell request and "idle" after it. On an
    engine only "idle" has a reader: ipyparallel's client marks a result's output complete
    on it, while both the client and the hub drop "busy" unread. Each "busy" still costs a
    hop through the engine's IOPub thread, a relay through the controller's iopub queue,
    and a decode in the hub and in the notebook: measured side by side, a no-op cell took
    0.93x the time without it. Control-channel status and every "idle" are unchanged.

    The engine app looks the kernel class up as a module global when it registers; if a
    future ipyparallel renames it, engines keep the stock kernel.
    """
    from ipyparallel.engine import app  # noqa: PLC0415  ipyparallel is heavy: loaded only where it is used

    base = getattr(app, "Kernel", None)
    if base is None or not hasattr(base, "_publish_status"):
        return

    class EngineKernel(base):  # type: ignore[misc, valid-type]
        def _publish_status(self, status: str, channel: str, parent: Any = None) -> None:
            if status == "busy" and channel == "shell":
                return
            super()._publish_status(status, channel, parent)

    app.Kernel = EngineKernel


def engine_info() -> EngineInfo:
    """What ``%dist status`` shows for this rank."""

    import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

    return EngineInfo(
        rank=int(os.environ.get("RANK", -1)),
        local_rank=int(os.environ.get("LOCAL_RANK", -1)),
        host=socket.gethostname(),
        pid=os.getpid(),
        device=_STATE["device"],
        backend=_STATE["backend"],
        group="ok" if dist.is_initialized() else "down",
        last_cell=_STATE["last_cell"],
    )


#: where a Python frame means "inside a collective": torch.distributed, hvdnb.torch, mpi4py
_COLLECTIVE_FILES = ("torch/distributed/", "hvdnb/torch/", "mpi4py/")
_MPI_CALLS = (
    "allreduce",
    "Allreduce",
    "bcast",
    "Bcast",
    "Barrier",
    "barrier",
    "allgather",
    "Allgather",
    "gather",
    "Gather",
    "scatter",
    "Scatter",
    "reduce",
    "Reduce",
    "alltoall",
    "Alltoall",
    "recv",
    "Recv",
    "send",
    "Send",
    "Sendrecv",
    "Wait",
    "wait",
)


def where() -> dict[str, Any]:
    """Where this rank's main thread is now: the user's cell line and, if it is inside a
    collective, which one. Called from the side channel's thread (the main thread may be
    blocked in that very collective)."""

    main_id = threading.main_thread().ident
    frame = sys._current_frames().get(main_id) if main_id is not None else None
    stack = traceback.extract_stack(frame) if frame is not None else []
    user_i = None
    for i, fr in enumerate(stack):
        if fr.filename.startswith("<cell "):
            user_i = i
    info: dict[str, Any] = {
        "cell": None,
        "line": None,
        "code": None,
        "collective": None,
        "progress": _progress(),
        "pid": os.getpid(),
        "stack": [],
    }
    if user_i is None:
        info["idle"] = True
        return info
    user = stack[user_i]
    info.update(cell=user.filename, line=user.lineno, code=(user.line or "").strip())
    first = next(i for i, fr in enumerate(stack) if fr.filename.startswith("<cell "))
    info["stack"] = _frame_lines(stack[first:])
    for i, fr in enumerate(stack[user_i + 1 :], user_i + 1):
        in_collectives = any(k in fr.filename.replace("\\", "/") for k in _COLLECTIVE_FILES)
        if (
            in_collectives
            and fr.name not in ("wrapper", "_wrapper")
            # "<module>": a torch.distributed module being imported is no collective
            and not fr.name.startswith(("_", "<"))
        ):
            info["collective"] = fr.name
            for _ in range(len(stack) - 1 - i):  # the frame object of stack[i], for its args
                frame = frame.f_back if frame is not None else None
            info["peer"] = _peer(frame, "")
            break
    if info["collective"] is None and len(stack) == user_i + 1:
        # mpi4py's calls are C: the user's own line is the innermost Python frame
        code = info["code"] or ""
        for name in _MPI_CALLS:
            if f".{name}(" in code:
                info["collective"] = f"MPI {name}"
                info["peer"] = _peer(None, code)
                break
    return info


def _peer(frame: Any, code: str) -> int | None:
    """The peer rank of a point-to-point call (torch's ``src``/``dst`` argument, mpi4py's
    ``source=``/``dest=`` in the line), for the stall report; None when it has none."""

    loc = getattr(frame, "f_locals", None) or {}
    for key in ("src", "dst", "group_src", "group_dst"):
        if isinstance(loc.get(key), int):
            return int(loc[key])
    m = re.search(r"\b(?:source|dest)\s*=\s*(\d+)", code)
    return int(m[1]) if m else None


def _frame_lines(frames: Any) -> list[str]:
    """``<cell 3> line 4, in f: x = g()`` per frame, outermost first (as %dist where shows)."""
    out = []
    for fr in frames:
        name = fr.filename
        if not name.startswith("<"):
            parts = name.replace("\\", "/").split("/")
            name = (
                "/".join(parts[-3:])
                if "site-packages" not in parts
                else "/".join(parts[parts.index("site-packages") + 1 :])
            )
        code = (fr.line or "").strip()
        out.append(f"{name} line {fr.lineno}, in {fr.name}" + (f": {code}" if code else ""))
    return out


def _progress() -> list[Any]:
    """Counters that move while a rank makes progress, read without touching the main
    thread: the default group's collective sequence number (gloo/nccl), hvdnb.torch's
    negotiated calls, and the last step given to hvdnb.log."""
    out: list[Any] = [None, None, None]
    try:
        import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

        if dist.is_initialized():
            group = dist.distributed_c10d._get_default_group()
            # torch's own count of collectives on the group (private in torch 2.x, no stub)
            out[0] = group._get_sequence_number_for_group()  # type: ignore[attr-defined]
    except Exception:
        pass
    out[1] = hooks.negotiated_calls()  # registered by hvdnb.torch's transport (None: not loaded)
    out[2] = recorder.logged_step()
    return out


def connect_channel() -> None:
    """Connect the side channel once, and answer "where are you?" from its thread."""
    if _STATE.get("channel_ready"):
        return
    _STATE["channel_ready"] = True

    ch = channel.get()
    if ch is not None:
        ch.on(kinds.WHERE_ASK, lambda msg: ch.send(kinds.WHERE, ask=msg.get("ask"), **where()))
        # JupyterLab's visual debugger, turned on (once per cell while on) and off
        ch.on(kinds.DEBUG_LISTEN, lambda msg: visualdebug.on_listen(ch, msg))
        ch.on(kinds.DEBUG_OFF, visualdebug.on_off)

        stop.listen(ch)  # a watcher may stop the loop (hvdnb.watch(nan="stop"))
        elastic.listen(ch)  # an elastic cluster's next generations
        fingerprint.install()  # replica-drift fingerprints, once hvdnb.torch is loaded
        _announce(ch)


def _announce(ch: Any) -> None:
    """Tell the notebook which host this rank is on (the panel groups ranks by host)."""

    ch.send(
        kinds.RANK_INFO,
        host=socket.gethostname(),
        local_rank=int(os.environ.get("LOCAL_RANK", -1)),
        pid=os.getpid(),
    )


def rebuild_group(generation: int) -> None:
    """Rebuild the default group when the client asks for a newer generation (collective)."""

    if generation > rendezvous.generation():
        rendezvous.reinit_process_group(generation, _STATE["backend"])


def elastic_rejoin(generation: int, members: list[int], hosts: list[str] | None = None) -> int:
    """Bring this idle rank of an elastic cluster to ``generation`` (its ``members`` are
    slots in rank order, on ``hosts``: one name each, None on one host); nothing when an
    elastic loop has re-formed there already. Collective over the members. Returns this
    rank's number in it."""
    elastic.notice({"generation": generation, "members": list(members), "hosts": hosts})
    if generation > rendezvous.generation():
        elastic.reform()
    return rendezvous.world().rank


def join_cell(
    generation: int,
    members: list[int],
    code: str,
    cell_no: int,
    hosts: list[str] | None = None,
) -> CellReply:
    """A rank started while a cell trains (``%dist scale`` at a commit): join the group's
    ``generation`` (the running loop's ranks re-form with it at their next commit), then
    run the cell from its top. A join that fails is this rank's error reply."""
    try:
        elastic_rejoin(generation, members, hosts)
    except BaseException as exc:
        return _error_reply(exc, int(os.environ.get("RANK", -1)))
    return run_cell(code, cell_no)


def _release_peers() -> None:
    """After an error, close this rank's connections so peers blocked in gloo fail fast."""
    try:
        import torch.distributed as dist  # noqa: PLC0415  torch is heavy: loaded when first used

        if dist.is_initialized() and dist.get_world_size() > 1:
            destroy_default_group()  # torch's own: a user's call keeps the group
    except Exception:  # the cell already failed; never mask its error with ours
        pass


def _compile_cell(code: str, filename: str) -> tuple[Any, Any]:
    shell = _shell()
    # IPython's transforms tokenize the whole cell: only pay for them when the cell may use
    # IPython syntax (magics, !shell, ?help)
    if shell is not None and any(ch in code for ch in "%!?"):
        code = shell.transform_cell(code)
    # keep the source so tracebacks show the user's lines
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    tree = ast.parse(code, filename=filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        expr = tree.body.pop()
        assert isinstance(expr, ast.Expr)
        last = ast.Expression(expr.value)
    body = compile(tree, filename, "exec")
    tail = compile(last, filename, "eval") if last is not None else None
    return body, tail


def _shell() -> Any:
    try:
        from IPython import get_ipython  # noqa: PLC0415  IPython: only inside a kernel

        return get_ipython()
    except ImportError:  # pragma: no cover
        return None


def _user_frames(tb: Any, filename_prefix: str, exc: BaseException | None = None) -> list[str]:
    """Traceback lines from the first frame of user code on (drop this runner's frames,
    as IPython drops its own); none when no frame is the user's."""
    # a frame that sets ``__tracebackhide__`` (hvdnb's public functions, as pytest's and
    # IPython's own) is left out: a refused argument's traceback ends at the user's line
    shown = user_frames(tb, ours=not isinstance(exc, InputError))
    for i, fr in enumerate(shown):
        if fr.filename.startswith(filename_prefix):
            # the elastic loop's own frames say nothing of the user's error
            kept = [f for f in shown[i:] if not f.filename.endswith(_ELASTIC_LOOP)]
            return traceback.format_list(kept)
    return []


#: the file of the elastic loop (``hvd.elastic.run``), left out of a rank's traceback
_ELASTIC_LOOP = os.path.join("hvdnb", "rank", "elastic.py")


def _flush_metrics() -> tuple[int, int] | None:
    """Send the points this cell logged since the last flush, and say which message was
    the last: ``(pid, seq)``, for the notebook to wait for. None without ``hvdnb.log``."""
    try:
        return recorder.flush_for_cell_end()
    except (Exception, KeyboardInterrupt):  # metrics are an extra: never lose the report
        return None


def _new_cell_metrics(cell_no: int) -> None:
    """A cell is a new loop: its first step must not be filed under the last cell's."""
    recorder.begin_cell(cell_no)


def _cell_ended_metrics(ok: bool) -> None:
    """No cell runs: a knob change asked for now applies at once (no loop can take it).
    A cell that ran to its end first takes each trained model's last drift fingerprint
    (``fingerprint.at_cell_end``), queued for the cell's last message (``_flush_metrics``,
    sent before the reply): drift in a loop shorter than the sampling grid is still named
    by the cell's end."""

    try:
        fingerprint.at_cell_end(take=ok)
    except KeyboardInterrupt:  # an interrupt at the cell's very end: never lose the report
        pass
    recorder.end_cell()


def run_cell(code: str, cell_no: int) -> CellReply:
    """Run one %%distributed cell on this rank.

    Returns a ``CellReply``: ``ok`` with the trailing expression's value and repr, or, on
    an exception, ``ok=False`` with its name, message and traceback; never raises for user
    errors.
    """
    rank = int(os.environ.get("RANK", -1))
    connect_channel()
    _new_cell_metrics(cell_no)
    debugger.forget()  # a new cell: the last failed cell's frames go
    visualdebug.new_cell()  # an interrupt that landed in debugpy's wait is over
    frameworks.new_cell()  # each framework note may be said once more
    sys.breakpointhook = debugger.breakpoint_hook  # pdb on this rank, prompted in the notebook
    t0 = time.time()
    _STATE["last_cell"] = {"cell": cell_no, "state": "running", "start": t0}
    shell = _shell()
    ns = shell.user_ns if shell is not None else globals()
    try:
        value = _execute(code, cell_no, ns)
    except BaseException as exc:
        debugger.keep(exc)  # %dist debug reads its frames until the next cell
        reply = _error_reply(exc, rank)
        _STATE["last_cell"] = {"cell": cell_no, "state": "error", "start": t0}
        _cell_ended_metrics(False)
        return reply._replace(metrics=_flush_metrics(), generation=rendezvous.generation())
    # (no flush here: ipyparallel flushes after apply, and each flush is a cross-thread wait)
    _STATE["last_cell"] = {"cell": cell_no, "state": "ok", "start": t0}
    _cell_ended_metrics(True)
    if value is not None and shell is not None:
        ns["_"] = value
    return CellReply(
        ok=True,
        rank=rank,
        repr=None if value is None else repr(value),
        value=_picklable(value),
        metrics=_flush_metrics(),
        generation=rendezvous.generation(),
    )


def _execute(code: str, cell_no: int, ns: dict[str, Any]) -> Any:
    """Compile and run the cell in ``ns``; the trailing expression's value (or None)."""

    body, tail = _compile_cell(code, f"<cell {cell_no}>")
    opened = _nvtx.push(f"cell {cell_no}")  # Nsight Systems: one range per cell (CUDA only)
    try:
        with iostream.coalesced():  # a bar flushing at every update: one message per gap
            exec(body, ns)
            return eval(tail, ns) if tail is not None else None
    finally:
        _nvtx.pop(opened)


def _error_reply(exc: BaseException, rank: int) -> CellReply:
    """The report of a failed cell (its peers released first): the user's frames only."""
    text = ""
    # a second interrupt (fail-fast, the stop button) may land while we report: the
    # report must still go out, or the client sees ipyparallel's own error instead
    for _ in range(3):
        try:
            _release_peers()
            if isinstance(exc, SyntaxError) and (exc.filename or "").startswith("<cell "):
                # the cell never ran: as IPython shows it, the line and the caret only
                lines = traceback.format_exception_only(type(exc), exc)
            else:
                lines = ["Traceback (most recent call last):\n"]
                lines += _user_frames(exc.__traceback__, "<cell ", exc)
                lines += exception_lines(exc)
            text = "".join(lines)
            break
        except KeyboardInterrupt:
            continue
    return CellReply(
        ok=False,
        rank=rank,
        ename=exception_lines(exc)[-1].split(":", 1)[0]
        if isinstance(exc, InputError)
        else type(exc).__name__,
        evalue=str(exc),
        traceback=text,
        interrupted=isinstance(exc, KeyboardInterrupt),
        left=bool(getattr(exc, "hvdnb_left", False)),
    )


def _error_name(exc: BaseException) -> str:
    """The error's name as the user reads it: a refused argument is the builtin error it is."""
    if isinstance(exc, InputError):
        return exception_lines(exc)[-1].split(":", 1)[0]
    return type(exc).__name__


def _picklable(value: Any) -> Any:
    """``value`` when it pickles; None when not (it travels as its repr only)."""
    if value is None:
        return None
    try:
        pickle.dumps(value)
    except Exception:
        return None
    return value
