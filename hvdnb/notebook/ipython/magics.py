"""``%dist`` and ``%%distributed``: the notebook's handle on the cluster.

Owns: argument parsing (``magic_arguments``, so ``%dist?`` prints real help), turning bad
input into one clear ``UsageError`` (no internal traceback), and binding the magics to the
current ``hvdnb.Cluster``. Registered once, in ``hvdnb.load_ipython_extension``.

Never: run user code itself (``hvdnb.notebook.cellout.cells`` does), or leave processes
behind when a start fails.
"""

from __future__ import annotations

import time
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, magics_class
from IPython.core.magic_arguments import parse_argstring

from hvdnb.notebook.cellout import automode, cells, introspect
from hvdnb.notebook.cellout.ranklogs import format_logs
from hvdnb.notebook.cluster import health
from hvdnb.notebook.cluster import lifecycle as _cluster
from hvdnb.notebook.diagnosis.where import format_stacks, rank_stacks
from hvdnb.notebook.headless import export as _export
from hvdnb.notebook.ipython.magic_options import (
    ACTIONS,
    CELL_USAGE,
    action_of,
    argument,
    cell_magic,
    dist_options,
    given_options,
    line_magic,
    magic_arguments,
    refused,
    usage,
    without_comment,
)
from hvdnb.notebook.metrics import history
from hvdnb.notebook.metrics import store as _store
from hvdnb.notebook.metrics.knobreq import describe_change
from hvdnb.notebook.metrics.watchers import parse_settings
from hvdnb.protocol.knobs import KnobTextError, parse
from hvdnb.protocol.remote import DEBUG_COMMAND
from hvdnb.protocol.replies import DebugReply

__all__ = ["DistMagics"]


