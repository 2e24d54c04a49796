"""What ``%dist`` and ``%%distributed`` accept: the one table of actions and their options,
the option list (IPython's ``magic_arguments``, so ``%dist?`` prints real help), and the
words of a refusal (what was wrong, then that action's usage).

Owns: ``ACTIONS``, ``DIST_OPTIONS``, ``CELL_USAGE``. Read by ``hvdnb.notebook.ipython.magics`` and
by the documentation's reference (generated from them). Never: act on a cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from IPython.core import magic as _ipy_magic
from IPython.core import magic_arguments as _ipy_args
from IPython.core.error import UsageError

__all__ = [
    "ACTIONS",
    "CELL_USAGE",
    "DIST_OPTIONS",
    "Action",
    "action_of",
    "argument",
    "cell_magic",
    "dist_options",
    "given_options",
    "line_magic",
    "magic_arguments",
    "refused",
    "usage",
]

_F = TypeVar("_F", bound=Callable[..., Any])


class _Decorator(Protocol):
    def __call__(self, func: _F, /) -> _F: ...


# IPython's magic and option decorators carry no (or loose) annotations: typed here once
# (each returns the function it decorates, marked as a magic or with its parser attached)
argument = cast(Callable[..., _Decorator], _ipy_args.argument)
magic_arguments = cast(Callable[[], _Decorator], _ipy_args.magic_arguments)
line_magic = cast(_Decorator, _ipy_magic.line_magic)
cell_magic = cast(_Decorator, _ipy_magic.cell_magic)


@dataclass(frozen=True)
class Action:
    """What one ``%dist`` action accepts: its options (argparse dests), whether it takes
    positional values, and the usage line its refusals quote."""

    options: frozenset[str]
    values: bool
    usage: str


START_OPTIONS = frozenset(
    {
        "n",
        "backend",
        "launcher",
        "timeout",
        "oversubscribe",
        "hosts",
        "ip",
        "partition",
        "time",
        "gpus_per_node",
        "account",
        "tf_ps",
        "min_np",
        "max_np",
    }
)
#: a restart re-makes the ranks where they ran: a new launcher, hostfile, address or Slurm
#: job is a new cluster (``%dist stop`` then ``%dist start``)
RESTART_OPTIONS = frozenset(
    {"n", "backend", "timeout", "oversubscribe", "tf_ps", "min_np", "max_np"}
)

#: the one table of what each ``%dist`` action takes; every other option is refused by name
ACTIONS: dict[str, Action] = {
    "start": Action(
        START_OPTIONS,
        False,
        "%dist start [-n N] [--backend gloo|nccl|mpi|auto] [--timeout S] [--oversubscribe] "
        "[--launcher mpi|slurm|...] [--hosts HOSTFILE] [--ip ADDRESS] [--partition P] "
        "[--time T] [--gpus-per-node G] [--account A] [--tf-ps K] [--min-np M [--max-np K]]",
    ),
    "stop": Action(frozenset(), False, "%dist stop"),
    "restart": Action(
        RESTART_OPTIONS,
        False,
        "%dist restart [-n N] [--backend gloo|nccl|mpi|auto] [--timeout S] [--oversubscribe] "
        "[--tf-ps K] [--min-np M] [--max-np K]",
    ),
    "status": Action(frozenset(), False, "%dist status"),
    "scale": Action(frozenset(), True, "%dist scale N"),
    "panel": Action(frozenset({"inline"}), False, "%dist panel [--inline]"),
    "knobs": Action(
        frozenset({"at_step", "after"}),
        True,
        "%dist knobs [name=value ...] [--at-step STEP] [--after SECONDS]",
    ),
    "watch": Action(
        frozenset(), True, "%dist watch [nan|spike|drift=warn|stop|off ...] [threshold=value ...]"
    ),
    "export": Action(
        frozenset({"launcher", "cells"}),
        True,
        "%dist export PATH [--launcher mpiexec|torchrun|slurm] [--cells ok|all]",
    ),
    "where": Action(frozenset(), False, "%dist where"),
    "debug": Action(frozenset({"commands"}), True, "%dist debug [RANK] [-c COMMAND ...]"),
    "logs": Action(frozenset({"n"}), True, "%dist logs [RANK] [-n LINES]"),
    "runs": Action(frozenset({"delete", "n"}), True, "%dist runs [-n LAST] [--delete ID ...]"),
    "compare": Action(frozenset(), True, "%dist compare [ID ...]"),
    "auto": Action(frozenset(), True, "%dist auto [on|off]"),
}

CELL_USAGE = "%%distributed [-t RANKS] [-o NAME] [--timeout SECONDS] [-q]"


def usage(exc: BaseException) -> UsageError:
    return UsageError(str(exc))


def without_comment(line: str) -> str:
    """``line`` less a trailing ``# comment`` (a ``#`` outside quotes, at the start or after
    a space), as the shell and Python read one: ``%dist status  # what runs?``."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line


def action_of(line: str) -> str:
    """The action a ``%dist`` line names, read without argparse (for its refusals)."""
    words = line.split()
    for w in words:
        if w in ACTIONS:
            return w
    first = next((w for w in words if not w.startswith("-")), None)
    return first if first is not None and words and words[0] == first else "status"


