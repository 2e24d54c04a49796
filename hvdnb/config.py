"""Typed defaults for hvdnb, with ``HVDNB_*`` environment overrides.

This module owns every tunable default and is the only place that reads ``HVDNB_*``
variables. It must never import torch, ipyparallel or anything heavy: it is imported
by the notebook kernel, by engines and by the CLI alike.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

__all__ = ["Config", "get_config"]


@dataclass
class Config:
    """Defaults for clusters, collectives and metrics.

    Every field can be overridden by an environment variable named ``HVDNB_`` plus the
    field name in upper case, e.g. ``HVDNB_START_TIMEOUT=120``.
    """

    #: ranks for ``%dist start`` without ``-n`` (0: one per GPU, else 2); ``hvdnb run -n`` sets it
    ranks: int = 0
    #: 1: ``%dist start`` allows more ranks than this host has GPUs (or cores) without
    #: ``--oversubscribe``; ranks sharing a GPU use gloo. ``hvdnb run --oversubscribe`` sets it
    oversubscribe: int = 0
    #: ``%dist start`` without ``--min-np`` starts an elastic cluster that goes on down to
    #: this many ranks (0: a fixed-size cluster); ``hvdnb run --min-np`` sets it
    min_np: int = 0
    #: an elastic cluster's most ranks for ``%dist scale`` (0: its ``-n``)
    max_np: int = 0
    #: seconds a survivor in an elastic loop waits for the notebook's next generation
    #: after a collective failed (the notebook decides within a tenth of a second)
    elastic_timeout: float = 60.0
    #: seconds an error the backends did not word as a lost peer waits for a new
    #: generation before it counts as the training code's own (which makes the rank leave)
    elastic_grace: float = 0.5
    #: warm standby for ``%dist restart`` (processes with torch imported and a spare
    #: controller): "auto" (one per rank where memory allows: ``cluster/standby.py``),
    #: "0" (off), "on" (one per rank) or a count
    standby: str = "auto"
    #: seconds to wait for engines, process groups and rendezvous before giving up
    start_timeout: float = 60.0
    #: controller heartbeat period in ms: an engine counts as registered one to three
    #: periods after it connects, so ipyparallel's 3 s default costs ~6 s per start
    heartbeat_ms: int = 100
    #: address the controller, the rendezvous store and side channels listen on
    ip: str = "127.0.0.1"
    #: 1: when ranks may run on other hosts, the controller's and engines' ZMQ traffic is
    #: encrypted and authenticated with CurveZMQ (ipyparallel's ``enable_curve``), and still
    #: signed with the session key that hvdnb's side channel shares; 0: signed only. On one
    #: host everything is on loopback and this is not used
    curve: int = 1
    #: torch.distributed collective timeout (seconds); torch's default is 30 minutes
    collective_timeout: float = 300.0
    #: how often a waiting %%distributed cell prints new output (seconds)
    output_interval: float = 0.05
    #: a ``%%distributed`` cell without ``--timeout`` interrupts its ranks after this many
    #: seconds (0: never); ``hvdnb run --timeout`` sets it, so a hung cell ends with a report
    cell_timeout: float = 0.0
    #: a cell running this long gets its ranks' positions checked for a stall (0: never)
    stall_after: float = 5.0
    #: a cell's output shown in the notebook stops at this many MB (a browser tab slows
    #: down past tens of MB): the rest goes to a file the cell names, with its last 50 lines
    #: shown; 0: no limit
    output_limit_mb: float = 5.0
    #: identical lines from several ranks are held this long to be merged (seconds)
    collapse_window: float = 0.25
    #: metrics flush interval on engines (seconds) for the first ``flush_warm`` seconds of
    #: a logging loop: the panel comes alive at once
    flush_interval: float = 0.25
    #: metrics flush interval once a loop has logged for ``flush_warm`` seconds. Each
    #: message costs the ranks CPU (packing, the socket's thread, the notebook decoding it):
    #: on 2 ranks sharing 2 cores, 1 ms steps ran 4.6 % slower at 0.25 s and 1.4 % at 1 s
    flush_interval_steady: float = 1.0
    #: seconds of logging after which a loop flushes every ``flush_interval_steady``
    flush_warm: float = 2.0
    #: while a loop logs, its collectives are timed (panel, ``hvdnb.metrics()``) on one step
    #: in k, k = this many seconds / the step time, to the nearest power of two so that
    #: ranks in lockstep time the same steps (1 to 64): on 2 ranks of 1.4 ms steps,
    #: reporting each timed collective cost ~8 us per step (0.6 %). 0: time every step
    comm_sample_interval: float = 0.008
    #: the same, once a loop has logged for ``flush_warm`` seconds (its first seconds are
    #: sampled densely, so short runs and knob effects get many timed steps): on 2 ranks of
    #: ~6 ms steps, timing every step cost +2.3 % against +1.7 % at one step in 7 (short
    #: interleaved blocks, one run, 300 pairs each)
    comm_sample_interval_steady: float = 0.05
    #: replica-drift watcher: seconds of training between two fingerprints of the
    #: parameters (``DistributedOptimizer``, ``ddp_comm_hook``), rounded to a power of two
    #: of optimizer steps so that every rank samples the same steps; 0: no fingerprints
    drift_interval: float = 1.0
    #: hvdnb.torch: DistributedOptimizer fuses gradients into buckets of at most this many bytes;
    #: CPU buckets under MPI hold at most 4 MB unless it is set
    fusion_threshold: int = 64 * 1024 * 1024
    #: hvdnb.torch: with 2 ranks under MPI, allreduces up to this size travel with their header
    #: in one message exchange (cheaper than a header exchange, then MPI_Allreduce); 0 disables
    inline_bytes: int = 64 * 1024
    #: hvdnb.torch: with more than 2 ranks under MPI, allreduces up to this size (and up to
    #: ``inline_bytes``) travel through a point-to-point butterfly that carries their check
    #: with the data; larger ones take a check round, then MPI_Allreduce. -1: 4 KB where
    #: the host has a core per rank, 64 KB where its ranks outnumber its cores (measured:
    #: MPI's own allreduce is faster above 4 KB on 16 cores, slower on 2 oversubscribed)
    butterfly_bytes: int = -1
    #: hvdnb.torch under MPI, a process set whose ranks are on more than one host: CPU
    #: allreduces of at least this many bytes move their data over a gloo group of the set
    #: (after the same check round) instead of MPI_Allreduce; -1: the measured default
    #: (``hvdnb.torch.basics.gloo_bytes``), 0: always MPI
    gloo_bytes: int = -1
    #: hvdnb.torch: a per-rank timeline file stops recording (and says so) past this size
    timeline_max_bytes: int = 64 * 1024 * 1024
    #: where ``%dist start`` shows the live panel: "side" (beside the notebook, JupyterLab's
    #: side area through jupyterlab-sidecar), "inline" (in the cell's output: classic
    #: Notebook, VS Code) or "off"
    panel: str = "side"
    #: where the run store lives (``runs.sqlite``: every run of every session); "" is
    #: ``~/.hvdnb``
    home: str = ""
    #: the run store's size bound in MB: past it, the oldest runs are deleted (0: no bound)
    runs_max_mb: float = 1024.0
    #: 1: on each rank, the frameworks users already have (PyTorch's DDP tutorial,
    #: Accelerate, the HF Trainer, Lightning) are met at their seams so that they run over
    #: the cluster (``hvdnb.rank.frameworks``); 0: they see the ranks as torch does alone
    frameworks: int = 1
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> Config:
        kwargs: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            if f.name == "extra":
                continue
            raw = os.environ.get(f"HVDNB_{f.name.upper()}")
            if raw is None:
                continue
            typ = {"float": float, "int": int, "str": str}[str(f.type)]
            try:
                kwargs[f.name] = typ(raw)
            except ValueError:
                raise ValueError(
                    f"HVDNB_{f.name.upper()}={raw!r} is not a valid {f.type}; "
                    f"unset it or give a {f.type} such as {getattr(cls, f.name)!r}"
                ) from None
        return cls(**kwargs)  # type: ignore[arg-type]


def get_config() -> Config:
    """The configuration in force now (defaults plus ``HVDNB_*`` overrides)."""
    return Config.from_env()
