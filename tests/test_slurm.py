"""Slurm: the job's hosts and slots picked up, `--backend srun`, and real sbatch jobs on a real Slurm.

The first part checks the pure pieces (host lists against `scontrol show hostnames` itself, the slot
rule, the srun command, a task's identity, srun's reports) and the command line's refusals. The
second submits the sbatch script of docs/clusters.md to Debian's slurmctld and slurmd (with munge) on
two hosts made of network namespaces (tests/slurm_cluster.py): with --backend gloo over ssh and with
--backend srun, a 2-rank job trains on both nodes, and the two backends give the same ranks the same
losses; a rank killed under srun ends the job with that rank named; scancel stops the ranks with a
checkpoint. The cluster fixture fails the module if it leaves a namespace or a process behind.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import types
from pathlib import Path

import psutil
import pytest

from launcher import cli
from launcher.config import DistributedConfig
from launcher.launch import spawn
from launcher.launch.command import assign_slots
from launcher.launch.slurm import (SlurmError, expand_counts, expand_hostlist, job_from_env, job_overrides,
                                   rank_identity)
from launcher.rank import checkpoint as ck
from tests.fixtures import REPO, RECIPES
from tests.netns_cluster import Cluster, ClusterUnavailable, check_can_build
from tests.slurm_cluster import SlurmCluster, check_slurm_installed
from tests.test_failures import assert_nothing_left

DOCS = REPO / "docs" / "clusters.md"
# What a real sbatch job with --nodes=2 --ntasks-per-node=1 gave its batch script (Slurm 22.05, seen here).
JOB_ENV = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)",
           "SLURM_NTASKS": "2"}


def slurm_env(monkeypatch, values: dict[str, str]) -> None:
    """This process's environment as inside a job with `values` (and nothing else of Slurm's)."""
    for key in [k for k in os.environ if k.startswith("SLURM")]:
        monkeypatch.delenv(key)
    for key, value in values.items():
        monkeypatch.setenv(key, value)


# --- host lists, slots, the srun command -----------------------------------------------------------


HOST_LISTS = ["node[1-2]", "node[1-3,07],x", "n[098-101]", "n[8-10]", "gpu-a[1-2]b[3-4]", "rack[1-2]-n[1-2]",
              "n[3,1-2]", "a-1,b.x,c[5]"]


def test_host_lists_expand_as_scontrol_expands_them(tmp_path):
    if subprocess.run(["which", "scontrol"], capture_output=True).returncode != 0:
        pytest.skip("scontrol is not installed (scripts/install.sh installs slurm-client)")
    conf = tmp_path / "slurm.conf"  # scontrol needs a configuration, though expanding reads none of it
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nNodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n")
    for text in HOST_LISTS:
        done = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True,
                              env={**os.environ, "SLURM_CONF": str(conf)})
        assert done.returncode == 0, done.stderr
        assert expand_hostlist(text) == done.stdout.split(), text


@pytest.mark.parametrize("text, message", [("node[1-2", "unbalanced brackets"), ("node[3-1]", "runs backwards"),
                                           ("node[a-b]", "'a-b' is not a number or a range")])
def test_a_host_list_that_cannot_be_read_is_named(text, message):
    with pytest.raises(SlurmError, match=re.escape(message)):
        expand_hostlist(text)


def test_tasks_per_node_expand_their_repeat_counts():
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("4") == [4]
    with pytest.raises(SlurmError, match=r"SLURM_TASKS_PER_NODE='2\(3\)': '2\(3\)' is not N or N\(xK\)"):
        expand_counts("2(3)")


def test_slots_are_the_tasks_per_node_or_the_gpus_when_no_task_count_was_asked():
    tasks = job_from_env({**JOB_ENV, "SLURM_JOB_NODELIST": "g[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),1",
                          "SLURM_GPUS_PER_NODE": "4"})
    assert tasks.hosts == [("g1", 2), ("g2", 2), ("g3", 1)]  # the user asked for tasks: those
    gpus = job_from_env({"SLURM_JOB_ID": "8", "SLURM_JOB_NODELIST": "g[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)",
                         "SLURM_GPUS_PER_NODE": "a100:4"})
    assert gpus.hosts == [("g1", 4), ("g2", 4)]  # no task count: one rank per GPU
    assert job_from_env({"PATH": "/bin"}) is None
    with pytest.raises(SlurmError, match=r"gives 3 node\(s\) but SLURM_JOB_NODELIST='g\[1-2\]' names 2"):
        job_from_env({**JOB_ENV, "SLURM_JOB_NODELIST": "g[1-2]", "SLURM_TASKS_PER_NODE": "1(x3)"})


def test_inside_a_job_the_hosts_and_rank_count_come_from_it_unless_given():
    job = {**JOB_ENV, "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS": "4"}
    overrides, line = job_overrides(DistributedConfig(np=1), np_given=False, environ=job)
    assert overrides == ["distributed.hosts=node1:2,node2:2", "distributed.np=4"]  # the recipe's np=1 yields
    assert line == ("lms-launch: Slurm job 7: hosts node1:2,node2:2 from SLURM_JOB_NODELIST=node[1-2] and "
                    "SLURM_TASKS_PER_NODE=2(x2); 4 ranks (every slot)")
    overrides, line = job_overrides(DistributedConfig(np=3), np_given=True, environ=job)
    assert overrides == ["distributed.hosts=node1:2,node2:2"]
    assert line.endswith("3 ranks (distributed.np) of its 4 slots")
    # sbatch -n 3 --ntasks-per-node=2 on 2 nodes: Slurm holds 2 + 2 slots for 3 tasks, and 3 it is.
    overrides, line = job_overrides(DistributedConfig(np=1), np_given=False, environ={**job, "SLURM_NTASKS": "3"})
    assert overrides == ["distributed.hosts=node1:2,node2:2", "distributed.np=3"]
    assert line.endswith("3 ranks (SLURM_NTASKS) of its 4 slots")
    assert job_overrides(DistributedConfig(np=2, hosts="a:2"), np_given=False, environ=job) == ([], None)
    assert job_overrides(DistributedConfig(np=2), np_given=False, environ={}) == ([], None)


@pytest.mark.parametrize("env, args, message", [
    ({}, [], "distributed.backend=srun starts the ranks as the tasks of a Slurm job step; this is not inside an "
             "allocation (SLURM_JOB_ID is not set)"),
    (JOB_ENV, ["-H", "node1:1,node2:1"],
     "distributed.backend=srun runs the ranks on the job's own nodes: leave out -H"),
    ({**JOB_ENV, "SLURM_TASKS_PER_NODE": "1(x3)"}, [], "SLURM_TASKS_PER_NODE='1(x3)' gives 3 node(s)"),
    (JOB_ENV, ["--np", "3"], "distributed.np: 3 ranks but the hosts (node1:1,node2:1) offer 2 slots"),
])
def test_srun_is_refused_outside_a_job_or_with_hosts_of_its_own(monkeypatch, tmp_path, capsys, env, args, message):
    slurm_env(monkeypatch, env)
    run_dir = tmp_path / "run"
    status = cli.main([str(RECIPES / "unet3d-cpu.yaml"), "--backend", "srun", "--run-dir", str(run_dir), *args])
    assert status == 2
    assert message in capsys.readouterr().err
    assert not run_dir.exists()


def test_dry_run_in_a_job_shows_the_plan_srun_and_each_ranks_identity(monkeypatch, capsys):
    slurm_env(monkeypatch, JOB_ENV)
    assert cli.main([str(RECIPES / "unet3d-cpu.yaml"), "--backend", "srun", "--dry-run",
                     "--network-interface", "eth0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("lms-launch: Slurm job 7: hosts node1:1,node2:1 from SLURM_JOB_NODELIST=node[1-2] and "
                          "SLURM_TASKS_PER_NODE=1(x2); 2 ranks (every slot)\n")
    command = out.split("# command\n")[1].splitlines()[0]
    assert command.startswith("srun --ntasks=2 --distribution=arbitrary --kill-on-bad-exit=1 --label --export=ALL ")
    assert command.endswith("--set distributed.network_interface=eth0 --set distributed.hosts=node1:1,node2:1 "
                            "--set distributed.np=2")
    for line in ("HOROVOD_GLOO_RENDEZVOUS_ADDR='<chosen by lms-launch at start>'", "HOROVOD_GLOO_IFACE=eth0",
                 "SLURM_HOSTFILE='<chosen by lms-launch at start>'", "LMS_LAUNCH_SRUN=1"):
        assert line in out
    assert re.search(r"rank 1 on node2 \(local rank 0\): .*HOROVOD_CROSS_RANK=1 .*HOROVOD_HOSTNAME=node2 "
                     r".*HOROVOD_RANK=1 HOROVOD_SIZE=2", out)


def test_a_task_takes_its_identity_from_slurm_and_checks_where_srun_put_it():
    slots = assign_slots([("node1", 2), ("node2", 2)], 3)
    task = {"SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURMD_NODENAME": "node2"}
    assert rank_identity(task, slots) == {
        "HOROVOD_HOSTNAME": "node2", "HOROVOD_RANK": "2", "HOROVOD_SIZE": "3", "HOROVOD_LOCAL_RANK": "0",
        "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2"}
    with pytest.raises(SlurmError, match="srun put task 2 on node1 as its task 0 there; the launch planned it on "
                                         "node2 as local rank 0"):
        rank_identity({**task, "SLURMD_NODENAME": "node1"}, slots)
    with pytest.raises(SlurmError, match="srun started task 3, but the launch planned 3 ranks"):
        rank_identity({**task, "SLURM_PROCID": "3"}, slots)


def test_srun_lines_and_reports_are_read():
    # As srun 22.05 printed them when task 1 of 2 was killed (this file's test with a real Slurm).
    output = spawn.RankOutput(single_rank=False, srun=True)
    for line in ["0: step 4/100000  loss -0.3792", "1: lms-launch worker on node2: 1 usable CPU",
                 "srun: error: node2: task 1: Killed", "srun: launch/slurm: _step_signal: Terminating StepId=1.0",
                 "0: slurmstepd-node1: error: *** STEP 1.0 ON node1 CANCELLED AT 2026-11-27T14:40:16 ***",
                 "srun: error: node1: task 0: Terminated", "srun: error: node3: tasks 2-3,5: Exited with exit code 3"]:
        output.feed(line)
    assert output.exits == [spawn.RankExit(1, 137, 9), spawn.RankExit(0, 143, 15), spawn.RankExit(2, 3),
                            spawn.RankExit(3, 3), spawn.RankExit(5, 3)]
    assert output.culprit().describe() == "rank 1 was ended by signal 9 (SIGKILL)"
    assert output.tail(1) == ["lms-launch worker on node2: 1 usable CPU"]


@pytest.mark.parametrize("node_lost", [True, False])
def test_a_rank_ended_by_slurms_stop_is_a_failure_only_where_a_node_was_lost(capsys, node_lost):
    # Slurm stops a job whose node it declared lost (SIGTERM to the batch script): whether the rank left
    # on node1 is stopped (143) or fails first depends on timing. Stopped after a lost node, the
    # launcher still names the node and fails; stopped without one, the user asked for it.
    output = spawn.RankOutput(single_rank=False, srun=True)
    lines = ["srun: error: Node failure on node2"] if node_lost else []
    for line in lines + ["srun: forcing job termination", "srun: error: node1: task 0: Terminated"]:
        output.feed(line)
    launch = types.SimpleNamespace(returncode=-signal.SIGTERM)
    stop = types.SimpleNamespace(received=[signal.SIGTERM])
    status = spawn._outcome(launch, ranks=None, output=output, signals=stop, killed_after_rank_exit=None)
    err = capsys.readouterr().err
    if node_lost:
        assert status == spawn.EXIT_RANK_FAILED
        assert err.splitlines()[:2] == [
            "lms-launch: node node2 was lost (srun: Node failure on node2); its ranks ended with it",
            "lms-launch: a rank failed: rank 0 was ended by signal 15 (SIGTERM)"]
    else:
        assert status == 128 + signal.SIGTERM
        assert err == "lms-launch: the ranks stopped after SIGTERM\n"


# --- a real Slurm ------------------------------------------------------------------------------------


TINY_UNET = ["--set", "model.input_shape=[16,16,16,4]", "--set", "model.levels=2", "--set", "model.base_filters=4",
             "--set", "lms.enabled=false", "--set", "logging.interval=2", "--set", "logging.tensorboard=false",
             "--no-progress"]
JOB_TIMEOUT_S = 240


def sbatch_example() -> str:
    """The batch script of docs/clusters.md, as a user would copy it."""
    blocks = re.findall(r"```bash\n(.*?)```", DOCS.read_text(), flags=re.S)
    (script,) = [block for block in blocks if block.startswith("#!/bin/bash\n#SBATCH")]
    return script


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    try:
        check_can_build()
        check_slurm_installed()
    except ClusterUnavailable as err:
        pytest.skip(f"no Slurm cluster on this machine: {err}")
    cpus = sorted(os.sched_getaffinity(0))
    cluster = Cluster(tmp_path_factory.mktemp("slurm"), {"node1": cpus, "node2": cpus})
    slurm = None
    try:
        cluster.build()
        slurm = SlurmCluster(cluster).start()
        (cluster.root / "lms-launch.sbatch").write_text(sbatch_example())
        yield slurm
    finally:
        if slurm is not None:
            slurm.stop()
        cluster.close()
        assert cluster.leftovers() == [], "namespaces or processes left behind"


class Job:
    """The docs' sbatch script submitted from the repository with `args` for lms-launch."""

    def __init__(self, slurm: SlurmCluster, tmp_path: Path, *args: str, sbatch: tuple[str, ...] = ()):
        self.slurm, self.run_dir, self.out = slurm, tmp_path / "run", tmp_path / "job.out"
        tmp_path.mkdir(exist_ok=True)  # Slurm opens the output file; it makes no folder for it
        script = slurm.cluster.root / "lms-launch.sbatch"
        self.id = slurm.sbatch([f"--output={self.out}", *sbatch], script,
                               [str(RECIPES / "unet3d-cpu.yaml"), "--run-dir", str(self.run_dir), *TINY_UNET, *args],
                               cwd=str(REPO))
        self.started = time.monotonic()

    def wait(self, timeout_s: float = JOB_TIMEOUT_S) -> str:
        state = self.slurm.wait_for_job(self.id, timeout_s)
        print(f"--- job {self.id}: {state} after {time.monotonic() - self.started:.1f} s\n{self.output()}")
        return state

    def output(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def wait_for_step(self, step: int, timeout_s: float = 180) -> None:
        metrics = self.run_dir / "metrics.jsonl"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if metrics.exists() and any(json.loads(line)["step"] >= step
                                        for line in metrics.read_text().splitlines() if line.endswith("}")):
                return
            assert self.slurm.job_state(self.id) in ("PENDING", "RUNNING"), self.output()
            time.sleep(0.2)
        raise AssertionError(f"no step {step} within {timeout_s} s\n{self.output()}")

    def wait_for_exit_line(self, text: str, timeout_s: float = 60) -> None:
        """A cancelled job is CANCELLED at once; its processes end after."""
        deadline = time.monotonic() + timeout_s
        while text not in self.output() and time.monotonic() < deadline:
            time.sleep(0.2)

    def finished_cleanly(self) -> None:
        assert self.slurm.queue() == []
        assert_nothing_left(self.run_dir)


def per_rank(summary: dict) -> list[tuple]:
    return [(r["rank"], r["host"], r["initial_loss"], r["final_loss"]) for r in summary["ranks"]]


@pytest.mark.e2e
@pytest.mark.multihost
@pytest.mark.slurm
def test_an_sbatch_job_trains_on_both_nodes_with_either_backend(slurm, tmp_path):
    # Three tasks, two a node (sbatch's options win over the script's): Slurm holds 2 + 2 slots, the
    # launch runs the 3 tasks asked for, ranks 0 and 1 on node1 and rank 2 on node2, so local ranks, and
    # cross ranks over uneven hosts, come through srun's placement.
    runs = {}
    for backend, extra in (("srun", []), ("gloo", ["--backend", "gloo", "--ssh-port", "2222",
                                                    "--ssh-identity-file", str(slurm.cluster.key)])):
        job = Job(slurm, tmp_path / backend, "--set", "train.steps=6", *extra, sbatch=("--ntasks=3", "--ntasks-per-node=2"))
        assert job.wait() == "COMPLETED", job.output()
        out = job.output()
        assert out.startswith(f"lms-launch: Slurm job {job.id}: hosts node1:2,node2:2 from SLURM_JOB_NODELIST="
                              f"node[1-2] and SLURM_TASKS_PER_NODE=2(x2); 3 ranks (SLURM_NTASKS) of its 4 slots\n")
        assert f"3 rank(s) ({backend})" in out
        summary = json.loads((job.run_dir / "summary.json").read_text())
        records = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert summary["np"] == 3 and summary["weights_in_sync"] is True
        assert [r["host"] for r in summary["ranks"]] == ["node1", "node1", "node2"]
        assert sorted({r["rank"] for r in records}) == [0, 1, 2] and max(r["step"] for r in records) == 6
        runs[backend] = per_rank(summary)
        job.finished_cleanly()
    # Same recipe and seed: rank r reads the same batches whoever started it, so srun's ranks must be
    # horovodrun's ranks, on the same hosts, with the same losses.
    assert runs["srun"] == runs["gloo"]


def worker_of_rank(run_dir: Path, rank: int) -> psutil.Process:
    for process in psutil.process_iter(["cmdline"]):
        argv = process.info["cmdline"] or []
        try:
            if "launcher.worker" in argv and str(run_dir) in argv and \
                    process.environ().get("SLURM_PROCID") == str(rank):
                return process
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} of {run_dir}")


