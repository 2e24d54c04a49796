"""The ``hvdnb`` command: demo, run a notebook on N ranks, install the kernel.

Owns: argument parsing and exit codes for terminals and CI. Every subcommand starts what
it needs and stops it again, also on errors and Ctrl-C.

Never: leave a cluster running after it returns.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from hvdnb.notebook.cellout.cells import DistributedCellError, run_cell
from hvdnb.notebook.cluster.lifecycle import Cluster, ClusterError
from hvdnb.notebook.headless.export import ExportError, export, from_notebook
from hvdnb.notebook.headless.kernelspec import DISPLAY_NAME, install
from hvdnb.notebook.headless.runner import NotebookRunError, run_notebook

__all__ = ["main"]

_DEMO_CELL = r"""
import time, torch, torch.distributed as dist
torch.manual_seed(0)
rank, size = dist.get_rank(), dist.get_world_size()
# a synthetic, learnable task: 10 classes from 64 features (no download)
g = torch.Generator().manual_seed(1234)
W_true = torch.randn(64, 10, generator=g)
X = torch.randn(4096, 64, generator=g)
y = (X @ W_true).argmax(1)
X, y = X[rank::size], y[rank::size]          # each rank its shard
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
for p in model.parameters():                  # same start on every rank
    dist.broadcast(p.data, 0)
