"""The access-order strategy against the distance planner, and the zero-overhead point, by the
simulator on the v100 profile (the figures of docs/lms.md's "The access-order strategy"):

    .venv/bin/python benchmarks/access_order.py [--quick] [--only resnet50|unet3d] [--set KEY=VALUE ...]

For each case (a recipe at a batch or input size, a link): the unswapped step, the tuned distance
plan, the access-order plan, and the lower bound (lms_core.access_order.lower_bound_s): predicted
step, overhead, peak, bytes to the host per step, and whether it fits the planning budget (16 GiB x
lms.memory_ratio). Then, for each recipe and link, the zero-overhead point: the largest saving the
access-order planner finds within 1% of the unswapped step, and the most any plan in the step's
order could save for free. The graphs are traced as `lms-launch plan` traces them (the recipe's
model and settings, its backward order imposed); nothing runs on a GPU. `--quick` does only the
first case.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# (recipe, overrides, link): the rows of issue 16's table.
CASES = [
    ("recipes/resnet50.yaml", ["train.batch_size=256"], "pcie3"),
    ("recipes/resnet50.yaml", ["train.batch_size=1024"], "nvlink2"),
    ("recipes/resnet50.yaml", ["train.batch_size=1317"], "nvlink2"),
    ("recipes/unet3d.yaml", ["model.input_shape=[256,256,256,4]"], "pcie3"),
    ("recipes/unet3d.yaml", ["model.input_shape=[256,256,256,4]"], "nvlink2"),
    ("recipes/unet3d.yaml", ["model.input_shape=[368,368,368,4]"], "pcie3"),  # the bench's largest cube
]
# (recipe, overrides): the sizes whose zero-overhead point is reported on every link.
ZERO_OVERHEAD = [("recipes/resnet50.yaml", ["train.batch_size=256"]),
                 ("recipes/unet3d.yaml", [])]
LINKS = ("pcie3", "pcie4", "nvlink2")


@dataclasses.dataclass
class Traced:
    name: str
    graph: object
    data_inputs: frozenset
    edges: list
    costs: dict
    lms: object
    memory_bytes: int


def trace(recipe_path: str, overrides: list[str]) -> Traced:
    """The recipe's step traced and analysed as `lms-launch plan` does, with its backward order."""
    import keras

    import lms_core.tf as lms_tf
    from launcher.lms.target import rank_target
    from launcher.rank.training import build_training
    from launcher.recipe import load_recipe
    from lms_core.planning import op_costs
    from lms_core.serialize import order_edges, with_control_edges

    recipe = load_recipe(REPO / recipe_path, [*overrides, "lms.link=pcie3", "lms.host_memory=512GiB"])
    lms = dataclasses.replace(recipe.lms, enabled=True)
    keras.backend.clear_session()
    setup = build_training(recipe, ranks=1, device="CPU:0")
    target, _ = rank_target(lms, rank=0, local_rank=0, local_size=1, on_gpu=False)
    traced = lms_tf.trace_step(setup.step, *setup.specs)
    graph, edges = traced.graph, []
    if lms.serialize_branches:
        edges = order_edges(graph, max(1, lms.min_tensor_bytes))
        graph = with_control_edges(graph, edges)
    costs, _ = op_costs(graph, target)  # the device's costs: the same on every link
    shape = "x".join(map(str, recipe.model.input_shape[:-1]))
    return Traced(f"{recipe.model.name} {shape} batch {recipe.train.batch_size}", graph, traced.data_inputs, edges,
                  costs, lms, target.device_memory_bytes)


def compare(traced: Traced, link_name: str) -> list[str]:
    from lms_core.access_order import Schedule, lower_bound_s, plan_access_order
    from lms_core.link import NAMED_LINKS
    from lms_core.plan import Plan
    from lms_core.simulator import simulate
    from lms_core.tuner import tune

    link, lms = NAMED_LINKS[link_name], traced.lms
    budget = int(traced.memory_bytes * lms.memory_ratio)
    started = time.perf_counter()
    unswapped = simulate(traced.graph, Plan(settings=lms.settings()), traced.costs, link, keep_events=True)
    tuned = tune(traced.graph, traced.costs, link, budget, 1 << 40, lms, "/device:GPU:0", traced.data_inputs,
                 control_edges=traced.edges)
    tuned_s = time.perf_counter() - started
    started = time.perf_counter()
    ordered = plan_access_order(traced.graph, lms, traced.costs, link, budget, "/device:GPU:0", traced.data_inputs,
                                traced.edges, unswapped=unswapped)
    ordered_s = time.perf_counter() - started
    bound, forced = lower_bound_s(Schedule(traced.graph, unswapped), link, budget)
    base = unswapped.step_time_s
    lines = [f"{traced.name}, {link_name}: budget {gib(budget):.2f} GiB, unswapped peak "
             f"{gib(unswapped.peak_device_bytes):.2f} GiB, step {base * 1000:.0f} ms; at least {gib(forced):.2f} GiB "
             f"must be off the device at the peak; bound {bound * 1000:.0f} ms ({bound / base - 1:+.0%})"]
    for name, simulation, plan, seconds in (("distance", tuned.simulation, tuned.plan, tuned_s),
                                            ("access-order", ordered.simulation, ordered.plan, ordered_s)):
        fits = simulation.peak_device_bytes <= budget
        lines.append(f"  {name:<13} step {simulation.step_time_s * 1000:6.0f} ms ({simulation.step_time_s / base - 1:+5.0%},"
                     f" {simulation.step_time_s / bound:.2f}x the bound)  peak {gib(simulation.peak_device_bytes):6.2f} GiB "
                     f"({'fits' if fits else 'OVER'})  {len(plan.swaps):4d} swaps, {gib(plan.swapped_bytes):7.2f} GiB "
                     f"out, {gib(simulation.traffic_bytes):7.2f} GiB both ways  [{seconds:.0f} s to plan]")
    lines.append(f"  {ordered.describe()}")
    return lines


def zero_overhead(traced: Traced) -> list[str]:
    from lms_core.access_order import zero_overhead_point
    from lms_core.link import NAMED_LINKS

    lines = [f"{traced.name}: zero-overhead point (access-order, predicted step within 1% of the unswapped)"]
    for link in LINKS:
        point = zero_overhead_point(traced.graph, traced.lms, traced.costs, NAMED_LINKS[link], "/device:GPU:0",
                                    traced.data_inputs, traced.edges)
        lines.append(f"  {link:<8} {point.describe()}")
    return lines


def gib(n: int) -> float:
    return n / 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the first case, no zero-overhead points")
    parser.add_argument("--only", choices=("resnet50", "unet3d"), help="only this recipe's cases")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for every case run (with --only, for keys of that model), "
                             "e.g. --only resnet50 --set model.batch_norm=keras")
    args = parser.parse_args()
    from launcher.rank.devices import split_cpu

    split_cpu()
    chosen = [case for case in CASES if args.only is None or Path(case[0]).stem == args.only]
    traces: dict[tuple, Traced] = {}
    for recipe, overrides, link in chosen[:1] if args.quick else chosen:
        overrides = [*overrides, *args.set]
        key = (recipe, tuple(overrides))
        if key not in traces:
            traces[key] = trace(recipe, overrides)
        print("\n".join(compare(traces[key], link)), flush=True)
    if not args.quick:
        for recipe, overrides in ZERO_OVERHEAD:
            if args.only is not None and Path(recipe).stem != args.only:
                continue
            overrides = [*overrides, *args.set]
            key = (recipe, tuple(overrides))
            traced = traces.get(key) or trace(recipe, overrides)
            print("\n".join(zero_overhead(traced)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
