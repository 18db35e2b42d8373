"""`lms-launch plan RECIPE [--set ...] [--device-memory 16GiB] [--host-memory 512GiB] [--link L] [--device D]
[--out DIR] [--plot]`

Traces the recipe's training step (one rank, no training, nothing started) and plans LMS for a rank on
the given link and device: auto-tuned when `lms.mode` is auto, else with the recipe's settings. Prints
the simulator's prediction (step time, stalls, hidden transfer) and Grappler's peak-memory estimate
with and without LMS on a virtual GPU (no GPU is needed). Writes DIR/plan.json, and DIR/plan.png with
--plot. Exit 0 on success, 2 for bad input.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from launcher.recipe import RecipeError, load_recipe

PLAN_FILE = "plan.json"


class PlanUsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise PlanUsageError(f"{message} (see lms-launch plan --help)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="lms-launch plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    p.add_argument("--device-memory", help="GPU memory to plan for (default: lms.device_memory, else the "
                                           "device profile's, e.g. 16GiB for v100)")
    p.add_argument("--host-memory", help="host memory to plan for (default: lms.host_memory, else this machine's)")
    p.add_argument("--link", help="host-device link: pcie3, pcie4, pcie5, nvlink2, c2c or GB/s (default: lms.link)")
    p.add_argument("--device", help="device profile: v100, a100, h100, h200 (default: lms.device)")
    p.add_argument("--out", help="where plan.json goes (default: runs/plan-<recipe>-<time>)")
    p.add_argument("--plot", action="store_true", help="also write plan.png: memory over the step, copy queues")
    return p


def main(argv: list[str]) -> int:
    try:
        args = parser().parse_args(argv)
        flags = [f"lms.{key}={value}" for key, value in (("device_memory", args.device_memory),
                                                           ("host_memory", args.host_memory), ("link", args.link),
                                                           ("device", args.device)) if value is not None]
        recipe = load_recipe(args.recipe, args.overrides + flags)
        out = Path(args.out) if args.out else Path("runs") / f"plan-{Path(args.recipe).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        if (out / PLAN_FILE).exists():
            raise PlanUsageError(f"--out {out} already has {PLAN_FILE}; give a new directory")
    except (RecipeError, PlanUsageError) as err:
        print(f"lms-launch plan: error: {err}", file=sys.stderr)
        return 2

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    say = lambda text: print(f"[plan] {text}", flush=True)  # noqa: E731
    if not recipe.lms.enabled:
        say("lms.enabled is false in this recipe; planning with its lms settings anyway")
    planned_lms = dataclasses.replace(recipe.lms, enabled=True)
    say(f"building {recipe.model.name} {recipe.model.input_shape}, batch {recipe.train.batch_size} (TensorFlow loads first)")
    from launcher.rank.devices import split_cpu

    split_cpu()  # the gating check below runs the plan on two logical CPU devices
    import lms_core.tf as lms_tf
    from launcher.lms.target import rank_target
    from launcher.rank.training import build_training
    from launcher.lms.twin import verify_on_twin
    from lms_core.plan import Plan
    from lms_core.planning import tunes
    from lms_core.simulator import simulate
    from lms_core.units import format_bytes

    started = time.perf_counter()
    import keras

    keras.backend.clear_session()  # names start afresh, as they will for the gating check's twin
    setup = build_training(recipe, ranks=1, device="CPU:0")
    target, lines = rank_target(planned_lms, rank=0, local_rank=0, local_size=1, on_gpu=False)
    for line in lines:
        say(line)
    say("tracing the training step, then planning" + (" (auto-tuning by simulation)" if tunes(planned_lms, target) else ""))
    rewritten = lms_tf.rewrite(setup.step, *setup.specs, config=planned_lms, compute_device="/device:GPU:0",
                               host_device="/device:CPU:0", target=target)
    planned = rewritten.planning
    say(f"{rewritten.plan.summary()}; estimating peak memory with Grappler")
    device_memory = target.device_memory_bytes
    baseline, lms = lms_tf.estimate_rewrite(rewritten, device_memory)
    if rewritten.plan.swaps or rewritten.plan.control_edges:
        say("checking that every swap-in waits for its trigger in what TensorFlow executes (the same step at its "
            "smallest input, on split CPU devices)")
        try:
            gating, twin = verify_on_twin(recipe, rewritten.plan)
        except ValueError as err:
            print(f"lms-launch plan: error: cannot check the plan: {err}", file=sys.stderr)
            return 1
        rewritten.plan.verification = dict(gating.to_dict(), traced_at=twin)

    plan = rewritten.plan.to_dict()
    plan["recipe"] = str(args.recipe)
    plan["fits"] = {"baseline": baseline.fits, "lms": lms.fits}
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (PLAN_FILE + ".tmp")
    tmp.write_text(json.dumps(plan, indent=2))
    tmp.replace(out / PLAN_FILE)

    prediction = plan["prediction"]
    print(f"\n{recipe.model.name} {recipe.model.input_shape} batch {recipe.train.batch_size}: "
          f"{plan['swap_count']} tensor(s) swapped, {format_bytes(plan['swapped_bytes'])} per step to host")
    print(f"  {plan['cost_model']}")
    if plan["tuning"]:
        print(f"  {plan['tuning']}")
    for warning in plan["warnings"]:
        print(f"  warning: {warning}")
    print(f"  simulated on {target.link.name} / {target.device.name}: step {prediction['step_time_s'] * 1000:.0f} ms "
          f"vs {prediction['unlimited_step_time_s'] * 1000:.0f} ms unswapped, stalls {prediction['stall_time_s'] * 1000:.0f} ms, "
          f"{prediction['hidden_share']:.0%} of transfer hidden, peak {format_bytes(prediction['peak_device_bytes'])}")
    for label, estimate in (("without LMS", baseline), ("with LMS", lms)):
        verdict = "fits" if estimate.fits else "does NOT fit"
        print(f"  {label:<12} Grappler GPU peak {format_bytes(estimate.device_bytes):>10}: {verdict} in "
              f"{format_bytes(device_memory)}")
    if baseline.device_bytes:
        print(f"  GPU peak with LMS is {lms.device_bytes / baseline.device_bytes:.0%} of the baseline; "
              f"host memory used {format_bytes(lms.host_bytes)}")
    verification = plan["verification"]
    if verification:
        twin = verification["traced_at"]
        print(f"  swap-ins gated: {verification['gated']}/{verification['swap_ins']} (in the partition graphs "
              f"TensorFlow executed for this step at {twin['input_shape']}, batch {twin['batch_size']}, on "
              f"{verification['devices']['compute']} with host {verification['devices']['host']})")
        edges = verification["control_edges"]
        if edges["checked"]:
            print(f"  backward branches ordered: {edges['kept']}/{edges['checked']} control edges honoured there")
    print(f"  (estimates and simulations, not GPU measurements; {time.perf_counter() - started:.0f} s)")
    if args.plot:
        from launcher.lms.plot import plot_step

        costs = planned.costs
        unswapped = simulate(planned.graph, Plan(settings=plan["settings"]), costs, target.link, keep_timeline=True)
        swapped = simulate(planned.graph, rewritten.plan, costs, target.link, keep_timeline=True)
        plot_step(out / "plan.png", unswapped, swapped, device_memory, int(device_memory * planned_lms.memory_ratio),
                  f"{recipe.model.name} {recipe.model.input_shape} batch {recipe.train.batch_size} on "
                  f"{target.link.name} / {target.device.name}")
        print(f"plot written to {out / 'plan.png'}")
    print(f"plan written to {out / PLAN_FILE}")
    if verification and verification["ungated"]:
        first = verification["ungated"][0]
        print(f"lms-launch plan: error: swap-in {first} does not wait for its trigger: "
              f"{verification['reasons'][first]}", file=sys.stderr)
        return 1
    return 0
