"""The run judge: a size fits when a real training step at that size runs.

Each probe starts a fresh process (`python -m launcher.bench.probe_worker`, one rank of the worker,
no Horovod launcher) that builds the recipe at the size and trains a few steps into a probe folder of
its own. A fresh process per probe is the only way to start from an empty device: TensorFlow never
gives GPU memory back. What the probe says:

- exit 0 with a `summary.json`: it fits; the measured samples/s and peak device memory come from it,
  and for lms-launch the rank's plan (`lms/plan-rank0.json`) gives the swaps and the predicted step;
- out of memory: TensorFlow's `ResourceExhaustedError` (`OOM when allocating ...`), which the worker
  explains (launcher/rank/oom.py) and ends with status 1; or a crash right after the allocator said it ran
  out of memory (some kernels do not check a failed small allocation): it does not fit, and the
  allocation that failed is reported;
- anything else (a crash, a bad recipe, a timeout) is not a size that does not fit: the search stops
  with the probe's last lines.

The process runs in a session of its own and is killed with its whole group when it overstays
`timeout_s` or the bench is interrupted: nothing is left running.

On a machine without a GPU, TensorFlow's CPU allocator plays the device: it is held to the device
memory (`TF_CPU_BFC_MEM_LIMIT_IN_MB`) and fails as a full GPU does. There, lms-launch's two logical
CPU devices share that one allocator, so swapping saves nothing; the run judge on a CPU proves the
mechanics, not the sizes.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from launcher import env
from launcher.bench.search import Probe
from launcher.bench.sizes import SizeAxis
from launcher.config import Recipe

OOM_PATTERNS = (
    re.compile(r"OOM when allocating[^\n]*"),
    re.compile(r"ran out of memory trying to allocate[^\n]*"),  # TensorFlow's BFC allocator, before a crash
    re.compile(r"ResourceExhaustedError[^\n]*"),
    re.compile(r"cuDNN found no convolution algorithm[^\n]*"),  # the worker's word for cuDNN's NotFoundError
)
LAST_LINES = 12  # of a failed probe's output, in the error


class ProbeError(RuntimeError):
    """A probe failed for another reason than memory: the search cannot go on."""


@dataclass
class RunSetting:
    """What every run-judged probe shares."""

    recipe_path: Path  # the recipe file, as given
    recipe: Recipe  # loaded with the user's --set
    overrides: list[str]  # the user's --set entries, passed on to every probe
    axis: SizeAxis
    workdir: Path  # where each probe gets its own run folder
    steps: int  # training steps per probe (the first `skip_steps` are not measured)
    skip_steps: int
    timeout_s: float
    on_gpu: bool
    device_memory_bytes: int | None  # planned for by lms-launch, and the allocator's limit
    lms_overrides: list[str]  # lms.* entries for the lms-launch probes (link, device, host memory)


def probe_overrides(setting: RunSetting, key: str, size: int) -> list[str]:
    """Every --set a probe's worker gets: the user's, then the size, the short run, and the
    configuration's LMS switch (later entries win)."""
    measured = setting.steps - setting.skip_steps
    entries = list(setting.overrides) + setting.axis.overrides(setting.recipe, size) + [
        f"train.steps={setting.steps}", f"logging.skip_steps={setting.skip_steps}", f"logging.interval={measured}",
        "logging.tensorboard=false", "logging.progress=false", "distributed.np=1", "distributed.hosts=null",
        "distributed.hostfile=null", "checkpoint.dir=null"]
    if key == "lms-launch":
        entries += ["lms.enabled=true", "lms.mode=auto", *setting.lms_overrides]
    else:
        entries.append("lms.enabled=false")
    return entries


def memory_optimizer(key: str) -> str:
    """Grappler's memory optimizer in the probe: its swapping for `grappler`; off otherwise, since
    TensorFlow's default level (DEFAULT_MEM_OPT) runs the same swapping heuristic on a GPU and would
    blur what each row measures."""
    return "swapping" if key == "grappler" else "off"


def probe_command(setting: RunSetting, key: str, size: int, run_dir: Path) -> list[str]:
    argv = [sys.executable, "-m", "launcher.bench.probe_worker", "--memory-optimizer", memory_optimizer(key), "--",
            str(setting.recipe_path.resolve()), "--run-dir", str(run_dir.resolve())]
    for entry in probe_overrides(setting, key, size):
        argv += ["--set", entry]
    return argv


