"""``%dist start --hosts`` from a login node, through hydra and ssh, onto two hosts.

The hosts are namespaces with their own address, hostname, ``/etc/hosts`` and sshd
(``tests/multihost/hosts.py`` says what is shared between them and what that hides). The
notebook kernel is started from its kernelspec on the login node and driven over
jupyter_client, as JupyterLab's server drives it; hydra reaches the hosts with the test's
own ssh key (``HYDRA_LAUNCHER_EXEC``). Two slots on each host: ranks 0-1 on h1, 2-3 on h2.
"""

from __future__ import annotations

import json
import time

import pytest

from hvdnb.notebook.headless.runner import Kernel
from tests.multihost.hosts import (
    HOSTS,
    MACHINES,
    Hosts,
    check_numbering,
    wait_standby,
    where,
    why_not,
)

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(300)]

LOGIN = MACHINES["login"]


@pytest.fixture(scope="module")
def hosts():
    reason = why_not()
    if reason:
        pytest.skip(reason)
    net = Hosts()
    try:
        net.up()
    except Exception as exc:
        net.teardown()
        pytest.skip(f"cannot build the namespace hosts: {exc}")
    (net.dir / "hostfile").write_text("".join(f"{h}:2\n" for h in HOSTS))
    yield net
    net.teardown()


@pytest.fixture(scope="module")
def login(hosts):
    """The notebook kernel on the login node, with hydra pointed at the test's ssh."""
    env = {"HYDRA_LAUNCHER_EXEC": str(hosts.ssh), "HVDNB_PANEL": "inline"}
    with Kernel(env, prefix=hosts.on("login", []), reach=LOGIN) as k:
        yield k


def _start(k: Kernel, hosts: Hosts, extra: str = "") -> str:
    got = k.run(f"%dist start --hosts {hosts.dir / 'hostfile'} --ip {LOGIN} {extra}", timeout=180)
    assert got.error is None, got.traceback[-2000:]
    return got.text


TRAIN = r"""%%distributed
import torch, torch.distributed as dist, hvdnb
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(dist.get_rank())
for step in range(30):
    x = torch.randn(64, 32, generator=g)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    hvdnb.log(step, loss.item(), samples=64)
weights = [p.detach().clone() for p in model.parameters()]
same = [torch.equal(w, w0) for w, w0 in zip(weights, hvdnb.torch.broadcast_object(weights, 0))]
print("in sync:", all(same))
"""

STORE = r"""from hvdnb.notebook.metrics.store import get_store
import json
st = get_store()
print(json.dumps({"hosts": st.hosts(),
                  "steps": {r: len(st.series("loss", r)[0]) for r in range(4)}}))
"""


def test_hosts_number_the_ranks_by_host_and_ddp_trains_with_the_panel_per_host(login, hosts):
    text = _start(login, hosts)
    assert "4 ranks ready" in text, text
    # across hosts the controller's ZMQ traffic is CurveZMQ, and still signed
    got = login.run(
        "import hvdnb; c = hvdnb.current().client\n"
        "print(c.curve_serverkey is not None, len(c.session.key) > 0)"
    )
    assert got.text.split() == ["True", "True"], got
    check_numbering(where(login))
    got = login.run(TRAIN, timeout=180)
    assert got.error is None, got.traceback[-2000:]
    assert got.text.count("in sync: True") >= 1, got.text  # DDP kept every rank's weights equal
    # the live line under the cell, drawn while it trained, ends with the run's last step
    lines = [t for t in got.displayed.values() if t.startswith("run ")]
    assert any("done" in t and "step 30" in t for t in lines), got.displayed
    shown = json.loads(login.run(STORE).text)
    # the panel's store: each rank's 30 steps, and the ranks grouped by the host they ran on
    assert shown["hosts"] == {"h1": [0, 1], "h2": [2, 3]}, shown
    assert all(n == 30 for n in shown["steps"].values()), shown
    status = login.run("%dist status").text
    assert "hosts: h1 (ranks 0,1); h2 (ranks 2,3)" in status, status


