"""The exact command and environment of every kind of launch, computed without starting anything."""
from __future__ import annotations

import pytest

from launcher.launch.command import (RENDEZVOUS_PLACEHOLDER, HostsError, Slot, assign_slots, build_launch, mpi_forwarded,
                              parse_hostfile, parse_hosts, runs_without_launcher, ssh_options, worker_argv)
from launcher.config import DistributedConfig
from launcher.launch.threads import local_rank_from_env, local_size_from_env, thread_defaults
from lms_core.config import SettingError

WORKER = worker_argv("/venv/bin/python", "/r/resnet.yaml", "/runs/x", ["train.steps=5"])
LAUNCHER_DEFAULTS = {"TF_CPP_MIN_LOG_LEVEL": "1", "PYTHONUNBUFFERED": "1"}


def threads(n: int) -> dict[str, str]:
    return {"TF_NUM_INTRAOP_THREADS": str(n), "OMP_NUM_THREADS": str(n), "TF_NUM_INTEROP_THREADS": "2"}


def launch(np, hosts, backend="gloo", cpus=16, user_env=None, as_root=False, local_hosts=None, **dist):
    config = DistributedConfig(np=np, backend=backend, **dist)
    extra = {} if local_hosts is None else {"local_hosts": frozenset(local_hosts)}
    return build_launch(config, hosts, WORKER, user_env=user_env or {}, local_cpus=cpus, as_root=as_root, **extra)


def test_worker_command_passes_the_recipe_and_overrides_not_a_file_written_by_the_launcher():
    assert WORKER == ["/venv/bin/python", "-m", "launcher.worker", "/r/resnet.yaml", "--run-dir", "/runs/x",
                      "--set", "train.steps=5"]


def test_one_local_rank_runs_the_worker_directly():
    spec = launch(1, [("localhost", 1)])
    assert spec.argv == WORKER and spec.direct
    assert spec.env == LAUNCHER_DEFAULTS
    assert spec.rank_envs == [{**LAUNCHER_DEFAULTS, **threads(16)}]  # all 16 CPUs, no rank identity


def test_local_gloo_ranks_use_horovodrun_and_split_the_cores():
    spec = launch(2, [("localhost", 2)])
    assert spec.argv == ["horovodrun", "--gloo", "-np", "2", "-H", "localhost:2", *WORKER]
    assert spec.env == LAUNCHER_DEFAULTS and not spec.direct
    assert [e["HOROVOD_RANK"] for e in spec.rank_envs] == ["0", "1"]
    assert spec.rank_envs[1] == {
        **LAUNCHER_DEFAULTS, **threads(8),
        "HOROVOD_HOSTNAME": "localhost", "HOROVOD_RANK": "1", "HOROVOD_SIZE": "2",
        "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "1", "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": RENDEZVOUS_PLACEHOLDER, "HOROVOD_GLOO_RENDEZVOUS_PORT": RENDEZVOUS_PLACEHOLDER,
    }


def test_two_hosts_with_gloo_and_every_horovodrun_flag():
    spec = launch(4, parse_hosts("node1:2,node2:2"), network_interface="ib0", ssh_port=2222,
                  ssh_identity_file="/keys/cluster", start_timeout=90)
    assert spec.argv == ["horovodrun", "--gloo", "-np", "4", "-H", "node1:2,node2:2",
                         "--network-interfaces", "ib0", "--ssh-port", "2222", "--ssh-identity-file", "/keys/cluster",
                         "--start-timeout", "90", *WORKER]
    identity = [(e["HOROVOD_HOSTNAME"], e["HOROVOD_RANK"], e["HOROVOD_LOCAL_RANK"], e["HOROVOD_CROSS_RANK"],
                 e["HOROVOD_CROSS_SIZE"]) for e in spec.rank_envs]
    assert identity == [("node1", "0", "0", "0", "2"), ("node1", "1", "1", "0", "2"),
                        ("node2", "2", "0", "1", "2"), ("node2", "3", "1", "1", "2")]


@pytest.mark.parametrize("flag, value, expected", [
    ("network_interface", "eth1", ["--network-interfaces", "eth1"]),
    ("ssh_port", 2200, ["--ssh-port", "2200"]),
    ("ssh_identity_file", "/k/id_ed25519", ["--ssh-identity-file", "/k/id_ed25519"]),
    ("start_timeout", 45, ["--start-timeout", "45"]),
])
def test_each_horovodrun_flag_alone(flag, value, expected):
    spec = launch(2, parse_hosts("node1:1,node2:1"), **{flag: value})
    assert spec.argv == ["horovodrun", "--gloo", "-np", "2", "-H", "node1:1,node2:1", *expected, *WORKER]


