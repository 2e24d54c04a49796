"""The pieces of an elastic cluster across hosts that need no host: where each slot runs,
what a rank's place is after a change, what travels in the environment, and the line a
lost host is named in. The whole journey runs in ``tests/multihost/test_elastic_hosts.py``."""

from __future__ import annotations

import pytest

from hvdnb.notebook.cluster.elastic import Event
from hvdnb.notebook.cluster.spec import hostfile_entries, hostfile_slots
from hvdnb.notebook.cluster.sshslots import Placement, forwarded
from hvdnb.rank.elastic import place_of


def test_a_hostfile_gives_its_hosts_and_their_slots_in_order(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# the lab\nh1:2\nh2 slots=3\nh3\n\n")
    assert hostfile_entries(str(f)) == [("h1", 2), ("h2", 3), ("h3", 1)]
    assert hostfile_slots(str(f)) == 6


def test_the_first_generation_fills_the_hosts_in_order_as_mpiexec_does():
    p = Placement([("h1", 2), ("h2", 2)])
    hosts = p.first(4)
    assert hosts == ["h1", "h1", "h2", "h2"]
    assert [p.env(s, hosts)["HVDNB_LOCAL_RANK"] for s in range(4)] == ["0", "1", "0", "1"]
    assert p.env(3, hosts) == {
        "HVDNB_LOCAL_RANK": "1",
        "HVDNB_LOCAL_SIZE": "2",
        "HVDNB_CROSS_RANK": "1",
        "HVDNB_CROSS_SIZE": "2",
    }


def test_a_scale_puts_new_slots_on_free_hosts_that_answer_ssh():
    p = Placement([("h1", 2), ("h2", 2)])
    p.host_of = {0: "h1", 1: "h1", 2: "h2", 3: "h2"}
    # h2's ranks were lost: its two slots are free again
    assert p.free([0, 1], 2, lambda h: True) == ["h2", "h2"]
    # h2 away: no room elsewhere, and the line names it
    with pytest.raises(LookupError, match=r"room for 0 more rank\(s\), not 2 \(h2 did not answer"):
        p.free([0, 1], 2, lambda h: h != "h2")
    # one slot lost on each host: each host gets one back
    assert p.free([0, 2], 2, lambda h: True) == ["h1", "h2"]


def test_a_rank_knows_its_place_among_the_survivors_hosts():
    members, hosts = [0, 1, 4, 5], ["h1", "h1", "h2", "h2"]
    assert place_of(members, hosts, 5) == (1, 2, 1, 2)
    assert place_of([1, 4], ["h1", "h2"], 4) == (0, 1, 1, 2)
    assert place_of(members, None, 5) is None  # one host: the rank's number is its place


def test_the_notebook_environment_travels_but_this_hosts_own_variables():
    env = {
        "PATH": "/x",
        "HVDNB_HOME": "/h",
        "HOSTNAME": "login",
        "SSH_CONNECTION": "a b",
        "PWD": "/w",
        "JPY_PARENT_PID": "7",
        "OMP_NUM_THREADS": "1",
    }
    assert forwarded(env) == {"PATH": "/x", "HVDNB_HOME": "/h", "OMP_NUM_THREADS": "1"}


def test_a_lost_host_is_named_with_its_ranks_in_one_line():
    ev = Event(0.0, 1, (2, 3), 2, "lost", hosts=("h2",))
    assert ev.line(2) == (
        "hvdnb: host h2 (ranks 2,3) of generation 0 were lost (gone from the controller: "
        "killed, or cut off); training goes on with 2 ranks (generation 1)"
    )
    one = Event(0.0, 2, (1,), 1, "died", hosts=("h2",))
    assert one.line(1).startswith("hvdnb: host h2 (rank 1) of generation 1 died;")
    below = Event(0.0, 1, (2, 3), 0, "lost", hosts=("h2",))
    assert "which leaves fewer than --min-np 3 ranks" in below.line(3)
