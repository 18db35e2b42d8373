"""Failures: a rank that dies or fails mid-training, Ctrl-C and SIGTERM to the launcher, out of memory.

For each, with real ranks: the launcher's exit status, what it prints (which rank, how, its last
lines; the LMS settings to try), how long it takes to end after the event, and that no process of
the run is left. Rank processes are found the way a user would find them (`ps`: their argv names
launcher.worker and the run directory; their environment their rank), and killed from outside.
"""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from launcher.rank import checkpoint as ck
from launcher.launch import spawn
from launcher.rank.oom import out_of_memory_advice
from launcher.recipe import load_recipe
from tests.fixtures import RECIPES, lms_launch_argv

TINY_UNET = ["--set", "model.input_shape=[16,16,16,4]", "--set", "model.levels=2", "--set", "model.base_filters=4",
             "--set", "logging.interval=2", "--set", "lms.enabled=false"]
LONG_RUN = ["--set", "train.steps=100000"]  # ended by the test long before it finishes
EXIT_BOUND_S = 30.0  # "within seconds": generous for a loaded 2-core CI machine; measured 1-6 s here


class Launch:
    """`lms-launch` started as a terminal would start it (its own process group), output to files."""

    def __init__(self, tmp_path: Path, *args: str, env: dict | None = None):
        self.run_dir = tmp_path / "run"
        self.out, self.err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        argv = lms_launch_argv(str(RECIPES / "unet3d-cpu.yaml"), "--run-dir", str(self.run_dir), "--no-progress",
                               *TINY_UNET, *args)
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(argv, stdout=out, stderr=err, start_new_session=True,
                                            env={**os.environ, **(env or {})})

    def wait_for_step(self, step: int, timeout: float = 180) -> None:
        metrics = self.run_dir / "metrics.jsonl"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.output()
            if metrics.exists() and any(json.loads(line)["step"] >= step
                                        for line in metrics.read_text().splitlines() if line.endswith("}")):
                return
            time.sleep(0.1)
        raise AssertionError(f"no step {step} within {timeout} s\n{self.output()}")

    def wait(self, timeout: float = 120) -> float:
        """Waits for the launcher to exit; returns the seconds it took."""
        started = time.monotonic()
        try:
            self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
        return time.monotonic() - started

    def output(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def stderr(self) -> str:
        return self.err.read_text()


def rank_process(run_dir: Path, rank: int) -> psutil.Process:
    for process in run_processes(run_dir):
        try:
            argv, environ = process.cmdline(), process.environ()
        except psutil.Error:
            continue
        if "launcher.worker" in argv and argv[argv.index("launcher.worker") - 1] == "-m" and \
                (environ.get("HOROVOD_RANK") or environ.get("OMPI_COMM_WORLD_RANK") or "0") == str(rank):
            return process
    raise AssertionError(f"no process of rank {rank} for {run_dir}")


def run_processes(run_dir: Path) -> list[psutil.Process]:
    """Live processes whose command line names this run's directory: the launcher, horovodrun or
    mpirun, the shells they start, and the ranks."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.pid == os.getpid() or process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if str(run_dir) in " ".join(process.info["cmdline"] or []):
            found.append(process)
    return found


def assert_nothing_left(run_dir: Path) -> None:
    # A killed process may take a moment to be reaped; anything still there after 2 s is a leak.
    deadline = time.monotonic() + 2
    while run_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [(p.pid, " ".join(p.cmdline())[:120]) for p in run_processes(run_dir)]
    for process in run_processes(run_dir):  # do not leak into the next test, whatever happened
        process.kill()
    assert not left, f"processes left behind: {left}"


# --- a rank dies or fails mid-training -----------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_rank_killed_mid_training_ends_the_run_and_is_named(tmp_path, backend):
    launch = Launch(tmp_path, "--np", "2", "--backend", backend, *LONG_RUN)
    launch.wait_for_step(4)
    rank_process(launch.run_dir, 1).send_signal(signal.SIGKILL)
    took = launch.wait()
    assert launch.process.returncode == spawn.EXIT_RANK_FAILED, launch.output()
    assert took < EXIT_BOUND_S
    assert "lms-launch: a rank failed: rank 1 was ended by signal 9 (SIGKILL)" in launch.stderr(), launch.output()
    assert_nothing_left(launch.run_dir)


def corrupt_record(path: Path, index: int) -> None:
    """Flips a byte in the payload of record `index` of a TFRecord file (8-byte length, 4-byte CRC of
    the length, payload, 4-byte CRC of the payload), as a bad disk or a cut copy would."""
    data = bytearray(path.read_bytes())
    offset = 0
    for _ in range(index):
        (length,) = struct.unpack_from("<Q", data, offset)
        offset += 12 + length + 4
    data[offset + 12 + 10] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.e2e
def test_a_rank_that_fails_mid_training_is_named_with_the_end_of_its_error(tmp_path):
    data = tmp_path / "data"
    written = subprocess.run(lms_launch_argv("tfrecord", "--kind", "volumes", "--out", str(data), "--synthetic", "64",
                                             "--shape", "16,16,16,4", "--labels", "3", "--shards", "2"),
                             capture_output=True, text=True)
    assert written.returncode == 0, written.stderr
    # With 2 files and 2 ranks, rank 1 alone reads the second file, in order (shuffle buffer of 1):
    # its record 24 comes in step 13 at batch 2.
    (second,) = data.glob("*-00001-of-00002.tfrecord")
    corrupt_record(second, 24)
    launch = Launch(tmp_path, "--np", "2", *LONG_RUN, "--set", "data.source=tfrecord", "--set", f"data.path={data}",
                    "--set", "data.shuffle_buffer=1")
    took = launch.wait(timeout=180)
    assert launch.process.returncode == spawn.EXIT_RANK_FAILED, launch.output()
    err = launch.stderr()
    # Rank 0, blocked in the gradient allreduce, fails too once rank 1 is gone, and horovodrun may see
    # it end first: the launcher still names rank 1, whose error started it.
    assert "lms-launch: a rank failed: rank 1 failed with an error" in err, launch.output()
    report = err[err.index("last lines of rank 1:"):]
    assert "DataLossError" in report and "corrupted record" in report  # the rank's own error, at the end
    metrics = [json.loads(line) for line in (launch.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in metrics) >= 4  # it failed mid-training, not at start-up
    assert took < 180
    assert_nothing_left(launch.run_dir)


STANDIN_LAUNCHER = textwrap.dedent("""
    # Stands in for a launch command that does not notice a rank's end (as over a network that
    # drops a host silently): two "ranks" under it, rank 1 ends after a second, rank 0 would wait
    # for it for ten minutes. Their argv names launcher.worker, as real ranks' does.
    import os, subprocess, sys
    ranks = [subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1]))",
                               seconds, "-m", "launcher.worker", sys.argv[1]],
                              env={**os.environ, "HOROVOD_RANK": str(rank)})
             for rank, seconds in ((0, "600"), (1, "1"))]
    print("[1]<stderr>:rank 1 lost its host", flush=True)
    sys.exit(max(rank.wait() for rank in ranks))
