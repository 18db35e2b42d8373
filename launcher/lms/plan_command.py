"""`lms-launch plan RECIPE [--set ...] [--device-memory 16GiB] [--host-memory 512GiB] [--link L] [--device D]
[--calibration FILE] [--out DIR] [--plot]`

Traces the recipe's training step (one rank, no training, nothing started) and plans LMS for a rank on
the given link and device: auto-tuned when `lms.mode` is auto, else with the recipe's settings. Prints
the simulator's prediction (step time, stalls, hidden transfer), the chosen plan's device memory as
TensorFlow would hold it (live peak, the GPU allocator's requirement by the BFC model, a planned pool
and its lower bound; `lms.fit_judge` says which of them "fits" was judged by), Grappler's peak-memory
estimate with and without LMS on a virtual GPU (no GPU is needed), and checks on the step's structural twin
that every swap-in waits for its trigger in what TensorFlow executes. With `--calibration FILE` (a
calibration cache entry, or a GPU run's RUN_DIR/lms/plan-rank<N>.json) it plans for the budget that
fitted on that GPU and shows the device's correction next to the models' figures. Writes
DIR/plan.json, and DIR/plan.png with --plot. Exit 0 on success, 1 when a swap-in is not gated, 2 for
bad input.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from launcher.arguments import USAGE_STATUS, UsageError, UsageParser
from launcher.config import Recipe
from launcher.recipe import RecipeError, load_recipe

PLAN_FILE = "plan.json"
PLOT_FILE = "plan.png"


def parser() -> UsageParser:
    p = UsageParser(prog="lms-launch plan", description=__doc__)
    p.add_argument("recipe")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    p.add_argument("--device-memory", help="GPU memory to plan for (default: lms.device_memory, else the "
                                           "device profile's, e.g. 16GiB for v100)")
    p.add_argument("--host-memory", help="host memory to plan for (default: lms.host_memory, else this machine's)")
    p.add_argument("--link", help="host-device link: pcie3, pcie4, pcie5, nvlink2, c2c or GB/s (default: lms.link)")
    p.add_argument("--device", help="device profile: v100, a100, h100, h200 (default: lms.device)")
    p.add_argument("--calibration", metavar="FILE", help="plan for the budget a GPU run calibrated (a calibration "
                                                         "cache entry, or RUN_DIR/lms/plan-rank<N>.json), and show "
                                                         "the device's correction next to the models'")
    p.add_argument("--out", help="where plan.json goes (default: runs/plan-<recipe>-<time>)")
    p.add_argument("--plot", action="store_true", help="also write plan.png: memory over the step, copy queues")
    return p


def main(argv: list[str]) -> int:
    from launcher.lms.calibration_cache import read_correction

    try:
        args = parser().parse_args(argv)
        recipe, out = resolve(args)
        correction = read_correction(Path(args.calibration)) if args.calibration else None
    except (RecipeError, UsageError, ValueError) as err:
        print(f"lms-launch plan: error: {err}", file=sys.stderr)
        return USAGE_STATUS
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    started = time.perf_counter()
    try:
        planned, report, target = make_plan(recipe, correction)
    except ValueError as err:  # the twin lacks an op the plan names
        print(f"lms-launch plan: error: cannot check the plan: {err}", file=sys.stderr)
        return 1
    write_plan(report, args.recipe, out)
    print_plan(recipe, report, time.perf_counter() - started, correction)
    if args.plot:
        plot(recipe, planned, report, target, out / PLOT_FILE)
        print(f"plot written to {out / PLOT_FILE}")
    print(f"plan written to {out / PLAN_FILE}")
    check = report.verification
    if check is not None and not check.all_gated:
        print(f"lms-launch plan: error: swap-in {check.first_failure()} (it does not wait for its trigger)",
              file=sys.stderr)
        return 1
    return 0


def resolve(args) -> tuple[Recipe, Path]:
    """The recipe with the flags applied (they are `lms.*` keys) and the output folder, checked."""
    flags = [f"lms.{key}={value}" for key, value in (("device_memory", args.device_memory),
                                                       ("host_memory", args.host_memory), ("link", args.link),
                                                       ("device", args.device)) if value is not None]
    recipe = load_recipe(args.recipe, args.overrides + flags)
    out = Path(args.out) if args.out else Path("runs") / f"plan-{Path(args.recipe).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if (out / PLAN_FILE).exists():
        raise UsageError(f"--out {out} already has {PLAN_FILE}; give a new directory")
    return recipe, out


def say(text: str) -> None:
    print(f"[plan] {text}", flush=True)


def make_plan(recipe: Recipe, correction=None):
    """Builds the step, plans it for one rank's target (for the calibrated budget of `correction`,
    where given), estimates it with Grappler and checks it on its twin: (the planning, the report,
    the target)."""
    if not recipe.lms.enabled:
        say("lms.enabled is false in this recipe; planning with its lms settings anyway")
    lms = dataclasses.replace(recipe.lms, enabled=True)
    say(f"building {recipe.model.name} {recipe.model.input_shape}, batch {recipe.train.batch_size} "
        f"(TensorFlow loads first)")
    from launcher.rank.devices import split_cpu

    split_cpu()  # the gating check below runs the plan on two logical CPU devices
    import keras

    import lms_core.tf as lms_tf
    from launcher.lms.target import rank_target
    from launcher.lms.twin import verify_on_twin
    from launcher.rank.training import build_training
    from lms_core.planning import tunes

    keras.backend.clear_session()  # names start afresh, as they will for the gating check's twin
    setup = build_training(recipe, ranks=1, device="CPU:0")
    target, lines = rank_target(lms, rank=0, local_rank=0, local_size=1, on_gpu=False)
    for line in lines:
        say(line)
    if correction is not None:
        lms = calibrated_settings(lms, target, correction)
    say("tracing the training step, then planning" + (" (auto-tuning by simulation)" if tunes(lms, target) else ""))
    rewritten, estimate = lms_tf.rewrite_within_estimate(
        setup.step, *setup.specs, config=lms, compute_device="/device:GPU:0", host_device="/device:CPU:0",
        target=target, describe_memory=True)
    say(f"{rewritten.plan.summary()}; peak memory estimated with Grappler")
    report = rewritten.report.with_estimate(estimate)
    if rewritten.plan.swaps or rewritten.plan.control_edges or rewritten.plan.recomputes:
        say("checking that every swap-in waits for its trigger in what TensorFlow executes (the same step at its "
            "smallest input, on split CPU devices)")
        report = report.with_verification(verify_on_twin(recipe, rewritten.plan))
    return rewritten.planning, report, target


def calibrated_settings(lms, target, correction):
    """`lms` planning for the budget that fitted on the GPU (as a share of the device memory planned for)."""
    from lms_core.units import format_bytes

    if correction.device_bytes is not None and correction.device_bytes != target.device_memory_bytes:
        say(f"warning: the calibration was made for {format_bytes(correction.device_bytes)} of device memory, this "
            f"plan is for {format_bytes(target.device_memory_bytes)}: its budget may not carry over")
    ratio = min(1.0, correction.budget_bytes / target.device_memory_bytes)
    say(f"planning for {format_bytes(correction.budget_bytes)}, the budget that fitted on the GPU "
        f"({correction.source}), not {format_bytes(int(target.device_memory_bytes * lms.memory_ratio))}")
    return dataclasses.replace(lms, memory_ratio=ratio)


def write_plan(report, recipe_path: str, out: Path) -> None:
    """plan.json, whole or not at all."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (PLAN_FILE + ".tmp")
    tmp.write_text(json.dumps(dict(report.to_dict(), recipe=str(recipe_path)), indent=2))
    tmp.replace(out / PLAN_FILE)