@magics_class
class DistMagics(Magics):
    """The ``%dist`` line magic and the ``%%distributed`` cell magic."""

    @line_magic
    @dist_options
    def dist(self, line: str) -> Any:
        """Start, stop, restart or inspect the cluster of ranks.

        Examples::

            %dist start -n 2          # 2 ranks under mpiexec, torch.distributed ready
            %dist start -n 8 --launcher slurm --partition gpu --time 1:00:00 --gpus-per-node 4
            %dist start --hosts hostfile   # one MPI job across the hosts in the file
            %dist status              # rank, host, pid, device, state, last cell
            %dist restart             # fresh ranks, same settings
            %dist restart -n 4 --backend gloo   # fresh ranks, these settings changed
            %dist panel               # the live panel beside the notebook (again)
            %dist panel --inline      # ... or in this cell's output
            %dist knobs               # the knobs and the last change
            %dist knobs warmup_steps=200 batch_size=64          # every rank, one step
            %dist knobs batch_size=128 --at-step 150            # at step 150
            %dist knobs lr=0.05 --after 3   # 3 s from now, e.g. into the next cell's run
            %dist watch               # the watchers' settings and this run's alarms
            %dist watch nan=stop drift=stop spike=off   # stop every rank on a NaN, ...
            %dist export train.py     # the cells that ran, as a script for mpiexec
            %dist export train.py --launcher slurm    # ... and train.sbatch
            %dist where               # every rank's live stack, identical ones merged
            %dist debug [RANK]        # pdb on the last failed cell's frames on that rank
            %dist debug 1 -c "p x" -c up   # ... a few commands, without a prompt
            %dist logs [RANK] [-n 50] # each rank's log, and how it ended
            %dist runs [--delete ID ...]; %dist compare ID ...  # every session's runs; pin
            %dist auto on             # every following cell runs on the ranks (%%local: here)
            %dist stop                # nothing left running
        """
        line = without_comment(line)
        try:
            args = parse_argstring(self.dist, line)
        except UsageError as exc:
            name = action_of(line)
            raise refused(name, f"%dist {name}: {exc}") from None
        action = ACTIONS.get(args.action)
        if action is None:
            raise UsageError(
                f"unknown %dist action {args.action!r}: use one of {', '.join(ACTIONS)}"
            )
        if args.values and not action.values:
            raise refused(
                args.action, f"%dist {args.action} takes no values ({' '.join(args.values)!r})"
            )
        given = given_options(self.dist.parser, args)  # type: ignore[attr-defined]  # set by magic_arguments()
        extra = [name for dest, name in given.items() if dest not in action.options]
        if extra:
            why = ""
            if args.action == "restart":
                why = (
                    " (a restart starts the ranks where they ran: for another launcher, "
                    "hostfile, address or Slurm job, `%dist stop` then `%dist start`)"
                )
            raise refused(args.action, f"%dist {args.action} takes no {', '.join(extra)}{why}")
        return getattr(self, f"_{args.action}")(args)

    def _start(self, args: Any) -> None:
        """Start the ranks: N engines under mpiexec (or Slurm, or a hostfile's hosts), each
        with torch.distributed initialised, mpi4py's ``COMM_WORLD`` and the torchrun variables.

        N defaults to ``$HVDNB_RANKS``, else the number of GPUs, else 2. More ranks than
        cores (or GPUs) is refused unless ``--oversubscribe`` is given. The Slurm options
        (``--partition``, ``--time``, ``--gpus-per-node``, ``--account``) go with
        ``--launcher slurm``. The live panel opens beside the notebook.
        """

        running = _cluster.current()
        if running is not None and running.running:
            raise UsageError(
                f"a cluster of {running.n} ranks is already running: `%dist stop` first, "
                "or `%dist restart` for fresh ranks"
            )
        try:
            c = _cluster.Cluster(
                n=args.n,
                backend=args.backend,
                launcher="mpi" if args.launcher is None else args.launcher,
                timeout=args.timeout,
                oversubscribe=args.oversubscribe,
                hosts=args.hosts,
                ip=args.ip,
                partition=args.partition,
                time_limit=args.time,
                gpus_per_node=args.gpus_per_node,
                account=args.account,
                tf_ps=args.tf_ps,
                min_np=args.min_np,
                max_np=args.max_np,
            )
            c.start()
        except (_cluster.ClusterError, ValueError) as exc:
            raise usage(exc) from None
        where = f"; listening on {c.ip}" if c.multi_host else ""
        if c.elastic:
            where += (
                f"; elastic: goes on down to {c.spec.min_np} rank(s) inside hvd.elastic.run / "
                f"hvdnb.elastic.run, `%dist scale N` up to {c.spec.max_np}"
            )
        print(
            f"hvdnb: {c.n} rank{'s' if c.n != 1 else ''} ready in {c.start_seconds:.1f} s "
            f"({'engines on this host' if c.elastic else 'launcher ' + c.launcher}"
            f"{' with ' + args.hosts if args.hosts else ''}, backend "
            f"{c.backend or 'auto'}{where}); "
            "use %%distributed to run a cell on every rank"
        )
        introspect.prewarm(c)
        _show_panel(c)

    def _panel(self, args: Any) -> None:
        """Open the live panel beside the notebook again (``--inline``: in this cell's output)."""
        from hvdnb.notebook.panel import show_panel  # noqa: PLC0415  the panel loads ipywidgets: only when it is shown

        show_panel(_cluster.current(), inline=args.inline)

    def _export(self, args: Any) -> None:
        """Write the ``%%distributed`` cells that ran in this session as a script (and, for
        Slurm, an sbatch file)."""

        if len(args.values) != 1:
            raise UsageError(
                "%dist export needs the script's path, e.g. `%dist export "
                "train.py [--launcher mpiexec|torchrun|slurm] [--cells ok|all]`"
            )
        c = _cluster.current()
        if c is None:
            raise UsageError(
                "no cluster in this session: start one and run the training cells, then export"
            )
        launcher = args.launcher or ("slurm" if c.launcher == "slurm" else "mpiexec")
        try:
            cells_ = _export.from_session(c, cells=args.cells)
            written, line = _export.export(
                args.values[0],
                cells_,
                n=c.n,
                launcher=launcher,
                knobs=_export.knobs_in_force(_store.get_store()),
                backend=c.backend,
                source="a notebook session",
                slurm=getattr(c, "slurm", {}),
                sbatch_args=getattr(c, "sbatch_args", ()),
            )
        except _export.ExportError as exc:
            raise UsageError(f"{exc}; nothing was written") from None
        many = "s" if len(cells_) != 1 else ""
        print(
            f"hvdnb: wrote {', '.join(map(str, written))} ({len(cells_)} cell{many}); "
            f"run it with: {line}"
        )

    def _where(self, args: Any) -> None:
        """Every rank's live stack (py-spy where it can attach), identical ones merged."""

        c = _cluster.current()
        if c is None or not c.running:
            raise UsageError("no cluster is running: `%dist start -n 2` first")
        print(format_stacks(rank_stacks(c)))

    def _logs(self, args: Any) -> None:
        """Each rank's own log (stderr outside cells, fatal-signal stacks) and how it ended."""

        c = _cluster.current()
        if c is None:
            raise UsageError("no cluster in this session: `%dist start -n 2` first")
        if len(args.values) > 1:
            raise UsageError("%dist logs takes at most one rank, e.g. `%dist logs 1 -n 50`")
        ranks = [_rank_arg(args.values[0], c.n)] if args.values else list(range(c.n))
        lines = 20 if args.n is None else args.n
        if lines < 0:
            raise UsageError(f"-n must be a number of lines >= 0, not {lines}")
        print(format_logs(c, ranks, lines))

    def _runs(self, args: Any) -> None:
        """The runs of every session in the run store (``hvdnb.runs()``), or delete some."""

        try:
            if args.delete:
                print(history.delete([*args.delete, *args.values]))
            elif args.values:
                raise refused("runs", "%dist runs takes ids only with --delete")
            else:
                print(history.runs_text(20 if args.n is None else args.n))
        except (RuntimeError, ValueError) as exc:
            raise UsageError(str(exc)) from None

    def _compare(self, args: Any) -> None:
        """Pin runs of earlier sessions to the panel's runs chart (no id: unpin them)."""

        try:
            print(history.compare(list(args.values)))
        except (RuntimeError, KeyError) as exc:
            raise UsageError(str(exc).strip("'\"")) from None

    def _debug(self, args: Any) -> None:
        """pdb on the frames of the last failed cell on one rank (default: the lowest failing
        rank)."""

        c = _cluster.current()
        if c is None or not c.running:
            raise UsageError("no cluster is running: nothing to debug")
        if len(args.values) > 1:
            raise UsageError("%dist debug takes one rank, e.g. `%dist debug 1`")
        failed = sorted(r for r, last in c.last_cell.items() if last.get("state") == "error")
        if args.values:
            rank = _rank_arg(args.values[0], c.n)
        elif failed:
            rank = failed[0]
        else:
            raise UsageError(
                "no failed cell to debug: %dist debug opens pdb where a "
                "%%distributed cell raised (its frames are kept until the next cell)"
            )
        refused = health.debug_refusal(c, rank)
        if refused:
            raise UsageError(refused)

        def send(line: str | None) -> DebugReply:
            try:
                reply: DebugReply = c.client[rank].apply_async(DEBUG_COMMAND, line).get(timeout=30)
            except Exception as exc:
                raise UsageError(f"rank {rank} did not answer the debugger: {exc}") from None
            return reply

        res = send(None)
        if res.error is not None:
            raise UsageError(f"rank {rank}: {res.error}")
        print(
            f"hvdnb: post-mortem of cell {c.last_cell.get(rank, {}).get('cell', '?')} on "
            f"rank {rank} (pdb: where, up, down, list, p EXPR, pp EXPR, any expression; "
            "q to leave)"
        )
        print(res.out, end="")
        scripted = args.commands is not None
        # IPython's splitter keeps the quotes of -c "p x": drop a matched pair
        queue = [
            q[1:-1] if len(q) > 1 and q[0] == q[-1] and q[0] in "'\"" else q
            for q in (args.commands or [])
        ]
        while True:
            if scripted:
                if not queue:
                    return
                line = queue.pop(0)
                print(f"(Pdb rank {rank}) {line}")
            else:
                try:
                    line = input(f"(Pdb rank {rank}) ")
                except (EOFError, KeyboardInterrupt):
                    return
            res = send(line)
            print(res.out, end="")
            if res.done:
                return

    def _knobs(self, args: Any) -> None:
        """Show the knobs, or change them on every rank at one step: the same validated
        request as the panel's."""

        st = _store.attach(_cluster.current())
        # knobs made by the cell just run announce themselves on the side channel, which
        # can trail the cell's reply (seen once in a suite run under load): wait a little
        deadline = time.monotonic() + 2.0
        while not st.knob_spec and time.monotonic() < deadline:
            time.sleep(0.02)
        if not args.values:
            if not st.knob_spec:
                print(
                    "hvdnb: no knobs yet: create them with hvdnb.knobs(...) in a %%distributed cell"
                )
                return
            cur = " ".join(f"{k}={v['value']:g}" for k, v in st.knob_spec.items())
            print(f"hvdnb: knobs {cur}")
            last = st.knob_status()
            if last:
                print("last change: " + describe_change(last)[0])
            return
        try:
            values = parse(args.values)
        except KnobTextError as exc:
            raise UsageError(str(exc)) from None
        if not st.knob_spec:
            raise UsageError(
                "no knobs yet: create them with hvdnb.knobs(...) in a "
                "%%distributed cell, then change them"
            )
        c = _cluster.current()
        if c is None or not c.running:
            raise UsageError("no cluster is running: `%dist start -n 2` first")
        try:
            status = _store.set_knobs(at_step=args.at_step, after=args.after, **values)
        except ValueError as exc:
            raise UsageError(f"{exc}; nothing was changed") from None
        if args.after is not None:
            print(f"hvdnb: {_fmt_values(values)} will be sent to rank 0 in {args.after:g} s")
            return
        print(f"hvdnb: {_fmt_values(values)}: {describe_change(status)[0]}")

    def _watch(self, args: Any) -> None:
        """Show the watchers' settings and this run's alarms, or change the settings."""

        st = _store.attach(_cluster.current())
        if args.values:
            try:
                st.set_watch(**parse_settings(args.values))
            except ValueError as exc:
                raise UsageError(f"{exc}; nothing was changed") from None
        print(f"hvdnb: watchers {st.watch_settings.text()}")
        lines = st.alarm_lines()
        if not args.values:
            print(f"alarms of run {st.run_id}: " + ("none" if not lines else str(len(lines))))
            for line in lines:
                print(f"  {line}")

    def _auto(self, args: Any) -> None:
        """Auto mode: ``on`` runs every following cell on the ranks, as ``%%distributed``
        (a cell starting with ``%%local``, and ``%dist`` lines, run in the notebook);
        ``off`` ends it; no value says which it is."""

        if len(args.values) > 1 or (args.values and args.values[0] not in ("on", "off")):
            raise refused("auto", f"%dist auto takes on or off, not {' '.join(args.values)!r}")
        if not args.values:
            state = "on" if automode.enabled(self.shell) else "off"
            print(f"hvdnb: auto mode is {state}")
        elif args.values[0] == "on":
            c = _cluster.current()
            if c is None or not c.running:
                raise UsageError("no cluster is running: `%dist start -n 2` first, then auto on")
            print(automode.on(self.shell))
        else:
            print(automode.off(self.shell) or "hvdnb: auto mode was off")

    def _stop(self, args: Any) -> None:
        """Stop engines, controller and mpiexec: nothing is left running."""

        c = _cluster.current()
        ended = automode.off(self.shell, "%dist stop")
        if ended:
            print(ended)
        if c is None or not c.running:
            print("hvdnb: no cluster is running")
            return
        c.stop()
        # the session's runs are on disk before this returns: a kernel killed right after
        # (a crash, the OOM killer) loses none of them
        log = _store.get_store().run_log
        if log.writing:
            log.flush(timeout=2.0)
        from hvdnb.notebook.panel import get_panel  # noqa: PLC0415  the panel loads ipywidgets: only when it is shown

        panel = get_panel(create=False)
        if panel is not None:  # the last cell of a notebook leaves a current picture
            panel.snapshot(if_stale=True)
        print("hvdnb: cluster stopped")

    def _restart(self, args: Any) -> None:
        """Stop every rank and start fresh ones: the same settings, except those given.

        The new settings are checked first: a refused restart leaves the cluster running.
        ``--tf-ps K`` gives the ranks TensorFlow parameter-server roles, ``--tf-ps 0`` takes
        them away. To change the launcher, the hosts, ``--ip`` or the Slurm options,
        ``%dist stop`` then ``%dist start``.
        """

        c = _cluster.current()
        if c is None:
            raise UsageError("no cluster to restart: `%dist start -n 2` first")
        was = _describe_cluster(c)
        try:
            c.restart(
                n=args.n,
                backend=args.backend,
                timeout=args.timeout,
                oversubscribe=True if args.oversubscribe else None,
                tf_ps=args.tf_ps,
                min_np=args.min_np,
                max_np=args.max_np,
            )
        except (_cluster.ClusterError, ValueError) as exc:
            if c.running:
                raise UsageError(f"{exc}; the running cluster ({was}) was left as it was") from None
            raise usage(exc) from None
        introspect.prewarm(c)
        now = _describe_cluster(c)
        change = f" (was {was})" if now != was else ""
        took = c.restart_seconds if c.restart_seconds is not None else c.start_seconds
        print(
            f"hvdnb: {c.n} fresh rank{'s' if c.n != 1 else ''} ready in "
            f"{took:.1f} s: {now}{change}; {_warmth(c)}"
        )

    def _scale(self, args: Any) -> None:
        """Take an elastic cluster (``--min-np``) to N ranks: the highest ranks leave, or
        new ones start and join; every rank forms the next generation of the group."""

        c = _cluster.current()
        if c is None or not c.running:
            raise UsageError("no cluster is running: `%dist start -n 2 --min-np 1` first")
        if len(args.values) != 1 or not args.values[0].isdigit():
            raise refused("scale", "%dist scale takes the number of ranks, e.g. `%dist scale 2`")
        try:
            ev = c.scale(int(args.values[0]))
        except _cluster.ClusterError as exc:
            raise usage(exc) from None
        print(ev.line(c.membership.min_np if c.membership is not None else 0))
        _store.get_store().mark("scaled")  # between cells: the panel's header takes the size

    def _status(self, args: Any) -> None:
        """A table of the ranks: rank, host, pid, device, backend, state (dead ranks
        included) and last cell."""

        c = _cluster.current()
        if c is None or not c.running:
            print("hvdnb: no cluster is running; `%dist start -n 2` starts one")
            return
        try:
            print(health.status_report(c))
        except _cluster.ClusterError as exc:
            raise usage(exc) from None

    @cell_magic
    @magic_arguments()
    @argument(
        "-t",
        "--targets",
        default=None,
        help="ranks to run on: all (default), 0, 0,2, ::2, 1:3",
    )
    @argument("-o", "--out", default=None, help="keep the per-rank results in this variable")
    @argument(
        "--timeout",
        type=float,
        default=None,
        help="interrupt the ranks still running after this many seconds",
    )
    @argument("-q", "--quiet", action="store_true", help="do not show trailing values")
    def distributed(self, line: str, cell: str) -> None:
        """Run this cell on every rank; output streams live, tagged by rank.

        Lines that several ranks print identically appear once, tagged with those ranks.
        An exception is shown once with the ranks that raised it. The stop button
        interrupts every rank.

        Examples::

            %%distributed
            import torch, torch.distributed as dist
            t = torch.ones(3) * (dist.get_rank() + 1)
            dist.all_reduce(t)
            print(dist.get_rank(), t.tolist())
        """
        line = without_comment(line)
        try:
            args = parse_argstring(self.distributed, line)
        except UsageError as exc:
            raise UsageError(
                f"%%distributed: {exc}. Usage: {CELL_USAGE}\nSee `%%distributed?` for the options."
            ) from None
        if args.out is not None and not args.out.isidentifier():
            raise UsageError(f"-o needs a variable name, not {args.out!r}. Usage: {CELL_USAGE}")
        if args.timeout is not None and not args.timeout > 0:
            raise UsageError(
                f"--timeout must be a positive number of seconds, not {args.timeout}. "
                f"Usage: {CELL_USAGE}"
            )
        c = _cluster.current()
        if c is None or not c.running:
            raise UsageError(
                "no cluster is running: run `%dist start -n 2` first, then this cell again"
            )
        try:
            result = cells.run_cell(c, cell, args.targets, timeout=args.timeout, quiet=args.quiet)
        except ValueError as exc:
            raise usage(exc) from None
        except _cluster.ClusterError as exc:
            self._auto_off_if_dead(c)
            raise usage(exc) from None
        except cells.DistributedCellError as exc:
            self._auto_off_if_dead(c, health.dead_in(exc.result.errors))
            raise
        if args.out and self.shell is not None:
            self.shell.user_ns[args.out] = result.values

    def _auto_off_if_dead(self, c: Any, seen: list[int] | None = None) -> None:
        """Auto mode ends when a rank is lost (the next cells could not run on all ranks)."""
        if automode.enabled(self.shell) and health.died_note(c, seen or ()):
            print(automode.off(self.shell, "a rank was lost"))