""")


def test_the_launcher_kills_ranks_left_waiting_for_a_rank_that_ended(tmp_path, monkeypatch, capsys):
    # No real launch command on one host produces this (horovodrun and mpirun end the others
    # themselves, tested above), so a stand-in plays it: what is tested is the launcher's own watch.
    monkeypatch.setattr(spawn, "RANK_EXIT_GRACE_S", 2.0)
    marker = str(tmp_path / "standin")
    started = time.monotonic()
    status = spawn.run_ranks([sys.executable, "-c", STANDIN_LAUNCHER, marker], {}, tmp_path / "metrics.jsonl",
                             total_steps=10, progress=False)
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert status == spawn.EXIT_RANK_FAILED
    assert "rank 1's process ended while the others were still running; the launcher killed the other ranks" in err
    assert "rank 1 lost its host" in err  # its last lines
    assert took < 1 + 2.0 + 10  # rank 1's second, the grace, and the kill
    assert_nothing_left(Path(marker))


# --- Ctrl-C and SIGTERM ------------------------------------------------------------------------------


STUBBORN_LAUNCHER = textwrap.dedent("""
    # Stands in for a launch whose ranks do not stop when asked (hung in a step that never ends):
    # two "ranks" that ignore SIGTERM.
    import os, subprocess, sys
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    ranks = [subprocess.Popen([sys.executable, "-c", code, "-m", "launcher.worker", sys.argv[1]],
                              env={**os.environ, "HOROVOD_RANK": str(rank)}) for rank in (0, 1)]
    sys.exit(max(rank.wait() for rank in ranks))
