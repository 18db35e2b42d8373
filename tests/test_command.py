"""The exact command and environment of every kind of launch, computed without starting anything."""
from __future__ import annotations

import pytest

from launcher.command import (RENDEZVOUS_PLACEHOLDER, HostsError, Slot, assign_slots, build_launch,
                              parse_hostfile, parse_hosts, rank_defaults, worker_argv)
from launcher.config import DistributedConfig

WORKER = worker_argv("/venv/bin/python", "/r/resnet.yaml", "/runs/x", ["train.steps=5"])
THREAD_DEFAULTS = {"TF_CPP_MIN_LOG_LEVEL": "1", "TF_NUM_INTRAOP_THREADS": "8", "TF_NUM_INTEROP_THREADS": "2",
                   "OMP_NUM_THREADS": "8", "PYTHONUNBUFFERED": "1"}


def launch(np, hosts, backend="gloo", cpus=16, user_env=None, as_root=False, iface=None):
    dist = DistributedConfig(np=np, backend=backend, network_interface=iface)
    return build_launch(dist, hosts, WORKER, user_env=user_env or {}, host_cpus=cpus, as_root=as_root)


def test_worker_command_passes_the_recipe_and_overrides_not_a_file_written_by_the_launcher():
    assert WORKER == ["/venv/bin/python", "-m", "launcher.worker", "/r/resnet.yaml", "--run-dir", "/runs/x",
                      "--set", "train.steps=5"]


def test_one_local_rank_runs_the_worker_directly():
    spec = launch(1, [("localhost", 1)])
    assert spec.argv == WORKER
    assert spec.env == {**THREAD_DEFAULTS, "TF_NUM_INTRAOP_THREADS": "16", "OMP_NUM_THREADS": "16"}
    assert spec.rank_envs == [spec.env]  # no launcher: no rank identity variables


def test_local_gloo_ranks_use_horovodrun_and_split_the_cores():
    spec = launch(2, [("localhost", 2)])
    assert spec.argv == ["horovodrun", "--gloo", "-np", "2", "-H", "localhost:2", *WORKER]
    assert spec.env == THREAD_DEFAULTS
    assert [e["HOROVOD_RANK"] for e in spec.rank_envs] == ["0", "1"]
    assert spec.rank_envs[1] == {
        **THREAD_DEFAULTS,
        "HOROVOD_HOSTNAME": "localhost", "HOROVOD_RANK": "1", "HOROVOD_SIZE": "2",
        "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "1", "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": RENDEZVOUS_PLACEHOLDER, "HOROVOD_GLOO_RENDEZVOUS_PORT": RENDEZVOUS_PLACEHOLDER,
    }


def test_two_hosts_with_gloo():
    spec = launch(4, parse_hosts("node1:2,node2:2"), iface="ib0")
    assert spec.argv == ["horovodrun", "--gloo", "-np", "4", "-H", "node1:2,node2:2",
                         "--network-interfaces", "ib0", *WORKER]
    identity = [(e["HOROVOD_HOSTNAME"], e["HOROVOD_RANK"], e["HOROVOD_LOCAL_RANK"], e["HOROVOD_CROSS_RANK"],
                 e["HOROVOD_CROSS_SIZE"]) for e in spec.rank_envs]
    assert identity == [("node1", "0", "0", "0", "2"), ("node1", "1", "1", "0", "2"),
                        ("node2", "2", "0", "1", "2"), ("node2", "3", "1", "1", "2")]


def test_mpi_uses_mpirun_and_forwards_each_variable_with_x():
    spec = launch(4, parse_hosts("node1:2,node2:2"), backend="mpi", as_root=True, iface="eth1")
    assert spec.argv == [
        "mpirun", "-np", "4", "-H", "node1:2,node2:2", "-bind-to", "none", "-map-by", "slot",
        "--allow-run-as-root", "-mca", "btl_tcp_if_include", "eth1",
        "-x", "OMP_NUM_THREADS", "-x", "PYTHONUNBUFFERED", "-x", "TF_CPP_MIN_LOG_LEVEL",
        "-x", "TF_NUM_INTEROP_THREADS", "-x", "TF_NUM_INTRAOP_THREADS", *WORKER]
    assert spec.rank_envs[3]["OMPI_COMM_WORLD_RANK"] == "3"
    assert spec.rank_envs[3]["OMPI_COMM_WORLD_LOCAL_RANK"] == "1"
    assert "HOROVOD_RANK" not in spec.rank_envs[3]


def test_mpi_as_a_normal_user_does_not_allow_root():
    assert "--allow-run-as-root" not in launch(2, [("localhost", 2)], backend="mpi").argv


def test_one_rank_on_a_remote_host_still_needs_a_launcher():
    assert launch(1, [("node7", 1)]).argv[:2] == ["horovodrun", "--gloo"]


def test_the_users_own_settings_are_not_overridden():
    spec = launch(2, [("localhost", 2)], user_env={"TF_NUM_INTRAOP_THREADS": "3", "TF_CPP_MIN_LOG_LEVEL": "0"})
    assert "TF_NUM_INTRAOP_THREADS" not in spec.env and "TF_CPP_MIN_LOG_LEVEL" not in spec.env
    assert spec.env["OMP_NUM_THREADS"] == "8"


@pytest.mark.parametrize("cpus, ranks, threads", [(2, 2, "1"), (16, 3, "5"), (1, 4, "1"), (64, 8, "8")])
def test_ranks_sharing_a_host_share_its_cores(cpus, ranks, threads):
    assert rank_defaults({}, cpus, ranks)["TF_NUM_INTRAOP_THREADS"] == threads


def test_slots_fill_hosts_in_order_and_uneven_hosts_get_sensible_cross_ranks():
    slots = assign_slots([("a", 3), ("b", 1)], 4)
    assert slots == [Slot(0, "a", 0, 3, 0, 2), Slot(1, "a", 1, 3, 0, 1), Slot(2, "a", 2, 3, 0, 1),
                     Slot(3, "b", 0, 1, 1, 2)]


def test_fewer_ranks_than_slots_leave_the_last_host_unused():
    slots = assign_slots([("a", 2), ("b", 2)], 2)
    assert {s.host for s in slots} == {"a"} and slots[0].cross_size == 1


def test_more_ranks_than_slots_is_an_error_naming_np():
    with pytest.raises(HostsError, match=r"distributed.np: 5 ranks but the hosts \(a:2,b:2\) offer 4 slots"):
        assign_slots([("a", 2), ("b", 2)], 5)


@pytest.mark.parametrize("bad", ["node1", "node1:0", "node1:x", ",", ""])
def test_bad_host_entries_are_named(bad):
    with pytest.raises(HostsError, match="distributed.hosts"):
        parse_hosts(bad)


def test_hostfile_accepts_mpi_and_horovod_styles_and_comments():
    text = "# cluster\nnode1 slots=4\nnode2:2   # fast one\n\nnode3\n"
    assert parse_hostfile(text) == [("node1", 4), ("node2", 2), ("node3", 1)]


def test_hostfile_errors_name_the_line():
    with pytest.raises(HostsError, match=r"hosts.txt:2: 'node2 slots=two'"):
        parse_hostfile("node1:2\nnode2 slots=two\n", name="hosts.txt")