#: allreduces across the hosts on both data paths (hvdnb.torch.basics.gloo_bytes): 32 MB
#: (the default limit) over gloo, 256 KB over MPI; planned, general (async), in place, one
#: rank async while the others block (Horovod allows it: both reach the same gloo call),
#: and a DistributedOptimizer bucket of 32 MB
BIG = r"""%%distributed
import torch, hvdnb.torch as hvd
from hvdnb.torch.basics import GLOO_BYTES
from hvdnb.torch.process_sets import global_process_set as gs
hvd.init()
r = hvd.rank()
n = GLOO_BYTES // 4
big = torch.full((n,), float(r + 1))
small = torch.full((1 << 16,), float(r + 1))
paths = [gs.mpi.data_backend(t.numel() * 4, t.dtype) for t in (big, small)]
a = hvd.allreduce(big, op=hvd.Sum, name="big")
b = hvd.synchronize(hvd.allreduce_async(big, op=hvd.Average, name="big.avg"))
c = hvd.allreduce(small, op=hvd.Max, name="small")
mixed = torch.full((n,), 2.0 * r)
if r == 0:
    d = hvd.synchronize(hvd.allreduce_async(mixed, op=hvd.Sum, name="mixed"))
else:
    d = hvd.allreduce(mixed, op=hvd.Sum, name="mixed")
hvd.allreduce_(big, op=hvd.Sum, name="big.inplace")
model = torch.nn.Linear(n // 2048, 2048, bias=False)
torch.nn.init.constant_(model.weight, 0.0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                               named_parameters=model.named_parameters())
model(torch.full((1, n // 2048), float(r + 1))).sum().backward()
opt.step()  # the gradient of each weight is rank+1: averaged, 2.5; SGD at lr 1: -2.5
print("paths", *paths, "got", a[0].item(), b[-1].item(), c[0].item(), d[0].item(),
      big[-1].item(), model.weight[0, 0].item())
"""


def test_large_allreduces_across_hosts_move_over_gloo_and_agree_with_small_ones_over_mpi(
    login, hosts
):
    if "ranks ready" not in login.run("%dist status").text:
        _start(login, hosts)
    got = login.run(BIG, timeout=180)
    assert got.error is None, got.traceback[-2000:]
    lines = [ln for ln in got.text.splitlines() if "paths " in ln]
    # sums of 1..4 = 10, the average 2.5, the max 4, 2*(0+1+2+3) = 12, and the bucket's
    # mean; the same line from every rank (the cell's output folds them into one, [0-3])
    assert lines == ["[0-3] paths gloo mpi got 10.0 2.5 4.0 12.0 10.0 -2.5"], got.text


def test_restart_makes_the_ranks_again_on_the_same_hosts(login, hosts):
    if "ranks ready" not in login.run("%dist status").text:
        _start(login, hosts)
    before = _pids(login)
    got = login.run("%dist restart", timeout=180)
    assert got.error is None, got.traceback[-2000:]
    assert "4 fresh ranks ready" in got.text, got.text
    check_numbering(where(login))
    after = _pids(login)
    assert not set(before.values()) & set(after.values()), (before, after)  # new processes


@pytest.mark.timeout(600)  # a loaded box: 4 standby processes import torch at once
def test_a_restart_is_warm_on_every_host(login, hosts):
    """Each host keeps a standby of its own (as many processes as it has ranks); once they
    are ready, a restart's ranks are those processes, numbered by host as before."""
    # the suite turns the standby off (conftest); a user's default is auto
    login.run("%env HVDNB_STANDBY=auto")
    try:
        _warm_restart(login, hosts)
    finally:
        login.run("%env HVDNB_STANDBY=0")


def _warm_restart(login: Kernel, hosts: Hosts) -> None:
    login.run("%dist stop", timeout=120)  # a fresh start: its standby follows it
    _start(login, hosts)
    line = wait_standby(login)
    assert "standby: 4 of 4 ready" in line and "(2 on h1, 2 on h2)" in line, line
    got = login.run("%dist restart", timeout=180)
    assert got.error is None, got.traceback[-2000:]
    login.run(
        "%%distributed -q -o how\nimport os, socket\n(socket.gethostname(), os.environ['HVDNB_STARTED'])"
    )
    how = json.loads(login.run("import json; print(json.dumps(how))").text)
    assert sorted(how.values()) == [["h1", "warm"]] * 2 + [["h2", "warm"]] * 2, how
    check_numbering(where(login))
    got = login.run(TRAIN, timeout=180)  # the warm ranks train across the hosts
    assert got.error is None and "in sync: True" in got.text, got.traceback[-2000:]


def _pids(k: Kernel) -> dict[str, int]:
    k.run("%%distributed -q -o pid\nimport os\nos.getpid()")
    return json.loads(k.run("import json; print(json.dumps(pid))").text)


