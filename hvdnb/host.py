"""What this host offers: CPU cores, GPUs, network routes. Imported on both sides.

The notebook's launcher sizes a cluster from it (``hvdnb.notebook.cluster``) and a rank sizes
its threads and picks its rendezvous address from it (``hvdnb.rank.rendezvous``): one
definition, so the two can never disagree.

Owns: reading the host. Never: import torch or initialise CUDA (the notebook kernel must
stay CUDA-free), start processes, or open listening sockets.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "available_memory",
    "cores",
    "gpu_count",
    "ifname_of",
    "is_loopback",
    "reachable_addr",
    "route_addr",
]

#: where a container's memory limit and use are (cgroup v2, then v1)
_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    (
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes",
    ),
)


def cores() -> int:
    """CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def available_memory() -> int:
    """Bytes this process's container can still take: the host's available memory, or less
    where a cgroup limits it (Binder's 2 GB; the host's figure says nothing of that limit)."""
    import psutil  # noqa: PLC0415  only where memory is asked about

    avail = int(psutil.virtual_memory().available)
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" or a huge number: no limit
            avail = min(avail, max(0, int(limit) - usage))
        break
    return avail


def gpu_count() -> int:
    """GPUs this process may use, found without importing torch or initialising CUDA here.

    NVML lists every GPU of the host; ``CUDA_VISIBLE_DEVICES`` (which the engines inherit)
    limits what CUDA, and so each rank, can see: the smaller of the two counts.
    """
    try:
        import pynvml  # from nvidia-ml-py, the [gpu] extra  # noqa: PLC0415  pynvml is optional (the gpu extra)

        pynvml.nvmlInit()
        try:
            n = int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML: fall back to the driver's own listing
        gpus = Path("/proc/driver/nvidia/gpus")
        n = len(list(gpus.iterdir())) if gpus.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = []
        for v in visible.split(","):
            v = v.strip()
            if v == "" or v.startswith("-"):
                break  # CUDA stops at the first invalid entry: "" or "-1" hides every GPU
            ids.append(v)
        n = min(n, len(ids))
    return n


def route_addr(peer: str) -> str:
    """This host's address on the route to ``peer`` (a UDP connect sends no packet)."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return str(s.getsockname()[0])


def is_loopback(addr: str) -> bool:
    """``addr`` is reachable from this host only (``127.*``, ``localhost``, ``::1``, or the
    wildcard ``0.0.0.0`` / ``::``): never an address to hand to another host."""
    return addr in ("", "localhost", "::1", "0.0.0.0", "::") or addr.startswith("127.")


def reachable_addr(peers: Iterable[str | None] = ()) -> str:
    """The address other hosts reach this one on: the one rule, for the notebook's listen
    address (``notebook.cluster.spec``), rank 0's rendezvous (``rank.rendezvous``) and each
    TensorFlow worker (``rank.tfconfig``).

    This host's address on the route to the first of ``peers`` (names or addresses of other
    hosts; loopback ones and None are skipped) whose route is not loopback; else the address
    this host's name resolves to. Raises OSError when that does not resolve either.
    """
    for peer in peers:
        if not peer or is_loopback(peer):
            continue
        try:
            addr = route_addr(peer if ":" in peer else socket.gethostbyname(peer))
        except OSError:
            continue
        if not is_loopback(addr):
            return addr
    return socket.gethostbyname(socket.gethostname())


def ifname_of(addr: str) -> str | None:
    """The network interface that owns ``addr`` (None when none does)."""
    try:
        import psutil  # noqa: PLC0415  optional: its ImportError is handled here
    except ImportError:  # pragma: no cover - psutil is a dependency
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == addr for a in addrs):
            return str(name)
    return None