@pytest.mark.e2e
@pytest.mark.multihost
@pytest.mark.slurm
def test_a_rank_killed_under_srun_ends_the_job_and_is_named(slurm, tmp_path):
    job = Job(slurm, tmp_path, "--set", "train.steps=100000")
    job.wait_for_step(4)
    worker_of_rank(job.run_dir, 1).send_signal(signal.SIGKILL)
    killed = time.monotonic()
    assert job.wait() == "FAILED"
    assert time.monotonic() - killed < 30
    out = job.output()
    assert "srun: error: node2: task 1: Killed" in out
    assert "lms-launch: a rank failed: rank 1 was ended by signal 9 (SIGKILL)" in out
    job.finished_cleanly()


@pytest.mark.e2e
@pytest.mark.multihost
@pytest.mark.slurm
def test_scancel_stops_every_rank_after_the_same_step_with_a_checkpoint(slurm, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    job = Job(slurm, tmp_path, "--set", "train.steps=100000", "--set", f"checkpoint.dir={checkpoints}",
              "--set", "checkpoint.every_steps=0")
    job.wait_for_step(4)
    slurm.run(["scancel", job.id])
    assert job.wait() == "CANCELLED"
    job.wait_for_exit_line("lms-launch: the ranks stopped after SIGTERM")
    out = job.output()
    (saved,) = ck.scan(checkpoints)[0]
    assert saved.step >= 4
    assert f"stopped by SIGTERM after step {saved.step}: checkpoint {saved.path}" in out, out
    assert "lms-launch: the ranks stopped after SIGTERM" in out
    assert int(dict(ck.read_tensors(saved))["optimizer/adam/iteration"]) == saved.step
    job.finished_cleanly()


@pytest.mark.e2e
@pytest.mark.multihost
@pytest.mark.slurm
def test_a_node_lost_under_srun_ends_the_job_and_is_named(slurm, tmp_path):
    # Last in this file: node2 is brought back afterwards, but takes a few seconds to rejoin.
    job = Job(slurm, tmp_path, "--set", "train.steps=100000")
    job.wait_for_step(4)
    try:
        slurm.crash("node2")
        lost = time.monotonic()
        # What slurmctld does after SlurmdTimeout without an answer (300 s by default), done at once.
        slurm.run(["scontrol", "update", "NodeName=node2", "State=DOWN", "Reason=crashed by the test"])
        assert job.wait() == "NODE_FAIL"
        assert time.monotonic() - lost < 30
        out = job.output()
        assert "srun: error: Node failure on node2" in out
        assert "lms-launch: node node2 was lost (srun: Node failure on node2); its ranks ended with it" in out
        assert "lms-launch: a rank failed: rank 0" in out  # the rank left waiting for node2's
        job.wait_for_exit_line("partial results in")
        job.finished_cleanly()
    finally:
        slurm.revive("node2")