def test_a_host_that_does_not_answer_ssh_is_named_in_one_line(login, hosts):
    login.run("%dist stop", timeout=60)
    hosts.stop_sshd("h2")
    try:
        t0 = time.monotonic()
        got = login.run(
            f"%dist start --hosts {hosts.dir / 'hostfile'} --ip {LOGIN} --timeout 20", timeout=120
        )
        print(f"unreachable host named after {time.monotonic() - t0:.1f} s")  # a figure
    finally:
        hosts.start_sshd("h2")
    # IPython shows a magic's UsageError as one stream line, not a traceback
    assert got.text.startswith("UsageError: "), got
    message = got.text.split(": ", 1)[1]
    assert "\n" not in message.strip(), message  # one line
    assert message.startswith("host h2 did not answer ssh"), message
    # ssh's own reason, not the start's timeout; the host that answered is not named
    assert "Connection refused" in message and "h1" not in message.split("(")[0], message
    # nothing was left running, and the next start (h2 answering again) works
    assert "4 ranks ready" in _start(login, hosts)


#: the login node's processes (the kernel and what it started: the controller, mpiexec) and
#: the ranks (``pid``: their pids, from ``_pids``) with their hydra proxies
PROCS = r"""import json, os, psutil
me = psutil.Process()
ranks = list(pid.values())
tree = {p.pid for p in me.children(recursive=True)} | set(ranks) | {me.pid}
for pid in ranks:  # hydra's proxy on each host, and what the ranks started
    try:
        p = psutil.Process(pid)
        tree |= {c.pid for c in p.children(recursive=True)} | {p.ppid()}
    except psutil.Error:
        pass
print(json.dumps({"kernel": me.pid, "pids": sorted(tree)}))
"""

#: a cell that needs every kind of connection the cluster made: the controller (the cell
#: itself), the side channel (a logged step), gloo (torch's allreduce) and MPI (hvdnb.torch)
EVERY_PATH = r"""%%distributed
import torch, torch.distributed as dist, hvdnb, hvdnb.torch as hvd
hvd.init()
x = torch.ones(4); dist.all_reduce(x)
y = hvd.allreduce(torch.ones(4), op=hvd.Sum)
hvdnb.log(0, 1.0)
print("sums", x[0].item(), y[0].item())
"""


def test_an_outsider_is_refused_or_ignored_on_every_port_and_the_next_cell_works(login, hosts):
    from tests.multihost.hosts import listening

    if "ranks ready" not in login.run("%dist status").text:
        _start(login, hosts)
    got = login.run(EVERY_PATH, timeout=120)
    assert got.error is None and got.text.count("sums 4.0 4.0") >= 1, got
    _pids(login)
    tree = json.loads(login.run(PROCS).text)
    info = login.km.get_connection_info()
    kernel_ports = {info[k] for k in info if k.endswith("_port")}  # the test's own kernel
    socks = [
        s for s in listening(tree["pids"]) if not (s[0] == tree["kernel"] and s[3] in kernel_ports)
    ]
    print("\n".join(f"{name:>16} {pid:>7} {addr}:{port}" for pid, name, addr, port in socks))
    ours = {MACHINES[m] for m in ("login", *HOSTS)} | {"127.0.0.1", "::1"}
    wildcard = [s for s in socks if s[2] not in ours]
    # MPICH's hydra binds its control port on every address (it has no option to bind one,
    # docs/howto/several-hosts.md); everything else listens on its host's cluster address
    assert {s[1] for s in wildcard} <= {"mpiexec"}, wildcard
    assert len(socks) > 10, socks  # controller, side channel, store, gloo, MPI
    knocks = {}
    for pid, name, addr, port in socks:
        if addr.startswith("127.") or addr == "::1":
            continue
        for target in [addr] if addr in ours else [MACHINES["login"]]:
            knocks[(name, target, port)] = hosts.knock(target, port)
    print("\n".join(f"{k}: {v}" for k, v in knocks.items()))
    # the outsider reached ports on every machine of the cluster: the login node's
    # controller, side channel and mpiexec; each host's store, gloo and MPI. Each answered
    # it as a stranger: refused, reset, a ZMQ greeting that goes no further (CurveZMQ, the
    # side channel's HMAC), or taken and ignored (torch's store and gloo have no
    # authentication: docs/howto/several-hosts.md says how to keep them inside); and then:
    assert {t for _, t, _ in knocks} == {MACHINES[m] for m in ("login", *HOSTS)}, knocks
    got = login.run(EVERY_PATH, timeout=120)
    assert got.error is None and got.text.count("sums 4.0 4.0") >= 1, got