def _rank_arg(text: str, n: int) -> int:
    """A rank number given to a %dist action, checked against the job's ``n`` ranks."""
    try:
        rank = int(text)
    except ValueError:
        raise UsageError(f"{text!r} is not a rank number") from None
    if not 0 <= rank < n:
        raise UsageError(f"unknown rank {rank}: the ranks are 0..{n - 1}")
    return rank


def _fmt_values(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:g}" for k, v in values.items())


def _warmth(c: Any) -> str:
    """How the last restart's ranks started: from the standby, or cold and why."""
    if c.warm_ranks == c.n:
        return "warm (every rank from the standby)"
    if c.warm_ranks:
        return f"{c.warm_ranks} of {c.n} ranks warm (the standby had {c.warm_ranks}), the rest cold"
    why = c.standby.why_off or c.standby.refused or "its processes were not ready yet"
    return f"cold: no standby, because {why}"


def _describe_cluster(c: Any) -> str:
    """``2 ranks, backend gloo``: what a restart may change."""
    return f"{c.n} rank{'s' if c.n != 1 else ''}, backend {c.backend or 'auto'}"


def _show_panel(c: Any) -> None:
    """Feed the metrics store from the new cluster; show the panel where widgets render."""
    try:
        from hvdnb.notebook.panel import show_panel  # noqa: PLC0415  the panel loads ipywidgets: only when it is shown

        show_panel(c, only_with_frontend=True)
    except Exception as exc:  # the cluster is up: a panel problem must not hide that
        print(f"hvdnb: the live panel is unavailable ({type(exc).__name__}: {exc})")