def refused(action: str, what: str) -> UsageError:
    """One refusal of a ``%dist`` line: what was wrong, then that action's usage."""
    usage = ACTIONS[action].usage if action in ACTIONS else "%dist ACTION [options]"
    return UsageError(f"{what}. Usage: {usage}\nSee `%dist?` for every option.")


def given_options(parser: Any, args: Any) -> dict[str, str]:
    """dest -> option name of every option given (one differs from its default)."""
    out = {}
    for act in parser._actions:  # argparse keeps no public list of its options
        if not act.option_strings or act.dest == "help":
            continue
        if getattr(args, act.dest, act.default) != act.default:
            out[act.dest] = max(act.option_strings, key=len)
    return out


#: %dist's options, in the order its help lists them: one parser for every action (each
#: action takes the options ``ACTIONS`` names; ``DistMagics.dist`` refuses the rest)
DIST_OPTIONS = [
    argument(
        "action",
        nargs="?",
        default="status",
        help="start | stop | restart | status | scale | panel | knobs | watch | export | where | "
        "debug | logs | runs | compare | auto (default: status)",
    ),
    argument(
        "values",
        nargs="*",
        help="knobs: name=value pairs, e.g. warmup_steps=200; watch: watcher=action "
        "(warn, stop, off) or threshold=value pairs, e.g. nan=stop spike_factor=5; "
        "export: the script's path, e.g. train.py; debug, logs: the rank; scale: the "
        "number of ranks",
    ),
    argument(
        "--at-step",
        type=int,
        default=None,
        help="knobs: apply at this step (of the running loop, or of the next one)",
    ),
    argument(
        "--after",
        type=float,
        default=None,
        help="knobs: send the change this many seconds from now (returns at once)",
    ),
    argument(
        "-c",
        "--command",
        action="append",
        default=None,
        dest="commands",
        help="debug: run this pdb command and return (repeatable), instead of a prompt",
    ),
    argument("--delete", nargs="+", default=None, metavar="ID", help="runs: delete these runs"),
    argument("--cells", default="ok", help="export: ok (default: leave failed cells out) or all"),
    argument(
        "--inline",
        action="store_true",
        help="panel: show it in this cell's output (classic Notebook, VS Code) "
        "instead of beside the notebook",
    ),
    argument(
        "-n",
        type=int,
        default=None,
        help="start, restart: ranks to start (default: GPUs, else 2); logs: lines per rank (20)",
    ),
    argument(
        "--backend",
        default=None,
        help="start, restart: torch.distributed backend: gloo, nccl, mpi or auto (default: nccl "
        "with GPUs, else gloo)",
    ),
    argument(
        "--launcher",
        default=None,
        help="start: ipyparallel engine launcher, mpi (default), or slurm, ssh, ... for other "
        "hosts; export: mpiexec, torchrun or slurm (default: how the cluster was started)",
    ),
    argument(
        "--timeout", type=float, default=None, help="start, restart: seconds to wait for the ranks"
    ),
    argument(
        "--tf-ps",
        type=int,
        default=None,
        help="start, restart: this many ranks serve as TensorFlow parameter servers, the rest "
        "as workers; the notebook coordinates (hvdnb.tf_cluster_resolver()); restart "
        "--tf-ps 0: no parameter servers again",
    ),
    argument(
        "--min-np",
        type=int,
        default=None,
        help="start, restart: an elastic cluster that goes on while at least this many ranks "
        "live (a rank's death costs a step inside hvd.elastic.run / hvdnb.elastic.run); "
        "restart --min-np 0: a fixed-size cluster again",
    ),
    argument(
        "--max-np",
        type=int,
        default=None,
        help="start, restart: the most ranks `%%dist scale` may give an elastic cluster "
        "(default: -n)",
    ),
    argument(
        "--oversubscribe",
        action="store_true",
        help="start, restart: allow more ranks than this host has cores (or GPUs)",
    ),
    argument(
        "--hosts",
        default=None,
        metavar="HOSTFILE",
        help="MPI hostfile (host[:slots] per line): one MPI job across those hosts",
    ),
    argument(
        "--ip",
        default=None,
        help="address the controller listens on when ranks run on other hosts "
        "(default: this host's address on the route to them; loopback for one host)",
    ),
    argument("--partition", default=None, help="Slurm partition (--launcher slurm)"),
    argument("--time", default=None, help="Slurm time limit, e.g. 1:00:00 (--launcher slurm)"),
    argument(
        "--gpus-per-node", type=int, default=None, help="Slurm GPUs per node (--launcher slurm)"
    ),
    argument("--account", default=None, help="Slurm account (--launcher slurm)"),
]


def dist_options(func: _F) -> _F:
    """``func`` with ``DIST_OPTIONS`` as IPython's ``@magic_arguments() @argument(...)``
    stack would give it (the decorators apply bottom-up)."""
    for option in reversed(DIST_OPTIONS):
        func = option(func)
    return magic_arguments()(func)