def test_mpi_uses_mpirun_with_every_flag_and_forwards_the_variables_ranks_need():
    user_env = {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/lib", "NCCL_DEBUG": "INFO", "NCCL_IB_HCA": "mlx5",
                "TF_NUM_INTRAOP_THREADS": "3", "HOROVOD_FUSION_THRESHOLD": "0", "OMP_PROC_BIND": "true",
                "PYTHONPATH": "/p", "CUDA_HOME": "/cuda", "CUDA_VISIBLE_DEVICES": "0", "XLA_FLAGS": "--x",
                "HOME": "/root", "SSH_AUTH_SOCK": "/s", "OMPI_MCA_btl": "tcp", "TERM": "xterm"}
    spec = launch(4, parse_hosts("node1:2,node2:2"), backend="mpi", as_root=True, user_env=user_env,
                  network_interface="eth1", ssh_port=2222, ssh_identity_file="/keys/cluster", start_timeout=90)
    assert spec.argv == [
        "mpirun", "-np", "4", "-H", "node1:2,node2:2", "-bind-to", "none", "-map-by", "slot", "--tag-output",
        "--allow-run-as-root", "-mca", "btl_tcp_if_include", "eth1", "-mca", "oob_tcp_if_include", "eth1",
        "-mca", "plm_rsh_args", "-p 2222 -i /keys/cluster -o ConnectTimeout=90",
        "-x", "CUDA_HOME", "-x", "HOROVOD_FUSION_THRESHOLD", "-x", "LD_LIBRARY_PATH", "-x", "NCCL_DEBUG",
        "-x", "NCCL_IB_HCA", "-x", "OMP_PROC_BIND", "-x", "PATH", "-x", "PYTHONPATH", "-x", "PYTHONUNBUFFERED",
        "-x", "TF_CPP_MIN_LOG_LEVEL", "-x", "TF_NUM_INTRAOP_THREADS", "-x", "XLA_FLAGS", *WORKER]
    assert spec.rank_envs[3]["OMPI_COMM_WORLD_RANK"] == "3"
    assert spec.rank_envs[3]["OMPI_COMM_WORLD_LOCAL_RANK"] == "1"
    assert "HOROVOD_RANK" not in spec.rank_envs[3]


@pytest.mark.parametrize("flag, value, expected", [
    ("network_interface", "ib0,eth0", ["-mca", "btl_tcp_if_include", "ib0,eth0", "-mca", "oob_tcp_if_include",
                                       "ib0,eth0"]),
    ("ssh_port", 2200, ["-mca", "plm_rsh_args", "-p 2200"]),
    ("ssh_identity_file", "/k/id_ed25519", ["-mca", "plm_rsh_args", "-i /k/id_ed25519"]),
    ("start_timeout", 45, ["-mca", "plm_rsh_args", "-o ConnectTimeout=45"]),
])
def test_each_mpirun_flag_alone(flag, value, expected):
    spec = launch(2, parse_hosts("node1:1,node2:1"), backend="mpi", **{flag: value})
    assert spec.argv == ["mpirun", "-np", "2", "-H", "node1:1,node2:1", "-bind-to", "none", "-map-by", "slot",
                         "--tag-output", *expected, "-x", "PYTHONUNBUFFERED", "-x", "TF_CPP_MIN_LOG_LEVEL", *WORKER]


def test_mpi_as_a_normal_user_does_not_allow_root():
    assert "--allow-run-as-root" not in launch(2, [("localhost", 2)], backend="mpi").argv


def test_forwarding_never_passes_the_launchers_gpu_list_or_mpirun_own_variables():
    assert mpi_forwarded(["CUDA_VISIBLE_DEVICES", "OMPI_COMM_WORLD_RANK", "DISPLAY", "CUDA_CACHE_PATH",
                          "TF_XLA_FLAGS", "KMP_AFFINITY", "MKL_NUM_THREADS"]) == [
        "CUDA_CACHE_PATH", "KMP_AFFINITY", "MKL_NUM_THREADS", "TF_XLA_FLAGS"]


def test_ssh_options_are_horovodruns_p_and_i():
    assert ssh_options(DistributedConfig(ssh_port=2222, ssh_identity_file="/k")) == ["-p", "2222", "-i", "/k"]
    assert ssh_options(DistributedConfig()) == []


def test_one_rank_on_a_remote_host_still_needs_a_launcher():
    spec = launch(1, [("node7", 1)])
    assert spec.argv[:2] == ["horovodrun", "--gloo"] and not spec.direct
    assert spec.rank_envs[0]["HOROVOD_HOSTNAME"] == "node7"


