"""scripts/docker-check.sh: builds the CPU image (or the GPU image, `--gpu`) and runs the README's job
inside it; docker/cuda-toolkit-unpacked.sh: the CUDA 12 toolkit the GPU image builds Horovod with
where NVIDIA's images cannot be pulled.

The `docker` tests take minutes (the image build alone is about ten on 2 cores) and need root to start
a Docker daemon, so the default run leaves them out: `.venv/bin/python -m pytest -m docker`. They skip,
with the script's reason, where Docker cannot be used. The usage tests need no Docker and run always.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.fixtures import REPO

SCRIPT = REPO / "scripts" / "docker-check.sh"
TOOLKIT_SCRIPT = REPO / "docker" / "cuda-toolkit-unpacked.sh"
EXIT_CANNOT_USE_DOCKER = 77  # the script's "Docker cannot be used here" status
BUILD_AND_JOB_TIMEOUT_S = 3000  # the script's limit; pytest's own is 300 s later
README_JOB_RANKS = 2  # the README's first command trains "on 2 local CPU ranks, LMS on"


def readme_job_recipe() -> str:
    """The recipe of the README's first command (`.venv/bin/lms-launch RECIPE` in its first code block)."""
    first_block = (REPO / "README.md").read_text().split("```")[1]
    return re.search(r"\.venv/bin/lms-launch (\S+)", first_block).group(1)


