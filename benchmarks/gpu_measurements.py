"""Issue 14's GPU measurements, in parts that each fit one call of the device tool (10 minutes).

    python3 benchmarks/gpu_measurements.py env   --out DIR     # the machine: GPU, driver, TensorFlow, CUDA, cuDNN
    python3 benchmarks/gpu_measurements.py tests --out DIR     # tests/test_gpu.py on this GPU
    python3 benchmarks/gpu_measurements.py link  --out DIR     # the host link, measured against NVML's table
    python3 benchmarks/gpu_measurements.py ops   --out DIR [--models resnet50]  # op times against the roofline
    python3 benchmarks/gpu_measurements.py peaks --out DIR [--models resnet50,unet3d] [--quick]
    python3 benchmarks/gpu_measurements.py variants --out DIR [--models swapouts,judges]  # one size, several ways

Each part writes `DIR/gpu-PART.txt` (`gpu-PART-MODELS.txt` for peaks and ops). It starts with the date,
the machine, the GPU and its driver, TensorFlow's CUDA and cuDNN, and the command. Lines are
flushed as they come, so a call cut off by its time limit still brings back what it measured.

`peaks` trains each case in a fresh process, as one probe of `lms-launch bench --judge run`
(launcher.bench.run_judge). The GPU is held to `--device-memory` (default 16 GiB: the papers' V100,
and what the estimates are made for) and the cases run with and without LMS. Next to each measured
peak (`tf.config.experimental.get_memory_info`) and step time it prints what the models said for
the same step:
- Grappler's estimate;
- the simulator's peak and step time;
- the allocator model's live peak and BFC requirement (lms_core.memory).

Each model's error is (model - measured) / measured. An LMS row's figures come from the plan the rank
made (`lms/plan-rank0.json`). A no-swap row's come from the same planning with nothing swapped, made
here on the GPU's own target. A case that runs out of memory says so, which is itself a measurement
when a model said it fits.

`variants` trains one size several ways, each in a fresh process, with the same columns as `peaks`:
- `swapouts`: ResNet-50 at batch 256 on the whole GPU (no hold, so that the peak shows whatever it
  is), planned for `--device-memory`: LMS off, and the recipe's manual settings with `sync_mode` 0
  (nothing waits for a copy out) and 1 (the tensor's next reader waits). On 2026-11-27 that was
  21.10, 20.48 and 4.29 GiB (benchmarks/results/gpu-lms-swap-outs.txt, by hand): the case for the
  simulator's executor model (lms_core.simulator.HOST_RUNS_AHEAD).
- `judges`: the U-Net at 256^3 held to `--device-memory`, auto-tuned with `lms.fit_judge` live (the
  default) and bfc: on 2026-11-27 the live judge's plan ran out of memory where the allocator
  model had said it would.

The largest batches (item 3 of the issue) are `lms-launch bench`'s own job, with the same hold:
`lms-launch bench max-batch recipes/resnet50.yaml --judge run --device-memory 16GiB --configs none`
(then `--configs lms-launch`), bounded with `--min/--max/--step` to fit a call (docs/gpu-bundle.md).

Without a GPU the parts run on this CPU, TensorFlow's CPU allocator held to `--device-memory` (the
bench's run judge does the same). That checks the harness, not the GPU: the header says which.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
from benchmarks.reporting import Log, nvidia_smi  # noqa: E402  (ROOT is on the path)
GIB = 1 << 30
RUN_STEPS, SKIP_STEPS = 5, 2  # per case, as the bench's run judge: 2 unmeasured (tracing, warm-up)
PROBE_TIMEOUT_S = 540


@dataclasses.dataclass(frozen=True)
class Case:
    model: str  # a recipe under recipes/
    kind: str  # "max-batch" or "max-resolution": which size the case sets
    size: int
    lms: bool


# Sizes for a 16 GiB hold, from the estimate judge's tables (docs/benchmarks.md): ResNet-50 fits batch 198 without
# swapping, the U-Net 192^3; the LMS cases are past that and well inside what lms-launch reaches.
CASES = {
    "resnet50": [Case("resnet50", "max-batch", size, lms) for size, lms in
                 ((64, False), (128, False), (192, False), (256, False), (256, True), (512, True))],
    "unet3d": [Case("unet3d", "max-resolution", size, lms) for size, lms in
               ((128, False), (160, False), (192, True), (256, False), (256, True))],
}
SIZE_KINDS = {"resnet50": "max-batch", "unet3d": "max-resolution", "unet3d-cpu": "max-resolution"}
OPS_SIZE = {"resnet50": 64, "unet3d": 128, "unet3d-cpu": 32}  # ops: a step that fits any GPU, without swaps
# --quick: one case without swapping that fits, and one size past the no-swap ceiling both without LMS
# (where a real out-of-memory error is the expected answer) and with it.
QUICK = {"resnet50": [(128, False), (256, False), (256, True)], "unet3d": [(160, False), (256, False), (256, True)]}
# `variants`: (label, configuration, lms.* settings); a case is held to --device-memory only if `held`.
VARIANTS = {
    "swapouts": ("resnet50", 256, False, [("LMS off", "none", []),
                                          ("sync 0", "lms-launch", ["lms.mode=manual", "lms.sync_mode=0"]),
                                          ("sync 1", "lms-launch", ["lms.mode=manual", "lms.sync_mode=1"])]),
    # Issue 32, item 1: recipes/resnet50.yaml as it ships (auto-tuned, calibrated on the GPU) held to the
    # device memory, and the same step without LMS on the whole GPU (what LMS is measured against).
    "shipped": ("resnet50", 256, True, [("as shipped", "lms-launch", [])]),
    "unswapped": ("resnet50", 256, False, [("LMS off", "none", [])]),
    "judges": ("unet3d", 256, True, [("live judge", "lms-launch", ["lms.fit_judge=live"]),
                                     ("bfc judge", "lms-launch", ["lms.fit_judge=bfc"])]),
    # The harness on a CPU (tests/test_gpu_measurements.py): the CPU recipe's U-Net, seconds a case.
    "swapouts-cpu": ("unet3d-cpu", 48, False, [("sync 0", "lms-launch", ["lms.mode=manual", "lms.swapout_threshold=4",
                                                                         "lms.sync_mode=0"]),
                                               ("sync 1", "lms-launch", ["lms.mode=manual", "lms.swapout_threshold=4",
                                                                         "lms.sync_mode=1"])]),
}
# For checking the harness on a CPU (tests/test_gpu_measurements.py): the CPU recipe's U-Net, seconds a case.
CASES["unet3d-cpu"] = [Case("unet3d-cpu", "max-resolution", 32, False), Case("unet3d-cpu", "max-resolution", 48, True)]
QUICK["unet3d-cpu"] = [(32, False), (48, True)]


def header(log: Log, part: str) -> None:
    """Date, machine, GPU, driver, TensorFlow's CUDA and cuDNN, and the command."""
    import tensorflow as tf

    from lms_core.nvml import probe_gpu

    log(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    log(f"command: python3 benchmarks/gpu_measurements.py {shlex.join(sys.argv[1:])}")
    log(f"machine: {platform.node()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}")
    gpu = probe_gpu(0)
    log(f"GPU (NVML): {gpu.name}, {gpu.memory_bytes / GIB:.1f} GiB, link {gpu.link.name if gpu.link else 'unknown'}"
        if gpu else "GPU (NVML): none")
    log(f"driver: {nvidia_smi('driver_version') or 'unknown (no nvidia-smi)'}")
    build = tf.sysconfig.get_build_info()
    log(f"TensorFlow {tf.__version__}, built for CUDA {build.get('cuda_version', '-')}, cuDNN "
        f"{build.get('cudnn_version', '-')}; GPUs it sees: {len(tf.config.list_physical_devices('GPU'))}")
    if not tf.config.list_physical_devices("GPU"):
        log("NO GPU: this run checks the harness on the CPU allocator; its figures are not GPU measurements")
    log(f"part: {part}")
    log()


def part_tests(log: Log) -> int:
    done = subprocess.run([sys.executable, "-m", "pytest", "tests/test_gpu.py", "-n", "0", "-p", "no:cacheprovider",
                           "-q", "-rs"], cwd=ROOT, capture_output=True, text=True)
    for line in (done.stdout + done.stderr).rstrip().splitlines():
        log(line)
    return done.returncode


def part_link(log: Log) -> int:
    import tensorflow as tf

    from lms_core.nvml import probe_gpu
    from lms_core.tf.bandwidth import measure_link

    if not tf.config.list_physical_devices("GPU"):
        log("no GPU: nothing to measure")
        return 1
    table = probe_gpu(0).link
    measured = measure_link()
    log(f"measured (copies of 16-256 MiB, line fitted): H2D {measured.h2d_bytes_per_s / 1e9:.1f} GB/s, "
        f"D2H {measured.d2h_bytes_per_s / 1e9:.1f} GB/s")
    if table is not None:
        log(f"NVML's table ({table.name}): H2D {table.h2d_bytes_per_s / 1e9:.1f} GB/s, "
            f"D2H {table.d2h_bytes_per_s / 1e9:.1f} GB/s; measured / table: "
            f"H2D {measured.h2d_bytes_per_s / table.h2d_bytes_per_s:.2f}, "
            f"D2H {measured.d2h_bytes_per_s / table.d2h_bytes_per_s:.2f}")
    return 0


def part_ops(log: Log, model: str, size: int) -> int:
    """Op times measured by TensorFlow's profiler on the step without swaps, against the roofline
    model the planner uses (lms_core.costs), summed by op type; and the measured step against the
    simulator's unswapped step."""
    from collections import defaultdict

    import lms_core.tf as lms_tf
    from launcher.bench.sizes import size_axis
    from launcher.bench.steps import StepSource
    from launcher.lms.target import rank_target
    from launcher.recipe import load_recipe
    from launcher.rank.devices import HOST_DEVICE, pin_device
    from lms_core.costs import step_costs
    from lms_core.tf.op_profile import profile_step, sample_inputs

    device = pin_device(0, lms_enabled=True)  # this process computes: the GPU, or CPU:1 without one
    recipe = load_recipe(ROOT / "recipes" / f"{model}.yaml", [])
    axis = size_axis(SIZE_KINDS[model], recipe)
    lms = dataclasses.replace(recipe.lms, enabled=True, mode="manual", swapout_threshold=10**9,
                              serialize_branches=False, chain_add_n=False)
    target, _ = rank_target(lms, rank=0, local_rank=0, local_size=1, on_gpu=device.startswith("GPU"))
    sized = StepSource(axis, recipe).at(size)
    step = lms_tf.rewrite(sized.step, *sized.specs, config=lms, compute_device=f"/device:{device}",
                          host_device=HOST_DEVICE, target=target)
    graph = step.planning.graph
    batch = sample_inputs(sized.specs, f"/device:{device}")
    float(step(*batch))  # traced and warmed up before anything is timed
    started = time.perf_counter()
    for _ in range(3):
        float(step(*batch))
    measured_step = (time.perf_counter() - started) / 3
    times = profile_step(lambda: float(step(*batch)), graph.order, steps=3)
    model_s = step_costs(graph, target.device)
    log(f"{model} {axis.label(size)} without swaps on {device}: {times.describe()}; roofline of {target.device.name}")
    by_type: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for name, seconds in times.seconds.items():
        entry = by_type[graph[name].type]
        entry[0] += seconds
        entry[1] += model_s.get(name, 0.0)
        entry[2] += 1
    measured_total, model_total = sum(e[0] for e in by_type.values()), sum(e[1] for e in by_type.values())
    log(f"{'op type':<28} {'ops':>5} {'measured ms':>11} {'roofline ms':>11} {'ratio':>6}")
    for op_type, (measured, modelled, count) in sorted(by_type.items(), key=lambda item: -item[1][0])[:15]:
        log(f"{op_type:<28} {count:>5} {measured * 1000:>11.2f} {modelled * 1000:>11.2f} "
            f"{measured / modelled if modelled else float('nan'):>6.2f}")
    log(f"{'all timed ops':<28} {len(times.seconds):>5} {measured_total * 1000:>11.2f} {model_total * 1000:>11.2f} "
        f"{measured_total / model_total if model_total else float('nan'):>6.2f}")
    predicted = step.report.prediction.unlimited_step_time_s
    log(f"step: measured {measured_step * 1000:.1f} ms (wall, 3 steps), simulator {predicted * 1000:.1f} ms "
        f"({predicted / measured_step - 1:+.0%})")
    return 0


def part_peaks(log: Log, models: list[str], quick: bool, device_memory: int, workdir: Path) -> int:
    from launcher.bench.run_judge import RunSetting
    from launcher.bench.sizes import size_axis
    from launcher.recipe import load_recipe
    from lms_core.nvml import probe_gpu

    import tensorflow as tf

    on_gpu = probe_gpu(0) is not None
    # This process only plans and estimates: it must not take the GPU the cases' fresh processes train
    # on (TensorFlow maps nearly all of a GPU's memory when it first starts it).
    tf.config.set_visible_devices([], "GPU")
    log(f"each case: {RUN_STEPS} training steps in a fresh process ({RUN_STEPS - SKIP_STEPS} measured), "
        f"{'the GPU' if on_gpu else 'the CPU allocator'} held to {device_memory / GIB:g} GiB; GiB and ms; "
        "err = (model - measured) / measured")
    log(f"{'case':<26} {'measured':>8} {'Grappler':>14} {'simulated':>14} {'alloc. live':>14} {'BFC req.':>14} "
        f"{'step':>6} {'predicted':>15}")
    failures = 0
    for model in models:
        recipe_path = ROOT / "recipes" / f"{model}.yaml"
        recipe = load_recipe(recipe_path, [])
        cases = CASES[model]
        if quick:
            cases = [c for c in cases if (c.size, c.lms) in QUICK[model]]
        for case in cases:
            axis = size_axis(case.kind, recipe)
            setting = RunSetting(recipe_path=recipe_path, recipe=recipe, overrides=[], axis=axis, workdir=workdir,
                                 steps=RUN_STEPS, skip_steps=SKIP_STEPS, timeout_s=PROBE_TIMEOUT_S, on_gpu=on_gpu,
                                 device_memory_bytes=device_memory,
                                 lms_overrides=[f"lms.device_memory={device_memory}"])
            label = f"{model} {axis.label(case.size)} {'LMS' if case.lms else 'no swap'}"
            failures += run_case(log, setting, "lms-launch" if case.lms else "none", case.size, label, 26,
                                 device_memory)
    return 1 if failures else 0


def run_case(log: Log, setting, key: str, size: int, label: str, width: int, device_memory: int) -> int:
    """Trains one case in a fresh process (the bench's run judge) and logs its row: the measured peak
    and step beside what the models said (the rank's own plan for LMS, the same planning with nothing
    swapped otherwise), or OOM, or why it failed. Returns 1 when it failed for another reason."""
    from launcher.bench.run_judge import ProbeError, run_probe

    try:
        probe = run_probe(setting, key, size)
    except ProbeError as err:
        log(f"{label:<{width}} FAILED: {err}")
        return 1
    if not probe.fits:
        log(f"{label:<{width}} {'OOM':>8}  {probe.detail}")
        return 0
    said = (plan_figures(Path(probe.data["run_dir"])) if key == "lms-launch"
            else unswapped_figures(setting.recipe, setting.axis, size, device_memory, setting.on_gpu))
    log(row(label, probe, said, width=width))
    if key == "lms-launch":
        for line in calibration_lines(Path(probe.data["run_dir"])):
            log(f"{'':<{width}}   {line}")
    return 0


def calibration_lines(run_dir: Path) -> list[str]:
    """The rank's calibration rounds (launcher.lms.calibrate), as its log said them."""
    import json

    plan = json.loads((run_dir / "lms" / "plan-rank0.json").read_text())
    return [line for line in plan.get("log", []) if line.startswith("calibration round")]


def part_variants(log: Log, names: list[str], device_memory: int, workdir: Path) -> int:
    """One size of one recipe trained several ways (VARIANTS), each next to what its models said."""
    from launcher.bench.run_judge import RunSetting
    from launcher.bench.sizes import size_axis
    from launcher.recipe import load_recipe
    from lms_core.nvml import probe_gpu

    import tensorflow as tf

    on_gpu = probe_gpu(0) is not None
    tf.config.set_visible_devices([], "GPU")  # this process only plans (part_peaks says why)
    log(f"each case: {RUN_STEPS} training steps in a fresh process ({RUN_STEPS - SKIP_STEPS} measured), planned for "
        f"{device_memory / GIB:g} GiB; GiB and ms; err = (model - measured) / measured")
    log(f"{'case':<34} {'measured':>8} {'Grappler':>14} {'simulated':>14} {'alloc. live':>14} {'BFC req.':>14} "
        f"{'step':>6} {'predicted':>15}")
    failures = 0
    for name in names:
        model, size, held, variants = VARIANTS[name]
        recipe_path = ROOT / "recipes" / f"{model}.yaml"
        recipe = load_recipe(recipe_path, [])
        axis = size_axis(SIZE_KINDS[model], recipe)
        for label, key, settings in variants:
            setting = RunSetting(recipe_path=recipe_path, recipe=recipe, overrides=[], axis=axis,
                                 workdir=workdir / name / label.replace(" ", "-"), steps=RUN_STEPS,
                                 skip_steps=SKIP_STEPS, timeout_s=PROBE_TIMEOUT_S, on_gpu=on_gpu,
                                 device_memory_bytes=device_memory if held else None,
                                 lms_overrides=[f"lms.device_memory={device_memory}", *settings])
            text = f"{model} {axis.label(size)} {label}{'' if held else ', no hold'}"
            failures += run_case(log, setting, key, size, text, 34, device_memory)
    return 1 if failures else 0


def plan_figures(run_dir: Path) -> dict:
    """What the rank's own plan said: Grappler's estimate with the swaps, the simulator's peak and
    step, the allocator model's live peak and requirement."""
    import json

    plan = json.loads((run_dir / "lms" / "plan-rank0.json").read_text())
    memory = plan.get("device_memory") or {}
    prediction = plan.get("prediction") or {}
    return {"grappler": (plan.get("estimated_peak_bytes") or {}).get("lms"),
            "simulated": prediction.get("peak_device_bytes"), "step_s": prediction.get("step_time_s"),
            "live": memory.get("live_peak_bytes"), "bfc": memory.get("bfc_bytes")}


def unswapped_figures(recipe, axis, size: int, device_memory: int, on_gpu: bool) -> dict:
    """The same figures for the step without swaps, planned here for the rank's target, with a
    threshold no tensor reaches (nothing swapped, nothing reordered)."""
    import lms_core.tf as lms_tf
    from launcher.bench.configurations import COMPUTE_DEVICE, HOST_DEVICE
    from launcher.bench.steps import StepSource
    from launcher.lms.target import rank_target

    lms = dataclasses.replace(recipe.lms, enabled=True, mode="manual", swapout_threshold=10**9,
                              serialize_branches=False, chain_add_n=False, device_memory=device_memory)
    target, _ = rank_target(lms, rank=0, local_rank=0, local_size=1, on_gpu=on_gpu)
    sized = StepSource(axis, recipe).at(size)
    # Placed on a virtual GPU, as the bench's estimate judge places it (this process sees no GPU).
    rewritten = lms_tf.rewrite(sized.step, *sized.specs, config=lms, compute_device=COMPUTE_DEVICE,
                               host_device=HOST_DEVICE, target=target, describe_memory=True)
    estimate = lms_tf.estimate_rewrite(rewritten, device_memory)
    report = rewritten.report
    return {"grappler": estimate.baseline_bytes, "simulated": report.prediction.peak_device_bytes,
            "step_s": report.prediction.step_time_s,
            "live": report.memory.live_peak_bytes if report.memory else None,
            "bfc": report.memory.bfc_bytes if report.memory else None}


def row(label: str, probe, said: dict, width: int = 26) -> str:
    measured = probe.peak_bytes

    def versus(model_bytes) -> str:
        if not model_bytes or not measured:
            return f"{'-':>14}"
        return f"{model_bytes / GIB:6.2f} ({model_bytes / measured - 1:+5.0%})"

    step = probe.data.get("step_time_s")
    predicted = said.get("step_s")
    step_text = f"{step * 1000:6.0f}" if step else f"{'-':>6}"
    predicted_text = (f"{predicted * 1000:6.0f} ({predicted / step - 1:+5.0%})" if predicted and step
                      else f"{'-':>15}")
    return (f"{label:<{width}} {measured / GIB:8.2f} {versus(said.get('grappler'))} {versus(said.get('simulated'))} "
            f"{versus(said.get('live'))} {versus(said.get('bfc'))} {step_text} {predicted_text}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("env", "tests", "link", "ops", "peaks", "variants"))
    parser.add_argument("--out", default=str(RESULTS), help="where the part's file goes (on the device tool: $OUT)")
    parser.add_argument("--models", help="peaks and ops: the recipes (default resnet50,unet3d); variants: the "
                        "sets (default swapouts,judges); comma-separated")
    parser.add_argument("--quick", action="store_true", help="peaks: two cases per model")
    parser.add_argument("--device-memory", default="16GiB", help="peaks: the memory the device is held to")
    parser.add_argument("--workdir", help="peaks: where the cases' run folders go (default: a temporary folder)")
    args = parser.parse_args()
    from lms_core.units import parse_bytes

    known = VARIANTS if args.part == "variants" else CASES
    default = "swapouts,judges" if args.part == "variants" else "resnet50,unet3d"
    models = [m for m in (args.models or default).split(",") if m]
    unknown = [m for m in models if m not in known]
    if unknown:
        parser.error(f"--models: no cases for {', '.join(unknown)}; choose from {', '.join(known)}")
    try:
        device_memory = parse_bytes(args.device_memory)
    except ValueError as err:
        parser.error(f"--device-memory: {err}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    name = f"gpu-{args.part}" + (f"-{'-'.join(models)}" if args.part in ("peaks", "ops", "variants") else "")
    log = Log(Path(args.out) / f"{name}.txt")
    header(log, args.part)
    if args.part == "env":
        return 0
    if args.part == "tests":
        return part_tests(log)
    if args.part == "link":
        return part_link(log)
    if args.part == "ops":
        return max(part_ops(log, model, OPS_SIZE[model]) for model in models)
    import tempfile

    with tempfile.TemporaryDirectory(prefix=f"gpu-{args.part}-") as scratch:
        if args.part == "variants":
            return part_variants(log, models, device_memory, Path(args.workdir or scratch))
        return part_peaks(log, models, args.quick, device_memory, Path(args.workdir or scratch))


if __name__ == "__main__":
    sys.exit(main())