@pytest.mark.parametrize("hosts, direct, rank0_host", [
    ("localhost:1,node2:1", True, "localhost"),  # np=1 fills localhost only: node2 gets nothing
    ("node2:1,localhost:1", False, "node2"),
    ("127.0.0.1:4", True, "127.0.0.1"),
])
def test_the_one_rank_case_is_decided_once_and_dry_run_and_real_run_agree(hosts, direct, rank0_host):
    spec = launch(1, parse_hosts(hosts))
    assert spec.direct is direct and spec.rank0_host == rank0_host
    assert (spec.argv == WORKER) is direct  # what runs
    assert ("HOROVOD_RANK" not in spec.rank_envs[0]) is direct  # what --dry-run shows each rank gets
    assert runs_without_launcher(1, assign_slots(parse_hosts(hosts), 1)) is direct


def test_a_host_the_cli_found_to_be_this_machine_counts_as_local():
    spec = launch(1, [("login3", 1)], local_hosts={"localhost", "127.0.0.1", "login3"})
    assert spec.direct and spec.argv == WORKER


def test_threads_on_remote_hosts_are_left_to_each_rank_and_dry_run_says_so():
    spec = launch(3, parse_hosts("localhost:1,node2:2"), cpus=12)
    assert spec.rank_envs[0]["TF_NUM_INTRAOP_THREADS"] == "12"  # this machine: its 12 CPUs, 1 rank here
    remote = spec.rank_envs[2]
    assert remote["TF_NUM_INTRAOP_THREADS"] == remote["OMP_NUM_THREADS"] == \
        "<usable CPUs on node2 / 2: set by the rank at start>"
    assert remote["TF_NUM_INTEROP_THREADS"] == "2"


def test_the_users_own_settings_are_not_overridden():
    spec = launch(2, [("localhost", 2)], user_env={"TF_NUM_INTRAOP_THREADS": "3", "TF_CPP_MIN_LOG_LEVEL": "0"})
    assert "TF_CPP_MIN_LOG_LEVEL" not in spec.env
    assert "TF_NUM_INTRAOP_THREADS" not in spec.rank_envs[0]
    assert spec.rank_envs[0]["OMP_NUM_THREADS"] == "8"


@pytest.mark.parametrize("cpus, ranks, expected", [(2, 2, "1"), (16, 3, "5"), (1, 4, "1"), (64, 8, "8"), (7, 1, "7")])
def test_ranks_sharing_a_host_share_its_cores(cpus, ranks, expected):
    assert thread_defaults({}, cpus, ranks) == threads(int(expected))


def test_a_rank_reads_its_local_size_and_rank_from_whichever_launcher_started_it():
    assert local_size_from_env({"HOROVOD_LOCAL_SIZE": "4"}) == 4
    assert local_size_from_env({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}) == 3
    assert local_size_from_env({}) == 1
    assert local_rank_from_env({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}) == 2
    assert local_rank_from_env({}) == 0


@pytest.mark.parametrize("field, value, message", [
    ("ssh_port", 0, "ssh_port: must be a port number 1..65535; got 0"),
    ("ssh_port", 70000, "ssh_port: must be a port number 1..65535; got 70000"),
    ("start_timeout", 0, "start_timeout: must be >= 1 second; got 0"),
    ("ssh_identity_file", "/my keys/id", "ssh_identity_file: must be a path without spaces"),
    ("network_interface", "eth0 ib0", "network_interface: must be interface names separated by commas"),
])
def test_bad_distributed_settings_name_the_key(field, value, message):
    with pytest.raises(SettingError, match=message):
        DistributedConfig(**{field: value})


def test_slots_fill_hosts_in_order_and_uneven_hosts_get_sensible_cross_ranks():
    slots = assign_slots([("a", 3), ("b", 1)], 4)
    assert slots == [Slot(0, "a", 0, 3, 0, 2), Slot(1, "a", 1, 3, 0, 1), Slot(2, "a", 2, 3, 0, 1),
                     Slot(3, "b", 0, 1, 1, 2)]


@pytest.mark.parametrize("backend, np_flag", [("gloo", ["--gloo", "-np", "3"]), ("mpi", ["-np", "3"])])
def test_the_launch_command_is_given_only_the_slots_the_ranks_fill(backend, np_flag):
    # horovodrun --gloo starts a rank in every slot of -H, whatever -np says (seen in a Slurm job of
    # 3 tasks on 2 + 2 slots: 4 ranks started); the plan's 3 go to node1:2 and node2:1.
    spec = launch(3, parse_hosts("node1:2,node2:2,node3:4"), backend=backend)
    assert spec.argv[1:1 + len(np_flag) + 2] == [*np_flag, "-H", "node1:2,node2:1"]


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