def probe_environment(setting: RunSetting) -> dict[str, str]:
    environment = dict(os.environ)
    # TensorFlow reports running out of memory as warnings ("ran out of memory trying to allocate",
    # "OOM when allocating"), and an allocation failing in some CPU kernels then crashes the process:
    # the warnings are how a probe tells that crash from another. A user's level 2 or 3 would hide
    # them, so at most 1 here (2026-11-25: at level 2 a U-Net probe's OOM crash failed the bench).
    level = environment.get(env.TF_CPP_MIN_LOG_LEVEL, "1")
    environment[env.TF_CPP_MIN_LOG_LEVEL] = level if level in ("0", "1") else "1"
    environment[env.PYTHONUNBUFFERED] = "1"
    if setting.device_memory_bytes:
        # The allocator of the device computed on is held to the memory benchmarked: the CPU's BFC
        # allocator without a GPU, the GPU's logical device with one.
        limit = env.LMS_LAUNCH_GPU_MEMORY_LIMIT_MB if setting.on_gpu else env.TF_CPU_BFC_MEM_LIMIT_IN_MB
        environment[limit] = str(max(1, setting.device_memory_bytes >> 20))
    return environment


def out_of_memory(output: str) -> str | None:
    """TensorFlow's out-of-memory line in a probe's output, or None."""
    for pattern in OOM_PATTERNS:
        match = pattern.search(output)
        if match:
            return match.group(0).strip()
    return None


def run_probe(setting: RunSetting, key: str, size: int) -> Probe:
    run_dir = setting.workdir / f"{key}-{size}"
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    status, output = run_isolated(probe_command(setting, key, size, run_dir), probe_environment(setting),
                                  setting.timeout_s)
    seconds = time.perf_counter() - started
    (run_dir / "output.log").write_text(output)
    _drop_bulky_files(run_dir)
    summary_file = run_dir / "summary.json"
    if status == 0 and summary_file.exists():
        summary = json.loads(summary_file.read_text())
        data = {"samples_per_s": summary["total_samples_per_sec"], "peak_bytes": summary["max_peak_memory_bytes"],
                "step_time_s": summary["ranks"][0]["step_time_s"], "run_dir": str(run_dir)}
        detail = f"measured {data['samples_per_s']:.2f} samples/s"
        plan_file = run_dir / "lms" / "plan-rank0.json"
        if plan_file.exists():
            plan = json.loads(plan_file.read_text())
            verification = plan.get("verification") or {}
            data.update(swaps=plan["swap_count"], prediction=plan.get("prediction") or {},
                        gated=f"{verification.get('gated', 0)}/{verification.get('swap_ins', 0)}")
            detail += f", {plan['swap_count']} swap(s), swap-ins gated {data['gated']}"
            rounds = plan.get("calibration") or []
            if rounds:  # measured on the GPU before training (launcher.lms.calibrate)
                data["calibration"] = rounds
                detail += f", calibrated in {len(rounds)} round(s)"
        return Probe(size, True, summary["max_peak_memory_bytes"], seconds, detail=detail, data=data)
    oom = out_of_memory(output)
    if oom is not None and status != 0:
        how = "" if status == 1 else f" (the process then ended with {describe_status(status)})"
        return Probe(size, False, None, seconds, detail=f"out of memory: {oom}{how}",
                     data={"out_of_memory": oom, "status": status, "run_dir": str(run_dir)})
    tail = "\n".join("    " + line for line in output.rstrip().splitlines()[-LAST_LINES:])
    raise ProbeError(f"the {key} probe at {setting.axis.label(size)} failed without running out of memory "
                     f"({describe_status(status)}); its output is in {run_dir / 'output.log'}; last lines:\n{tail}")


def describe_status(status: int | None) -> str:
    if status is None:
        return "a timeout"
    if status < 0:
        return f"signal {-status} ({signal.Signals(-status).name})"
    return f"exit status {status}"


def run_isolated(argv: list[str], environment: dict[str, str], timeout_s: float) -> tuple[int | None, str]:
    """Runs `argv` in a session of its own; (exit status, output), status None after a timeout.
    The process group is killed on a timeout, an interrupt or any error here, so nothing outlives it."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment,
                               start_new_session=True, text=True, errors="replace")
    try:
        output, _ = process.communicate(timeout=timeout_s)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        _kill_group(process)
        output, _ = process.communicate()
        return None, output
    finally:
        _kill_group(process)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the worker and anything it started
    except (ProcessLookupError, PermissionError):
        pass
    if process.poll() is None:
        process.wait()


def _drop_bulky_files(run_dir: Path) -> None:
    """The trained model is of no use to a benchmark; keep the logs, the summary and the plan."""
    model = run_dir / "model.keras"
    if model.exists():
        model.unlink()
