"""`lms-launch plan RECIPE [--set ...] [--device-memory 16GiB] [--out DIR]`

Traces the recipe's training step (one rank, no training, nothing started), plans LMS with the
recipe's `lms` settings, and estimates peak memory with and without it on a virtual GPU of
`--device-memory` (TensorFlow's Grappler estimator; no GPU is needed). Writes DIR/plan.json and prints
a summary. Exit 0 on success, 2 for bad input.
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
from lms_core.units import parse_bytes

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
    p.add_argument("--device-memory", default="16GiB", help="virtual GPU memory for the estimate (default 16GiB)")
    p.add_argument("--out", help="where plan.json goes (default: runs/plan-<recipe>-<time>)")
    return p


def main(argv: list[str]) -> int:
    try:
        args = parser().parse_args(argv)
        recipe = load_recipe(args.recipe, args.overrides)
        try:
            device_memory = parse_bytes(args.device_memory)
        except ValueError as err:
            raise PlanUsageError(f"--device-memory: {err}") from None
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
    import lms_core.tf as lms_tf
    from launcher.training import build_training

    started = time.perf_counter()
    setup = build_training(recipe, ranks=1, device="CPU:0")
    say("tracing the training step")
    traced_at = time.perf_counter()
    concrete = lms_tf.trace(setup.step, *setup.specs)
    say(f"traced {len(concrete.graph.get_operations())} ops in {time.perf_counter() - traced_at:.1f} s; planning")
    rewritten = lms_tf.rewrite(setup.step, *setup.specs, config=planned_lms, compute_device="/device:GPU:0",
                               host_device="/device:CPU:0")
    say(f"{rewritten.plan.summary()}; estimating peak memory on a {device_memory / 2**30:.1f} GiB virtual GPU")
    baseline, lms = lms_tf.estimate_rewrite(rewritten, device_memory)

    plan = rewritten.plan.to_dict()
    plan["recipe"] = str(args.recipe)
    plan["fits"] = {"baseline": baseline.fits, "lms": lms.fits}
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (PLAN_FILE + ".tmp")
    tmp.write_text(json.dumps(plan, indent=2))
    tmp.replace(out / PLAN_FILE)

    gib = 2**30
    print(f"\n{recipe.model.name} {recipe.model.input_shape} batch {recipe.train.batch_size}: "
          f"{plan['swap_count']} tensor(s) swapped, {plan['swapped_bytes'] / gib:.2f} GiB per step to host")
    for label, estimate in (("without LMS", baseline), ("with LMS", lms)):
        verdict = "fits" if estimate.fits else "does NOT fit"
        print(f"  {label:<12} estimated GPU peak {estimate.device_bytes / gib:7.2f} GiB: {verdict} in "
              f"{device_memory / gib:.1f} GiB")
    if baseline.device_bytes:
        print(f"  GPU peak with LMS is {lms.device_bytes / baseline.device_bytes:.0%} of the baseline; "
              f"host memory used {lms.host_bytes / gib:.2f} GiB")
    print(f"  (Grappler estimates on a virtual GPU, not measurements; {time.perf_counter() - started:.0f} s)")
    print(f"plan written to {out / PLAN_FILE}")
    return 0
