"""An elastic cluster across two hosts (``%dist start --hosts FILE --min-np M``): each
slot's engine started over ssh by ipyparallel's ``SSHEngineSetLauncher``, no MPI.

The hosts are ``tests/multihost/hosts.py``'s namespaces; the notebook kernel runs on the
login node, from its kernelspec, driven over jupyter_client. Two slots per host: ranks
0-1 on h1, 2-3 on h2. A host is lost while a cell trains inside ``hvdnb.elastic.run``:
every one of its ranks killed (as a person would from a shell there), or its link cut (its
processes live on, unreachable). The survivors on h1 go on; one line names the host and
its ranks; ``%dist scale 4`` brings the host back. The figures (kill or cut to the next
step) are printed, never asserted: ``bench/bench_hosts.py`` records them.
"""

from __future__ import annotations

import json
import threading
import time

import psutil
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

#: rank 0 writes each step's (time, world size) to STEPS, and makes TRAINING at step 20
TRAIN = r"""%%distributed
import json, time, torch, hvdnb, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
state = hvdnb.State(model=model, optimizer=opt, step=0)
state.step = 0  # the last cell's commit is restored: this cell counts from 0 again
log = open(STEPS, "a") if dist.get_rank() == 0 else None

@hvdnb.elastic.run
def train(state):
    ddp = DDP(model)
    while state.step < LAST:
        x = torch.randn(16, 8)
        loss = (ddp(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        state.step += 1
        hvdnb.log(state.step, loss=loss.item())
        if dist.get_rank() == 0:
            log.write(json.dumps([time.time(), dist.get_world_size()]) + "\n"); log.flush()
            if state.step == 20:
                open(TRAINING, "w").close()
        if state.step % 5 == 0:
            state.commit()
        time.sleep(0.02)

train(state)
print("finished: size", dist.get_world_size(), "step", state.step)
"""

SIZE = "%%distributed\nimport torch.distributed as d, socket\nprint(d.get_world_size())"


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
    env = {"HYDRA_LAUNCHER_EXEC": str(hosts.ssh), "HVDNB_PANEL": "inline"}
    with Kernel(env, prefix=hosts.on("login", []), reach=LOGIN) as k:
        yield k


def _start(k: Kernel, hosts: Hosts) -> str:
    got = k.run(
        f"%dist start --hosts {hosts.dir / 'hostfile'} --ip {LOGIN} -n 4 --min-np 2",
        timeout=240,
    )
    assert got.error is None, got.traceback[-2000:]
    return got.text


def _engines_on(k: Kernel, host: str) -> list[psutil.Process]:
    """The engine processes of ``host``'s ranks, as the ranks say (the hosts share this
    machine's process ids: a person on that host would ``kill`` the same)."""
    k.run("%%distributed -q -o who\nimport os, socket\n(socket.gethostname(), os.getpid())")
    who = json.loads(k.run("import json; print(json.dumps(who))").text)
    return [psutil.Process(pid) for name, pid in who.values() if name == host]


def _train_and_lose_h2(k, tmp_path, lose) -> tuple[str, float]:
    """Train; at step 20 ``lose()`` h2. Returns the cell's text and seconds from the loss
    to rank 0's first step in the smaller generation."""
    steps, training = tmp_path / "steps", tmp_path / "training"
    at: list[float] = []

    def when_training() -> None:
        deadline = time.monotonic() + 120
        while not training.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        at.append(time.time())
        lose()

    threading.Thread(target=when_training, daemon=True).start()
    code = TRAIN.replace("STEPS", repr(str(steps))).replace("TRAINING", repr(str(training)))
    got = k.run(code.replace("LAST", "400"), timeout=240)
    assert got.error is None, got.traceback[-3000:]
    rows = [json.loads(line) for line in steps.read_text().splitlines()]
    after = [t for t, size in rows if size == 2 and t > at[0]]
    assert after, (rows[-5:], got.text[-3000:])  # rank 0 trained on in the generation of 2
    return got.text, after[0] - at[0]