def run_check(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """Runs the script; past `timeout` it gets SIGTERM, as from Ctrl-C, so that it stops what it started."""
    argv = ["bash", str(SCRIPT), *args]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                stdout, stderr = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
            pytest.fail(f"docker-check.sh ran past {timeout} s\n{stdout[-4000:]}\n{stderr[-2000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def skip_if_docker_unusable(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode == EXIT_CANNOT_USE_DOCKER:
        reasons = [line for line in proc.stderr.splitlines() if "SKIP:" in line]
        pytest.skip(reasons[-1] if reasons else proc.stderr.strip()[-500:])


def started_dockerd_pid(stdout: str) -> int | None:
    """The pid of the dockerd the script started, if it started one."""
    found = re.search(r"started dockerd \(pid (\d+)\)", stdout)
    return int(found.group(1)) if found else None


def check_containers_left() -> list[str]:
    listing = subprocess.run(["docker", "ps", "-a", "--filter", "name=lms-launch-check-", "--format", "{{.Names}}"],
                             capture_output=True, text=True)
    return listing.stdout.split() if listing.returncode == 0 else []


def assert_nothing_left_running(stdout: str) -> None:
    pid = started_dockerd_pid(stdout)
    if pid is not None:
        assert not Path(f"/proc/{pid}").exists(), f"the dockerd the script started (pid {pid}) is still running"
    else:  # it used a daemon that was already running: that one stays, its check container must not
        assert check_containers_left() == []


def output_of(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout (tail)\n{proc.stdout[-6000:]}\n--- stderr (tail)\n{proc.stderr[-3000:]}"


@pytest.mark.docker
@pytest.mark.timeout(BUILD_AND_JOB_TIMEOUT_S + 300)
def test_cpu_image_builds_and_runs_the_readme_job(tmp_path):
    out = tmp_path / "check"
    proc = run_check("--out", str(out), timeout=BUILD_AND_JOB_TIMEOUT_S)
    print(proc.stdout)  # the script's progress: shown with -s or -rP
    skip_if_docker_unusable(proc)
    assert proc.returncode == 0, output_of(proc)
    assert "all checks passed" in proc.stdout

    # horovodrun --check-build, as printed inside the image: TensorFlow, and both controllers.
    check_build = (out / "check-build.txt").read_text()
    for built_in in ("TensorFlow", "MPI", "Gloo"):
        assert re.search(rf"\[X\] {built_in}\b", check_build), f"{built_in} not built into Horovod:\n{check_build}"

    # The job's own results, read here on the host from the run directory the container wrote.
    run = out / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["np"] == README_JOB_RANKS
    assert [r["rank"] for r in summary["ranks"]] == list(range(README_JOB_RANKS))
    assert summary["weights_in_sync"] is True
    assert len({r["weights_sha256"] for r in summary["ranks"]}) == 1
    assert summary["lms_enabled"] is True
    assert yaml.safe_load((run / "recipe.yaml").read_text())["lms"]["enabled"] is True
    for rank in range(README_JOB_RANKS):
        plan = json.loads((run / "lms" / f"plan-rank{rank}.json").read_text())
        assert plan["rank"] == rank
        assert plan["swap_count"] == len(plan["swaps"])
        # The README's job plans for a device its step does not fit (the recipe's lms.device_memory),
        # so LMS really swaps, in the image as on the host.
        assert plan["estimated_peak_bytes"]["baseline"] > plan["device_memory_bytes"]
        assert plan["swap_count"] > 0 and plan["swapped_bytes"] > 0
    # Every rank logged every measured interval of the recipe's steps.
    recipe = yaml.safe_load((REPO / readme_job_recipe()).read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    measured = recipe["train"]["steps"] - recipe["logging"]["skip_steps"]
    for rank in range(README_JOB_RANKS):
        assert sum(r["steps"] for r in records if r["rank"] == rank) == measured

    assert_nothing_left_running(proc.stdout)
    # The host CA certificates the script copied into the build context are gone again.
    assert sorted(p.name for p in (REPO / "docker" / "extra-ca-certificates").glob("host-*")) == []


@pytest.mark.docker
@pytest.mark.timeout(BUILD_AND_JOB_TIMEOUT_S + 300)
def test_gpu_image_builds_with_nccl_on_a_base_without_cuda(tmp_path):
    # On the local Debian base the build assembles its CUDA toolkit (CUDA_TOOLKIT=unpacked); no GPU
    # is needed to build, and the README's job then runs on the image's TensorFlow, on the CPU.
    out = tmp_path / "check"
    proc = run_check("--gpu", "--out", str(out), timeout=BUILD_AND_JOB_TIMEOUT_S)
    print(proc.stdout)
    skip_if_docker_unusable(proc)
    assert proc.returncode == 0, output_of(proc)
    assert "CUDA_TOOLKIT=unpacked" in proc.stdout
    check_build = (out / "check-build.txt").read_text()
    for built_in in ("TensorFlow", "MPI", "Gloo", "NCCL"):
        assert re.search(rf"\[X\] {built_in}\b", check_build), f"{built_in} not built into Horovod:\n{check_build}"
    build_log = (out / "build.log").read_text()
    assert "(nvcc compiled and linked a kernel for sm_80)" in build_log
    assert "nvidia-nccl-cu12 wheel, linked shared" in build_log  # install.sh found TensorFlow's NCCL
    assert json.loads((out / "run" / "summary.json").read_text())["weights_in_sync"] is True
    assert_nothing_left_running(proc.stdout)


@pytest.mark.docker
@pytest.mark.timeout(600)
def test_the_unpacked_toolkit_compiles_for_the_gpu_and_a_second_run_keeps_it(tmp_path):
    # Downloads about 110 MB (Debian's nvidia-cuda-toolkit, three CUDA wheels): on demand only.
    dest = tmp_path / "cuda"
    first = subprocess.run(["bash", str(TOOLKIT_SCRIPT), str(dest)], capture_output=True, text=True, timeout=500)
    assert first.returncode == 0, first.stdout + first.stderr
    version = subprocess.run([str(dest / "bin" / "nvcc"), "--version"], capture_output=True, text=True).stdout
    assert "release 12.4" in version
    assert (dest / "include" / "cuda_runtime.h").is_file() and (dest / "include" / "cub" / "cub.cuh").is_file()
    assert (dest / "lib64" / "libcudart_static.a").read_text().strip() == "INPUT(libcudart.so.12)"
    # A kernel for the H100 (sm_90) compiles to an object that holds its SASS.
    kernel = tmp_path / "k.cu"
    kernel.write_text("__global__ void k(float* x) { x[threadIdx.x] += 1.0f; }\n")
    obj = tmp_path / "k.o"
    done = subprocess.run([str(dest / "bin" / "nvcc"), "-arch=sm_90", "-c", str(kernel), "-o", str(obj)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    listing = subprocess.run([str(dest / "bin" / "cuobjdump"), "--list-elf", str(obj)], capture_output=True, text=True)
    assert "sm_90" in listing.stdout
    again = subprocess.run(["bash", str(TOOLKIT_SCRIPT), str(dest)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "already holds CUDA 12.4's nvcc" in again.stdout


def test_the_toolkit_script_refuses_a_folder_that_holds_files(tmp_path):
    (tmp_path / "mine.txt").write_text("keep\n")
    done = subprocess.run(["bash", str(TOOLKIT_SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert f"{tmp_path} exists and is not empty" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]


@pytest.mark.docker
@pytest.mark.timeout(900)
def test_a_base_image_that_cannot_be_had_fails_clearly(tmp_path):
    missing = "lms-launch-no-such-base:never"
    proc = run_check("--base", missing, "--tag", "lms-launch:check-missing-base", "--out", str(tmp_path / "o"),
                     timeout=600)
    skip_if_docker_unusable(proc)
    assert proc.returncode == 1, output_of(proc)
    assert f"FAILED: cannot pull the base image {missing}" in proc.stderr
    assert "omit --base" in proc.stderr
    assert not (tmp_path / "o" / "build.log").exists()  # no build was started
    assert "horovodrun" not in proc.stdout
    assert_nothing_left_running(proc.stdout)


def test_the_check_runs_the_readmes_main_job():
    script = SCRIPT.read_text()
    assert re.search(r"^readonly JOB_RECIPE=(\S+)$", script, re.M).group(1) == readme_job_recipe()
    assert re.search(r"^readonly JOB_RANKS=(\d+)$", script, re.M).group(1) == str(README_JOB_RANKS)


@pytest.mark.parametrize("args, message", [
    (["--bogus"], "unknown argument '--bogus'"),
    (["--base"], "--base needs a value"),
    (["--tag", ""], "--tag needs a value"),
    (["--gpu", "--base"], "--base needs a value"),
])
def test_bad_usage_exits_2_before_touching_docker(args, message):
    proc = run_check(*args, timeout=30)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "--base IMAGE" in proc.stderr  # the usage follows the error
    assert "[docker-check]" not in proc.stdout  # no step started


def test_an_out_dir_that_holds_files_is_refused(tmp_path):
    (tmp_path / "earlier.log").write_text("from an earlier check\n")
    proc = run_check("--out", str(tmp_path), timeout=30)
    assert proc.returncode == 2
    assert f"--out {tmp_path} already holds files" in proc.stderr
    assert (tmp_path / "earlier.log").read_text() == "from an earlier check\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier.log"]
