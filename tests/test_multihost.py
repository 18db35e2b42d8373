"""Real multi-host runs: `lms-launch` starts ranks on other hosts over ssh, with Gloo and with MPI.

The hosts are network namespaces on this machine, each with its own sshd, hostname, CPU set and
node-local disk (tests/netns_cluster.py). Every launch needs --ssh-port and --ssh-identity-file (the
sshds listen on a non-default port and accept only the test's key) and --network-interface or
Horovod's own interface discovery. Each run is the 3D U-Net shrunk with --set, as in test_e2e.py.

What must hold: exit 0; the ranks ran on the hosts asked for; identical weights after training; the
user's variables reached the remote rank (both backends); each host's ranks split that host's CPUs;
launched from a login node that runs no rank, the run directory still lands where the user asked; a
copy back that cannot happen says from where and why; --start-timeout ends an MPI launch whose hosts
never answer. The cluster fixture fails the module if it leaves a namespace or a process behind.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

import pytest

from tests.fixtures import REPO, RECIPES, lms_launch_argv
from tests.netns_cluster import SSH_PORT, Cluster, ClusterUnavailable, check_can_build

pytestmark = [pytest.mark.e2e, pytest.mark.multihost]

TINY_UNET = ["--set", "model.input_shape=[16,16,16,4]", "--set", "model.levels=2", "--set", "model.base_filters=4",
             "--set", "train.steps=6", "--set", "logging.interval=2", "--set", "logging.tensorboard=false"]
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """node1 gets every CPU this test may use, node2 only the last one, so a correct per-host thread
    split differs between them."""
    try:
        check_can_build()
    except ClusterUnavailable as err:
        pytest.skip(f"no multi-host cluster on this machine: {err}")
    cpus = sorted(os.sched_getaffinity(0))
    made = Cluster(tmp_path_factory.mktemp("cluster"), {"node1": cpus, "node2": cpus[-1:]})
    try:
        yield made.build()
    finally:
        made.close()
        assert made.leftovers() == [], "namespaces or processes left behind"


def launch(cluster: Cluster, on: str, run_dir, *args: str, env: dict[str, str] | None = None,
           port: int = SSH_PORT, timeout_s: float = RUN_TIMEOUT_S):
    argv = lms_launch_argv(str(RECIPES / "unet3d-cpu.yaml"), "--run-dir", str(run_dir), "--no-progress",
                           "--np", "2", "-H", "node1:1,node2:1",
                           "--ssh-port", str(port), "--ssh-identity-file", str(cluster.key), *TINY_UNET, *args)
    started = time.monotonic()
    done = subprocess.run(cluster.on(on, argv, cwd=str(REPO)), env=cluster.launcher_env(env), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)
    print(f"launch from {on}: {time.monotonic() - started:.1f} s")
    return done


def check_trained_on_both_nodes(run_dir) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["host"] for r in summary["ranks"]] == ["node1", "node2"]  # each rank on its own host
    assert summary["np"] == 2 and summary["weights_in_sync"] is True
    assert sorted({r["rank"] for r in records}) == [0, 1]
    for rank in summary["ranks"]:
        assert rank["final_loss"] < rank["initial_loss"]
    return summary


def probe_records(out) -> dict[int, dict]:
    return {int(path.stem.removeprefix("rank")): json.loads(path.read_text()) for path in out.glob("rank*.json")}


def expected_threads(cluster: Cluster, host: str, ranks_on_host: int) -> str:
    """What a rank should get: its own host's CPUs over the ranks there (not the launcher's count)."""
    return str(max(1, len(cluster.hosts[host].cpus) // ranks_on_host))


USER_VARIABLES = {"NCCL_DEBUG": "WARN", "LD_LIBRARY_PATH": "/opt/lms-test/lib", "HOROVOD_CYCLE_TIME": "2",
                  "TF_ENABLE_ONEDNN_OPTS": "0"}


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_two_hosts_over_ssh(cluster, tmp_path, backend):
    probe, records = cluster.env_probe()
    user = {**USER_VARIABLES, "PYTHONPATH": str(probe), "LMS_TEST_OTHER": "1", "CUDA_VISIBLE_DEVICES": "7"}
    if backend == "mpi":
        user["OMP_NUM_THREADS"] = "1"  # the user's own setting: kept on every host, split or not
    run_dir = tmp_path / "run"
    done = launch(cluster, "node1", run_dir, "--backend", backend, "--network-interface", "eth0",
                  "--start-timeout", "60", env=user)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    check_trained_on_both_nodes(run_dir)
    assert "rank 0 runs on" not in done.stdout and "copied" not in done.stdout  # rank 0 ran here: nothing to fetch

    ranks = probe_records(records)
    assert {rank: seen["host"] for rank, seen in ranks.items()} == {0: "node1", 1: "node2"}
    remote = ranks[1]["env"]
    for key, value in USER_VARIABLES.items():  # the user's settings reached the rank on the other host
        assert remote.get(key) == value, f"{key} did not reach node2 with {backend}"
    assert "CUDA_VISIBLE_DEVICES" not in remote  # node2's GPUs are its own
    if backend == "mpi":
        # mpirun forwards only what it is told with -x; horovodrun forwards the whole environment.
        assert "LMS_TEST_OTHER" not in remote
        assert remote["OMP_NUM_THREADS"] == "1" and ranks[0]["env"]["OMP_NUM_THREADS"] == "1"
    else:
        assert remote["LMS_TEST_OTHER"] == "1"
    for rank, host in ((0, "node1"), (1, "node2")):
        assert ranks[rank]["env"]["TF_NUM_INTRAOP_THREADS"] == expected_threads(cluster, host, 1), host
    line = f"lms-launch worker on node2: {len(cluster.hosts['node2'].cpus)} usable CPU"
    assert line in done.stdout


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_from_a_login_node_the_run_directory_comes_back(cluster, tmp_path, backend):
    # node_local/ is each node's own disk: rank 0 writes its run directory on node1 only.
    run_dir = cluster.node_local / f"login-{backend}"
    done = launch(cluster, "login", run_dir, "--backend", backend,
                  *(["--network-interface", "eth0"] if backend == "mpi" else []))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "rank 0 runs on" in done.stdout and "no progress bar" in done.stdout
    summary = check_trained_on_both_nodes(run_dir)
    assert (run_dir / "recipe.yaml").is_file()
    assert "weights identical on all ranks: yes" in done.stdout  # the table printed from the fetched summary
    # The summary rank 0 wrote on node1 is the one that came back; node2 (no rank 0) has no run directory.
    on_node1 = cluster.ssh(cluster.hosts["node1"], ["cat", str(run_dir / "summary.json")])
    assert json.loads(on_node1.stdout) == summary
    on_node2 = cluster.ssh(cluster.hosts["node2"], ["test", "-e", str(run_dir)], check=False)
    assert on_node2.returncode == 1


@pytest.mark.parametrize("with_key, reason", [(True, "No such file or directory"), (False, "Permission denied")])
def test_a_fetch_that_fails_names_the_host_and_the_reason(cluster, tmp_path, with_key, reason):
    options = ["-p", str(SSH_PORT), *(["-i", str(cluster.key)] if with_key else [])]
    code = ("import sys; from pathlib import Path; from launcher.launch.remote import FetchError, fetch_run_dir\n"
            f"try: fetch_run_dir('node1', '/no/such/run', Path({str(tmp_path / 'here')!r}), {options!r}, 10)\n"
            "except FetchError as err: print(err); sys.exit(3)\n")
    done = subprocess.run(cluster.on("login", [sys.executable, "-c", code], cwd=str(REPO)),
                          env=cluster.launcher_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout.startswith("could not copy node1:/no/such/run here: ") and reason in done.stdout


SILENT_PORT = SSH_PORT + 1
SILENT_LISTENER = ("import socket, sys\n"
                   "s = socket.create_server((sys.argv[1], int(sys.argv[2])))\n"
                   "held = []\n"
                   "while True: held.append(s.accept())\n")  # accepts, never answers: a hung sshd


def test_start_timeout_ends_an_mpi_launch_whose_hosts_never_answer(cluster, tmp_path):
    pids = {}
    for host in cluster.nodes:
        started = cluster.ssh(host, ["nohup", sys.executable, "-c", shlex.quote(SILENT_LISTENER), host.name,
                                     str(SILENT_PORT), ">/dev/null", "2>&1", "&", "echo", "$!"])
        pids[host.name] = started.stdout.strip()
    try:
        began = time.monotonic()
        done = launch(cluster, "login", tmp_path / "run", "--backend", "mpi", "--start-timeout", "5",
                      port=SILENT_PORT, timeout_s=90)
        elapsed = time.monotonic() - began
    finally:
        for host in cluster.nodes:
            cluster.ssh(host, ["kill", pids[host.name]], check=False)
    # Measured: 10.8 s (5 s for mpirun's ssh, 5 s for the attempt to copy results back); without
    # ConnectTimeout mpirun was still waiting after 100 s.
    assert done.returncode not in (0, 2) and elapsed < 40, (elapsed, done.stdout[-2000:], done.stderr[-2000:])
    assert "Connection timed out during banner exchange" in done.stdout + done.stderr
    assert "no partial results: could not copy node1:" in done.stderr