""")


def test_ranks_that_do_not_stop_when_asked_are_killed_after_the_grace_period(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(spawn, "STOP_GRACE_S", 1.0)
    marker = str(tmp_path / "stubborn")
    # SIGTERM to the launcher (this process) once its ranks are up.
    timer = threading.Timer(3.0, os.kill, args=(os.getpid(), signal.SIGTERM))
    timer.start()
    started = time.monotonic()
    try:
        status = spawn.run_ranks([sys.executable, "-c", STUBBORN_LAUNCHER, marker], {}, tmp_path / "metrics.jsonl",
                                 total_steps=10, progress=False)
    finally:
        timer.cancel()
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert status == 143
    assert "lms-launch: SIGTERM: the ranks stop together" in err
    assert "lms-launch: killing the ranks (still running 1 s after the request to stop)" in err
    assert took < 3 + 1 + 10
    assert_nothing_left(Path(marker))



@pytest.mark.e2e
def test_sigterm_stops_every_rank_after_the_same_step_with_a_checkpoint(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    launch = Launch(tmp_path, "--np", "2", *LONG_RUN, "--set", f"checkpoint.dir={checkpoints}",
                    "--set", "checkpoint.every_steps=0")
    launch.wait_for_step(4)
    launch.process.send_signal(signal.SIGTERM)
    took = launch.wait()
    assert launch.process.returncode == 143, launch.output()
    assert took < EXIT_BOUND_S
    assert "lms-launch: the ranks stopped after SIGTERM" in launch.stderr(), launch.output()
    (saved,) = ck.scan(checkpoints)[0]
    assert saved.step >= 4
    assert f"stopped by SIGTERM after step {saved.step}: checkpoint {saved.path}" in launch.output()
    state = dict(ck.read_tensors(saved))  # complete: the sha256 matches
    assert int(state["optimizer/adam/iteration"]) == saved.step
    assert not (launch.run_dir / "summary.json").exists()
    assert_nothing_left(launch.run_dir)


@pytest.mark.e2e
def test_ctrl_c_stops_a_run_and_saves_a_checkpoint(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    launch = Launch(tmp_path, "--np", "1", *LONG_RUN, "--set", f"checkpoint.dir={checkpoints}",
                    "--set", "checkpoint.every_steps=0")
    launch.wait_for_step(4)
    os.killpg(launch.process.pid, signal.SIGINT)  # what the terminal does: the whole foreground group
    took = launch.wait()
    assert launch.process.returncode == 130, launch.output()
    assert took < EXIT_BOUND_S
    assert "lms-launch: the ranks stopped after SIGINT" in launch.stderr()
    (saved,) = ck.scan(checkpoints)[0]
    assert f"stopped by SIGINT after step {saved.step}" in launch.output()
    assert_nothing_left(launch.run_dir)


@pytest.mark.e2e
def test_no_rank_outlives_a_launcher_killed_with_sigkill(tmp_path):
    launch = Launch(tmp_path, "--np", "2", *LONG_RUN)
    launch.wait_for_step(4)
    launch.process.send_signal(signal.SIGKILL)  # no handler runs: horovodrun hears of it from the kernel
    launch.wait()
    started = time.monotonic()
    while run_processes(launch.run_dir) and time.monotonic() - started < EXIT_BOUND_S:
        time.sleep(0.2)
    assert_nothing_left(launch.run_dir)


# --- out of memory -----------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("lms, advice", [
    ("false", ["lms.enabled=false)", "--set lms.enabled=true"]),
    # With LMS on, the rank runs the rewritten step once to check it before training: it fails there.
    ("true", ["lms.enabled=true, lms.mode=manual)", "lower lms.swapout_threshold (now 8)"]),
])
def test_out_of_memory_names_the_lms_settings_to_try(tmp_path, lms, advice):
    # A device with 48 MiB: TensorFlow's CPU allocator keeps to this limit as a GPU's allocator keeps to
    # the GPU's memory, and the 3D U-Net of unet3d-cpu.yaml (32^3) at batch 8 needs more for one step.
    run_dir = tmp_path / "run"
    argv = lms_launch_argv(str(RECIPES / "unet3d-cpu.yaml"), "--run-dir", str(run_dir), "--no-progress", "--np", "1",
                           "--set", "train.batch_size=8", "--set", "train.steps=3", "--set", f"lms.enabled={lms}",
                           "--set", "lms.mode=manual", "--set", "lms.swapout_threshold=8")
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TF_CPU_BFC_MEM_LIMIT_IN_MB": "48"})
    took = time.monotonic() - started
    assert done.returncode == spawn.EXIT_RANK_FAILED, done.stdout + done.stderr
    err = done.stderr
    assert "lms-launch: a rank failed: rank 0 exited with status 1" in err, err
    assert "rank 0 ran out of memory on CPU:" in err and "(train.batch_size=8, " in err
    assert "TensorFlow: OOM when allocating tensor with shape[8," in err
    assert "lower train.batch_size (now 8)" in err
    for text in advice:
        assert text in err
    assert "Traceback" not in err  # the advice, not a stack
    assert took < 120  # TensorFlow itself waits 10 s for memory to free before it gives up
    assert_nothing_left(run_dir)


TF_OOM_TEXT = ("{{function_node __wrapped__Conv3D_device_/job:localhost/replica:0/task:0/device:GPU:0}} OOM when "
               "allocating tensor with shape[64,32,192,192,192] and type float on /job:localhost/replica:0/task:0/"
               "device:GPU:0 by allocator GPU_0_bfc [Op:Conv3D] name: ")


@pytest.mark.parametrize("overrides, expected", [
    (["lms.enabled=false"], ["lms.enabled=false", "--set lms.enabled=true"]),
    (["lms.enabled=true", "lms.mode=auto", "lms.device_memory=16GiB"],
     ["lms.mode=auto", "auto-tuned for 16GiB x lms.memory_ratio=0.9", "--set lms.device_memory=<a smaller size>"]),
    (["lms.enabled=true", "lms.mode=manual", "lms.swapout_threshold=4"],
     ["lms.mode=manual", "lower lms.swapout_threshold (now 4)", "lms.mode=auto and lms.device_memory"]),
])
def test_the_out_of_memory_advice_fits_the_lms_settings(overrides, expected):
    recipe = load_recipe(RECIPES / "unet3d.yaml", ["train.batch_size=64", *overrides])
    advice = out_of_memory_advice(recipe, rank=3, device="GPU:0", error_text=TF_OOM_TEXT)
    assert advice.startswith("rank 3 ran out of memory on GPU:0 (train.batch_size=64")
    assert "TensorFlow: OOM when allocating tensor with shape[64,32,192,192,192] and type float" in advice
    assert "{{function_node" not in advice
    assert "lower train.batch_size (now 64)" in advice
    for text in expected:
        assert text in advice


# --- reading the launch commands' reports ----------------------------------------------------------


def test_rank_lines_and_exit_reports_of_horovodrun_are_read():
    output = spawn.RankOutput(single_rank=False)
    for line in ["[0]<stdout>:step 4/400  loss 2.1706", "[1]<stderr>:Traceback (most recent call last):",
                 "[1]<stderr>:ValueError: boom", "Process 1 exit with status code 1.",
                 "Terminating remaining workers after failure of Process 1.", "[0]<stderr>:Terminated",
                 "Process 0 exit with status code 143."]:
        output.feed(line)
    assert output.exits == [spawn.RankExit(1, 1), spawn.RankExit(0, 143)]
    assert output.tail(1) == ["Traceback (most recent call last):", "ValueError: boom"]
    assert output.exits[1].describe() == "rank 0 was ended by signal 15 (SIGTERM)"


def test_rank_lines_and_exit_reports_of_mpirun_are_read():
    output = spawn.RankOutput(single_rank=False)
    for line in ["[1,1]<stdout>:hello [1,1]<stdout>:from 1", "[1,1]<stderr>:boom",
                 "mpirun detected that one or more processes exited with non-zero status, thus causing",
                 "the job to be terminated. The first process to do so was:", "",
                 "  Process name: [[19534,1],1]", "  Exit code:    3",
                 "mpirun noticed that process rank 0 with PID 0 on node vm exited on signal 9 (Killed)."]:
        output.feed(line)
    assert output.exits == [spawn.RankExit(1, 3), spawn.RankExit(0, 137, 9)]
    assert output.tail(1) == ["hello from 1", "boom"]
    assert output.exits[0].describe() == "rank 1 exited with status 3"
    assert output.exits[1].describe() == "rank 0 was ended by signal 9 (SIGKILL)"


def test_the_rank_that_started_a_failure_is_blamed_not_the_ones_it_took_down():
    # The order horovodrun printed them in a run of the test above: rank 1's own error, then rank 0's
    # error caused by rank 1's end, and horovodrun saw rank 0 end first.
    output = spawn.RankOutput(single_rank=False)
    for line in ["[0]<stdout>:step 12/100000  loss 1.9", "[1]<stderr>:Traceback (most recent call last):",
                 "[1]<stderr>:tensorflow.python.framework.errors_impl.DataLossError: corrupted record at 22040",
                 "[0]<stderr>:Traceback (most recent call last):",
                 "[0]<stderr>:Horovod has been shut down. This was caused by an exception on one of the ranks",
                 "Process 0 exit with status code 1.", "Terminating remaining workers after failure of Process 0.",
                 "[1]<stderr>:Terminated", "Process 1 exit with status code 143."]:
        output.feed(line)
    assert output.culprit() == spawn.RankExit(1, 143, raised=True)
    assert output.culprit().describe() == "rank 1 failed with an error"

    killed = spawn.RankOutput(single_rank=False)  # a rank killed: it prints nothing, its peer's error follows
    for line in ["Process 1 exit with status code 137.", "[0]<stderr>:Traceback (most recent call last):",
                 "[0]<stderr>:Horovod has been shut down. This was caused by an exception on one of the ranks",
                 "Process 0 exit with status code 1."]:
        killed.feed(line)
    assert killed.culprit() == spawn.RankExit(1, 137)
