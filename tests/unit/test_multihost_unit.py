"""Multi-host pieces without processes: ranks from Slurm / engine-set variables, the sbatch
script, hostfile parsing, option checks, and the store's per-host grouping."""

from __future__ import annotations

import pytest

from hvdnb.notebook.cluster.launch import hostfile_hosts, sbatch_template
from hvdnb.notebook.cluster.lifecycle import Cluster, ClusterError
from hvdnb.notebook.metrics.store import MetricsStore
from hvdnb.rank import rendezvous

_CLEAN = (
    "PMI_RANK",
    "PMI_SIZE",
    "PMI_FD",
    "PMIX_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "MPI_LOCALNRANKS",
    "RANK",
    "WORLD_SIZE",
    "HVDNB_WORLD_SIZE",
    "HVDNB_RANK_BASE",
)


@pytest.fixture
def fresh_world(monkeypatch):
    for k in _CLEAN:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(rendezvous, "_WORLD", None)
    yield monkeypatch
    rendezvous._WORLD = None


def test_ranks_under_srun_without_pmi_come_from_slurm(fresh_world):
    fresh_world.setenv("SLURM_PROCID", "5")
    fresh_world.setenv("SLURM_NTASKS", "8")
    fresh_world.setenv("SLURM_LOCALID", "1")
    fresh_world.setenv("SLURM_NNODES", "2")
    fresh_world.setenv("SLURM_NODEID", "1")
    fresh_world.setenv("SLURM_TASKS_PER_NODE", "4(x2)")
    w = rendezvous.discover()
    assert (w.rank, w.size, w.local_rank, w.local_size, w.cross_rank, w.cross_size, w.source) == (
        5,
        8,
        1,
        4,
        1,
        2,
        "slurm",
    )
    assert w.comm is None  # rendezvous goes through the notebook


def test_uneven_slurm_tasks_per_node(fresh_world):
    for k, v in dict(
        SLURM_PROCID="4",
        SLURM_NTASKS="5",
        SLURM_LOCALID="0",
        SLURM_NNODES="2",
        SLURM_NODEID="1",
        SLURM_TASKS_PER_NODE="4,1",
    ).items():
        fresh_world.setenv(k, v)
    assert rendezvous.discover().local_size == 1


def test_engine_set_numbers_ranks_across_sets(fresh_world):
    for k, v in dict(
        HVDNB_RANK_BASE="4", HVDNB_WORLD_SIZE="8", HVDNB_CROSS_RANK="1", HVDNB_CROSS_SIZE="2"
    ).items():
        fresh_world.setenv(k, v)
    w = rendezvous.discover()
    assert (w.rank, w.size, w.cross_rank, w.cross_size, w.source) == (4, 8, 1, 2, "sets")


def test_route_addr_to_loopback_is_loopback():
    from hvdnb import host

    assert host.route_addr("127.0.0.1") == "127.0.0.1"
    assert host.ifname_of("127.0.0.1") == "lo"


def test_sbatch_script_carries_the_slurm_options():
    c = Cluster(
        n=8,
        launcher="slurm",
        ip="127.0.0.1",
        partition="gpu",
        time_limit="1:00:00",
        gpus_per_node=4,
        account="lab",
        sbatch_args=["--exclusive"],
    )
    script = sbatch_template(c, "/tmp/out")
    for line in (
        "#SBATCH --ntasks={n}",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=1:00:00",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --account=lab",
        "#SBATCH --exclusive",
        "#SBATCH --output=/tmp/out",
        "srun {program_and_args}",
    ):
        assert line in script.splitlines(), script
    assert c.multi_host and c.ip == "127.0.0.1"


def test_local_cluster_stays_on_loopback():
    c = Cluster(n=1)
    assert not c.multi_host and c.ip == "127.0.0.1"


def test_option_mistakes_are_explained(tmp_path):
    with pytest.raises(ClusterError, match="--launcher slurm"):
        Cluster(n=2, partition="gpu")
    with pytest.raises(ClusterError, match="hostfile .* not found"):
        Cluster(hosts=str(tmp_path / "nope"))
    hf = tmp_path / "hosts"
    hf.write_text("# nodes\nnode1:4\nnode2 slots=4\n\n")
    assert hostfile_hosts(str(hf)) == ["node1", "node2"]
    with pytest.raises(ClusterError, match="Slurm chooses"):
        Cluster(n=2, launcher="slurm", hosts=str(hf), ip="127.0.0.1")
    with pytest.raises(ClusterError, match="engine sets hold 2"):
        Cluster(n=3, engine_sets=[{"n": 1}, {"n": 1}], ip="127.0.0.1")
    c = Cluster(n=8, hosts=str(hf), ip="127.0.0.1")  # more ranks than local cores: fine
    assert c.multi_host and c.n == 8


def test_store_groups_ranks_by_host():
    s = MetricsStore()
    for r in range(6):
        s.on_rank_info({"kind": "rank_info", "rank": r, "host": f"n{r // 3}", "local_rank": r % 3})
        s.ingest(
            {
                "kind": "metrics",
                "rank": r,
                "seq": 1,
                "pid": 1,
                "step": 3,
                "step_time": 0.1 * (r + 1),
                "cols": {"loss": [[3], [0.0], [float(r)]]},
            }
        )
    assert s.hosts() == {"n0": [0, 1, 2], "n1": [3, 4, 5]}
    h = {x["host"]: x for x in s.host_summary()}
    assert (h["n1"]["loss_min"], h["n1"]["loss_median"], h["n1"]["loss_max"]) == (3.0, 4.0, 5.0)
    assert h["n0"]["step_time_max"] == pytest.approx(0.3)


def test_hostfile_slots_give_the_default_rank_count(tmp_path):
    from hvdnb.notebook.cluster.launch import hostfile_slots

    f = tmp_path / "hosts"
    f.write_text("# comment\ngpu1:4\ngpu2 slots=2\ngpu3\n\n")
    assert hostfile_slots(str(f)) == 7