def print_plan(recipe: Recipe, report, seconds: float, correction=None) -> None:
    from lms_core.units import format_bytes

    plan = report.plan
    print(f"\n{recipe.model.name} {recipe.model.input_shape} batch {recipe.train.batch_size}: "
          f"{len(plan.swaps)} tensor(s) swapped, {format_bytes(plan.swapped_bytes)} per step to host")
    for line in report.lines():
        print(f"  {line}")
    if correction is not None:
        print(f"  {correction_line(correction, report)}")
    print(f"  (estimates and simulations, not GPU measurements; {seconds:.0f} s)")


def correction_line(correction, report) -> str:
    """The GPU's figures beside the models': what it measured, what the simulator said, and this
    plan's simulated peak with the difference added."""
    from lms_core.units import format_bytes

    miss = correction.unmodeled_bytes
    line = (f"the GPU's correction ({correction.source}): it measured {format_bytes(correction.measured_peak_bytes)} "
            f"for a plan the simulator put at {format_bytes(correction.predicted_peak_bytes)}: {format_bytes(miss)} "
            f"({miss / max(1, correction.predicted_peak_bytes):+.0%}) the models do not count")
    if report.prediction is not None:
        line += (f"; this plan's simulated peak with it: "
                 f"{format_bytes(report.prediction.peak_device_bytes + miss)}")
    return line


def plot(recipe: Recipe, planned, report, target, path: Path) -> None:
    """Device memory over the step with and without the plan, and the copy queues."""
    from launcher.lms.plot import plot_step
    from lms_core.plan import Plan
    from lms_core.simulator import simulate

    memory = target.device_memory_bytes
    # Without LMS: the step as traced (the planned graph may hold a recompute's clones).
    unswapped = simulate(planned.traced or planned.graph, Plan(settings=report.plan.settings), planned.costs,
                         target.link, keep_timeline=True)
    swapped = simulate(planned.graph, report.plan, planned.costs, target.link, keep_timeline=True, keep_events=True)
    clones = {clone for entry in report.plan.recomputes for clone in entry.clones}
    recomputed = [(start, end) for name, start, end in swapped.executed if name in clones]
    plot_step(path, unswapped, swapped, memory, int(memory * recipe.lms.memory_ratio),
              f"{recipe.model.name} {recipe.model.input_shape} batch {recipe.train.batch_size} on "
              f"{target.link.name} / {target.device.name}", recomputed)