def test_elastic_across_hosts_numbers_by_host_and_survives_a_killed_host(login, hosts, tmp_path):
    text = _start(login, hosts)
    assert "4 ranks ready" in text and "elastic" in text, text
    check_numbering(where(login), master=LOGIN)  # the store is the notebook's
    victims = _engines_on(login, "h2")
    assert len(victims) == 2, victims

    def kill() -> None:
        for p in victims:
            p.kill()

    text, seconds = _train_and_lose_h2(login, tmp_path, kill)
    print(f"host killed -> next step: {seconds:.2f} s")  # a figure, not a check
    # the controller hears of it before ssh's waitpid does: killed or cut, it cannot tell
    line = "hvdnb: host h2 (ranks 2,3) of generation 0 were lost (gone from the controller"
    assert line in text and "training goes on with 2 ranks (generation 1)" in text, text
    assert "finished: size 2 step 400" in text and "Traceback" not in text, text
    got = login.run(SIZE)
    assert got.error is None and "[0,1] 2" in got.text, got
    # the host comes back: its two slots are free again
    got = login.run("%dist scale 4", timeout=240)
    assert got.error is None and "now has 4 ranks" in got.text, got
    back = where(login)
    assert [back[r]["host"] for r in range(4)] == ["h1", "h1", "h2", "h2"], back
    assert [back[r]["LOCAL_RANK"] for r in range(4)] == [0, 1, 0, 1], back


def test_a_cut_link_loses_the_host_and_the_survivors_go_on(login, hosts, tmp_path):
    status = login.run("%dist status").text
    if "4 rank" not in status:
        login.run("%dist stop", timeout=60)
        _start(login, hosts)
    text, seconds = _train_and_lose_h2(login, tmp_path, lambda: hosts.cut("h2"))
    try:
        print(f"link cut -> next step: {seconds:.2f} s")  # a figure, not a check
        assert "hvdnb: host h2 (ranks 2,3) of generation" in text, text
        assert "were lost" in text and "training goes on with 2 ranks" in text, text
        assert "step 400" in text and "Traceback" not in text, text
        got = login.run(SIZE)
        assert got.error is None and "[0,1] 2" in got.text, got
        # while h2 is away, a scale says so in one line
        got = login.run("%dist scale 4", timeout=120)
        assert "h2 did not answer ssh" in got.text, got
    finally:
        hosts.mend("h2")
    hosts.wait_ssh("h2")
    got = login.run("%dist scale 4", timeout=240)
    assert got.error is None and "now has 4 ranks" in got.text, got
    got = login.run(SIZE)
    assert "[0-3] 4" in got.text or "[0,1,2,3] 4" in got.text, got
    # a stop while a host is cut off ends (no ssh to it waits past its timeouts), and the
    # host's engines end too: their controller is gone (ipyparallel's heartbeat ends them,
    # as seen here), or the kill reaches them once the link is back
    stranded = _engines_on(login, "h2")
    hosts.cut("h2")
    try:
        got = login.run("%dist stop", timeout=120)
        assert got.error is None and "stopped" in got.text, got
    finally:
        hosts.mend("h2")
    left = psutil.wait_procs(stranded, timeout=60)[1]
    assert not left, f"h2's engines outlived the stop and the mended link: {left}"


def test_an_elastic_restart_is_warm_on_every_host(login, hosts, tmp_path):
    """Each host keeps a standby of its own for its slots; once they are ready, a restart's
    ranks are those processes (over the same ssh slots), numbered by host as before, and a
    host lost among them is still named and survived."""
    login.run("%env HVDNB_STANDBY=auto")  # the suite turns the standby off (conftest)
    try:
        login.run("%dist stop", timeout=120)  # a fresh start: its standby follows it
        _start(login, hosts)
        line = wait_standby(login)
        assert "standby: 4 of 4 ready" in line and "(2 on h1, 2 on h2)" in line, line
        got = login.run("%dist restart", timeout=240)
        assert got.error is None and "warm" in got.text, got.traceback[-2000:]
        print(got.text)  # the restart's time, a figure
        login.run(
            "%%distributed -q -o how\nimport os, socket\n"
            "(socket.gethostname(), os.environ['HVDNB_STARTED'])"
        )
        how = json.loads(login.run("import json; print(json.dumps(how))").text)
        assert sorted(how.values()) == [["h1", "warm"]] * 2 + [["h2", "warm"]] * 2, how
        check_numbering(where(login), master=LOGIN)
        # the warm ranks are elastic as the cold ones: h2's killed, h1's go on
        victims = _engines_on(login, "h2")
        text, _ = _train_and_lose_h2(login, tmp_path, lambda: [p.kill() for p in victims])
        assert "hvdnb: host h2 (ranks 2,3) of generation 0 were lost" in text, text
        assert "finished: size 2 step 400" in text and "Traceback" not in text, text
    finally:
        login.run("%env HVDNB_STANDBY=0")
        login.run("%dist stop", timeout=120)