opt = torch.optim.SGD(model.parameters(), lr=0.1 * size, momentum=0.9)
comm, steps = 0.0, __STEPS__
for step in range(steps):
    idx = torch.randint(0, X.shape[0], (64,))
    loss = torch.nn.functional.cross_entropy(model(X[idx]), y[idx])
    opt.zero_grad()
    loss.backward()
    t0 = time.perf_counter()
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(flat)
    flat /= size
    off = 0
    for p in model.parameters():
        n = p.numel(); p.grad.copy_(flat[off:off + n].view_as(p)); off += n
    comm += time.perf_counter() - t0
    opt.step()
    if step % max(steps // 5, 1) == 0 or step == steps - 1:
        print(f"step {step:4d}  loss {loss.item():.4f}")
acc = (model(X).argmax(1) == y).float().mean().item()
kb = flat.numel() * 4 / 1e3
print(f"accuracy {acc:.3f}; allreduce {1e3 * comm / steps:.2f} ms/step "
      f"({dist.get_backend()}, {kb:.0f} KB)")
"""


def _demo(args: argparse.Namespace) -> int:
    _headless()
    t0 = time.perf_counter()
    with Cluster(n=args.n, oversubscribe=args.oversubscribe) as c:
        print(f"hvdnb demo: {c.n} ranks ready in {c.start_seconds:.1f} s")
        try:
            run_cell(c, _DEMO_CELL.replace("__STEPS__", str(args.steps)))
        except DistributedCellError as exc:
            print(exc, file=sys.stderr)
            return 1
    print(f"hvdnb demo: done in {time.perf_counter() - t0:.1f} s, cluster stopped")
    return 0


def _install_kernel(args: argparse.Namespace) -> int:
    where = install(user=args.user, prefix=args.prefix)
    print(f"installed kernelspec {DISPLAY_NAME!r} in {where}")
    return 0


def _headless() -> None:
    """No one restarts a headless run by hand: no warm standby (``HVDNB_STANDBY``) takes
    its cores and memory, unless asked for."""
    os.environ.setdefault("HVDNB_STANDBY", "0")


def _run(args: argparse.Namespace) -> int:
    _headless()
    if args.min_np is not None:  # %dist start reads them (an elastic cluster)
        os.environ["HVDNB_MIN_NP"] = str(args.min_np)
        if args.max_np is not None:
            os.environ["HVDNB_MAX_NP"] = str(args.max_np)
    if args.notebook.suffix == ".py":
        return _run_script(args)
    try:
        out = run_notebook(
            args.notebook,
            n=args.n,
            output=args.output,
            timeout=args.timeout,
            oversubscribe=args.oversubscribe,
        )
    except NotebookRunError as exc:
        print(f"hvdnb run: {exc}", file=sys.stderr)
        return exc.exit_code
    except FileNotFoundError as exc:
        print(f"hvdnb run: {exc}", file=sys.stderr)
        return 2
    print(f"hvdnb run: {args.notebook} ran without errors; saved to {out}")
    return 0


def _run_script(args: argparse.Namespace) -> int:
    """A Python script on every rank, with its arguments: as ``mpiexec -n N python
    script.py ...`` would, but on hvdnb's ranks (an elastic cluster with ``--min-np``), the
    output tagged by rank. Exit 0 when it ended on every rank that was left."""
    path = args.notebook.resolve()
    if not path.is_file():
        print(f"hvdnb run: no script {path}", file=sys.stderr)
        return 2
    argv = [str(path), *args.script_args]
    cell = (
        f"import runpy, sys\nsys.argv = {argv!r}\n"
        f"runpy.run_path({str(path)!r}, run_name='__main__')\n"
    )
    try:
        with Cluster(n=args.n, oversubscribe=args.oversubscribe) as c:
            run_cell(c, cell, timeout=args.timeout, quiet=True)
    except DistributedCellError as exc:
        print(exc, file=sys.stderr)
        return 1
    except ClusterError as exc:
        print(f"hvdnb run: {exc}", file=sys.stderr)
        return 2
    return 0


def _export(args: argparse.Namespace) -> int:
    try:
        cells, knobs, n_nb = from_notebook(args.notebook, cells=args.cells)
        n = args.n or n_nb or 2
        written, line = export(
            args.output or args.notebook.with_suffix(".py"),
            cells,
            n=n,
            launcher=args.launcher,
            knobs=knobs,
            source=str(args.notebook),
            backend=args.backend,
        )
    except ExportError as exc:
        print(f"hvdnb export: {exc}", file=sys.stderr)
        return 2
    print(f"hvdnb export: wrote {', '.join(map(str, written))}; run it with: {line}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hvdnb", description="Interactive, Horovod-style distributed training."
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser(
        "demo",
        help="train a small model on N local ranks and print it",
        description="Short data-parallel training on N local ranks: each rank's loss, the "
        "accuracy and the allreduce time per step, printed per rank.",
    )
    d.add_argument("-n", type=int, default=None, help="ranks (default: GPUs, else 2)")
    d.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    d.add_argument(
        "--oversubscribe", action="store_true", help="allow more ranks than GPUs or cores"
    )
    d.set_defaults(func=_demo)
    k = sub.add_parser("install-kernel", help='install the "Python 3 (hvdnb)" kernelspec')
    k.add_argument("--user", action="store_true", help="for this user, not this environment")
    k.add_argument(
        "--prefix", default=None, help="install under this prefix (default: this environment)"
    )
    k.set_defaults(func=_install_kernel)
    r = sub.add_parser(
        "run",
        help="execute a notebook headless on N ranks",
        description="Execute a notebook headless on N ranks and save the executed copy "
        "(also when a cell fails, times out or a signal stops the run).",
        epilog="exit status: 0 every cell ran; 1 a cell raised; 2 bad input; 124 a cell ran "
        "past --timeout (its ranks were interrupted, the stall report is in the saved "
        "notebook); 143 / 130 stopped by SIGTERM / SIGINT. Every way out stops the kernel "
        "and its cluster.",
    )
    r.add_argument(
        "notebook",
        type=Path,
        help="the notebook to run (left unchanged), or a Python script (.py) to run on "
        "every rank, followed by its own arguments",
    )
    r.add_argument("-n", type=int, default=None, help="ranks for %%dist start (default 2)")
    r.add_argument("-o", "--output", type=Path, default=None, help="where to save it")
    r.add_argument(
        "--timeout",
        type=float,
        default=600,
        help="seconds per cell (default 600): a %%%%distributed cell still running then is "
        "interrupted with a report of where each rank was; one that does not end within 4 s "
        "more gets the kernel and cluster stopped; exit 124",
    )
    r.add_argument(
        "--oversubscribe",
        action="store_true",
        help="allow more ranks than GPUs (they share them over gloo) or cores",
    )
    r.add_argument(
        "--min-np",
        type=int,
        default=None,
        help="an elastic cluster: it goes on down to this many ranks when ranks die "
        "(inside hvd.elastic.run / hvdnb.elastic.run)",
    )
    r.add_argument(
        "--max-np", type=int, default=None, help="an elastic cluster's most ranks (default: -n)"
    )
    r.set_defaults(func=_run, script_args=[])
    e = sub.add_parser(
        "export",
        help="turn a notebook's %%distributed cells into a script for mpiexec, torchrun or Slurm",
        description="Write a saved notebook's %%distributed cells as a script (in execution "
        "order; failed ones, an error in their saved output, left out) for mpiexec, torchrun or "
        "Slurm (plus an sbatch file); knob values from its `%dist knobs name=value` lines, "
        "ranks from its `%dist start -n N`.",
    )
    e.add_argument("notebook", type=Path, help="a saved notebook (cells in execution order)")
    e.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        help="the script (default: the notebook's name with .py)",
    )
    e.add_argument(
        "--launcher",
        default="mpiexec",
        choices=["mpiexec", "torchrun", "slurm"],
        help="what the script is written for; slurm also writes an sbatch file",
    )
    e.add_argument(
        "--cells",
        default="ok",
        choices=["ok", "all"],
        help="ok: leave cells whose saved output is an error out (default)",
    )
    e.add_argument(
        "-n", type=int, default=None, help="ranks (default: the notebook's %%dist start -n, else 2)"
    )
    e.add_argument("--backend", default=None, help="torch.distributed backend (default: auto)")
    e.set_defaults(func=_export)
    return p


def _without_iri_grammars() -> None:
    """Leave out jsonschema's optional IRI checker in this process.

    nbformat imports jsonschema, which imports ``rfc3987_syntax`` when it is installed
    (Jupyter's own extras install it) to check the ``iri`` string format; that import
    compiles 38 lark grammars, 1.0-1.2 s of every ``hvdnb run`` here. No notebook schema
    uses the format, so jsonschema simply goes without it.
    """
    sys.modules.setdefault("rfc3987_syntax", None)  # type: ignore[arg-type]  # None: "not installed"


def _split_script(argv: list[str]) -> tuple[list[str], list[str]]:
    """``hvdnb run [OPTIONS] script.py [ITS ARGUMENTS]``: what follows a script's path is
    the script's (its own ``-n`` included); a notebook takes options before or after it."""
    if not argv or argv[0] != "run":
        return argv, []
    takes_value = {"-n", "-o", "--output", "--timeout", "--min-np", "--max-np"}
    i = 1
    while i < len(argv):
        a = argv[i]
        if a in takes_value:
            i += 2
            continue
        if not a.startswith("-") and a.endswith(".py"):
            return argv[: i + 1], argv[i + 1 :]
        i += 1
    return argv, []


def main(argv: list[str] | None = None) -> int:
    _without_iri_grammars()
    ours, theirs = _split_script(list(sys.argv[1:] if argv is None else argv))
    args = _parser().parse_args(ours)
    args.script_args = theirs
    if getattr(args, "n", None) is not None and args.n < 1:
        print(f"hvdnb: -n must be at least 1, not {args.n}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("hvdnb: interrupted; cluster stopped", file=sys.stderr)
        return 130
    except Exception as exc:  # a clear one-line error, not a traceback
        if isinstance(exc, ClusterError):
            print(f"hvdnb: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
