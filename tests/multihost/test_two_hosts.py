"""Two hosts made of network namespaces: engines on both, an allreduce across the veth
link, and a link cut mid-cell that ends in a clear error naming the cut host's rank.

Topology (root only, built and torn down per module): a bridge in the root namespace at
198.51.100.1/28 (in TEST-NET-2, where the notebook, controller and side channel listen) and
two namespaces ``h1`` (198.51.100.11) and ``h2`` (198.51.100.12), each joined by a veth
pair. Each host runs its own engine set (``ip netns exec hN unshare --uts`` in front of
mpiexec, so each also has its own hostname), and the client numbers the ranks across the
sets: rank 0 on h1, rank 1 on h2. Only these addresses and loopback are used.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import threading
import time

import pytest

import hvdnb
from hvdnb.notebook.cluster.lifecycle import find_mpiexec

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(240)]

NET = "198.51.100"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


class TwoHosts:
    """The bridge, namespaces and veth pairs; ``down(i)`` cuts host i's link."""

    def __init__(self) -> None:
        tag = secrets.token_hex(2)
        self.bridge = f"hvb{tag}"
        self.hosts = [f"hvdnb-{tag}-h{i}" for i in (1, 2)]
        self.names = ["h1", "h2"]
        self.addrs = [f"{NET}.11", f"{NET}.12"]
        self.veths = [f"hvb{tag}v{i}" for i in (1, 2)]

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{NET}.1/28", "dev", self.bridge)  # not the /24: hosts.PREFIX
        _ip("link", "set", self.bridge, "up")
        for ns, veth, addr in zip(self.hosts, self.veths, self.addrs):
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/28", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def down(self, i: int) -> None:
        _ip("link", "set", self.veths[i], "down")

    def teardown(self) -> None:
        for ns, veth in zip(self.hosts, self.veths):
            _ip("link", "del", veth, check=False)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)

    def engine_sets(self) -> list[dict]:
        mpiexec = find_mpiexec(local=True)
        return [
            {
                "n": 1,
                "host": addr,
                "mpi_cmd": [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "unshare",
                    "--uts",
                    "--",
                    "sh",
                    "-c",
                    'hostname "$0" && exec "$@"',
                    name,
                    mpiexec,
                ],
            }
            for ns, name, addr in zip(self.hosts, self.names, self.addrs)
        ]


@pytest.fixture(scope="module")
def two_hosts():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root: run as root to test two hosts")
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("iproute2 (`ip netns`) and util-linux (`unshare`) are needed")
    if _ip("netns", "list", check=False).returncode != 0:
        pytest.skip("`ip netns` does not work here (no CAP_SYS_ADMIN / netns support)")
    net = TwoHosts()
    try:
        net.up()
    except subprocess.CalledProcessError as exc:
        net.teardown()
        pytest.skip(f"cannot build test hosts: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
    yield net
    net.teardown()


@pytest.fixture
def cluster(two_hosts, shell):
    running = hvdnb.current()
    if running is not None and running.running:
        running.stop()
    c = hvdnb.Cluster(
        engine_sets=two_hosts.engine_sets(),
        ip=f"{NET}.1",
        timeout=120,
        engine_env={"HVDNB_COLLECTIVE_TIMEOUT": "6"},
    )
    c.start()
    hvdnb.notebook.cluster.lifecycle._CURRENT = c  # what %dist start does: the magics act on it
    yield c
    c.stop()


CROSS = r"""
import os, socket, torch, torch.distributed as dist
def eth0():
    for line in open("/proc/net/dev"):
        if line.strip().startswith("eth0:"):
            f = line.split(":", 1)[1].split()
            return int(f[0]), int(f[8])
rx0, tx0 = eth0()
x = torch.full((1 << 20,), float(dist.get_rank() + 1))  # 4 MiB
dist.all_reduce(x)
rx1, tx1 = eth0()
dict(rank=dist.get_rank(), size=dist.get_world_size(), host=socket.gethostname(),
     sum=float(x[0]), master=os.environ["MASTER_ADDR"], local_rank=os.environ["LOCAL_RANK"],
     ifname=os.environ.get("GLOO_SOCKET_IFNAME"), rx=rx1 - rx0, tx=tx1 - tx0,
     tf_config=__import__("json").loads(os.environ["TF_CONFIG"]),
     peers=sorted({c.raddr.ip for c in __import__("psutil").Process().net_connections("tcp")
                   if c.raddr}))
"""


def test_allreduce_crosses_the_veth_link(cluster, shell, two_hosts, capsys):
    assert cluster.client.ids == [0, 1]
    shell.run_cell_magic("distributed", "-q -o res", CROSS)
    res = shell.user_ns["res"]
    assert sorted(res) == [0, 1]
    for rank, r in res.items():
        assert (r["rank"], r["size"], r["sum"]) == (rank, 2, 3.0), r
        assert r["host"] == two_hosts.names[rank]  # each rank on its own host
        assert r["local_rank"] == "0"
        assert r["master"] == two_hosts.addrs[0]  # rank 0's address on h1, not loopback
        assert r["ifname"] == "eth0"
        other = two_hosts.addrs[1 - rank]
        assert other in r["peers"], r  # gloo's pair to the other host
        # the 4 MiB went out and came in over this host's veth
        assert r["tx"] > 4_000_000 and r["rx"] > 4_000_000, r
        # TensorFlow's TF_CONFIG: each worker on its own host's address (exchanged over the
        # torch group: these engine sets share no MPI world), and this rank's index
        workers = r["tf_config"]["cluster"]["worker"]
        assert [w.rsplit(":", 1)[0] for w in workers] == two_hosts.addrs, r
        assert r["tf_config"]["task"] == {"type": "worker", "index": rank}
        assert workers == res[0]["tf_config"]["cluster"]["worker"]
    # %dist status and the store see the two hosts
    shell.run_line_magic("dist", "status")
    out = capsys.readouterr().out
    assert "h1 (ranks 0)" in out and "h2 (ranks 1)" in out, out
    assert cluster.hosts_seen == {0: "h1", 1: "h2"}
    # nothing of ours listens beyond the test address and loopback
    import psutil

    for pid in cluster.pids() + [os.getpid()]:
        try:
            conns = psutil.Process(pid).net_connections("tcp")
        except psutil.NoSuchProcess:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN and pid in cluster.pids():
                assert c.laddr.ip in (f"{NET}.1", "127.0.0.1", *two_hosts.addrs), c


def test_cut_link_mid_cell_names_the_ranks(cluster, shell, two_hosts, capsys):
    from hvdnb.notebook.cellout.cells import DistributedCellError

    shell.run_cell_magic("distributed", "-q", "import torch, torch.distributed as dist")
    cut = threading.Timer(3.0, two_hosts.down, args=(1,))
    cut.start()
    t0 = time.monotonic()
    err = None
    try:
        shell.run_cell_magic(
            "distributed",
            "-q",
            r"""
import time
x = torch.ones(1024)
t_end = time.time() + 60
while time.time() < t_end:
    dist.all_reduce(x)
    time.sleep(0.01)
""",
        )
    except DistributedCellError as exc:
        err = exc
    except Exception as exc:  # UsageError and friends: the message is what counts
        err = exc
    took = time.monotonic() - t0
    cut.join()
    out = capsys.readouterr()
    text = f"{err}\n{out.out}\n{out.err}"
    assert err is not None or "Error" in text, text
    print(f"link cut: cell ended after {took:.1f} s\n{text}")  # a figure, not a check
    assert "rank 1" in text or "rank(s) 1" in text or "ranks 1" in text, text
