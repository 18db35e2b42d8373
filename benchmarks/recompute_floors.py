"""Recompute and the swaps' floor: the floor of each step as traced, with the recomputes chosen at the
unswapped peak alone, and with them kept within the floor (lms_core.recompute.within_floor).

    .venv/bin/python benchmarks/recompute_floors.py [--out FILE]

The floor is the most the step's unswapped order holds at one moment with every swappable tensor off
whenever it could be (lms_core.access_order.schedule_floor): no swap plan in that order peaks lower.
Each step is traced on this machine's CPU and planned as a rank plans it (backward branches ordered,
the budget lms.memory_ratio x 16 GiB); the figures are the simulator's, a model's. Below each
traced floor are the largest tensors it holds at that moment: what a plan in this order cannot move.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GIB = 1 << 30

# name: (recipe, overrides, device profile, link)
CASES = {
    "resnet50-b1024-pcie5": ("resnet50", ["train.batch_size=1024"], "h100", "pcie5"),
    "unet3d-384-nvlink2": ("unet3d", ["model.input_shape=[384,384,384,4]"], "v100", "nvlink2"),
}


def floors(recipe_name: str, overrides: list[str], device: str, link_name: str) -> list[str]:
    """The case's lines: the traced floor, then the recomputes and floor without and with the check."""
    import lms_core.tf as lms_tf
    from launcher.rank.training import build_training
    from launcher.recipe import load_recipe
    from lms_core.costs import PROFILES
    from lms_core.link import link_named
    from lms_core.plan import Plan
    from lms_core.planning import Target, op_costs, swap_floor
    from lms_core.recompute import FloorCheck, plan_recompute
    from lms_core.serialize import order_edges, with_control_edges
    from lms_core.simulator import simulate

    recipe = load_recipe(ROOT / "recipes" / f"{recipe_name}.yaml", overrides)
    config = dataclasses.replace(recipe.lms, enabled=True, mode="auto")
    setup = build_training(recipe, ranks=1, device="CPU:0")
    traced = lms_tf.trace_step(setup.step, *setup.specs)
    graph = with_control_edges(traced.graph, order_edges(traced.graph, max(1, config.min_tensor_bytes)))
    link = link_named(link_name)
    costs, _ = op_costs(graph, Target(link, PROFILES[device], 16 * GIB, 512 * GIB))
    budget = int(16 * GIB * config.memory_ratio)

    def floor_of(step, unswapped):
        return swap_floor(step, unswapped, config, link, "/device:GPU:0", traced.data_inputs)

    unswapped = simulate(graph, Plan(settings=config.settings()), costs, link, keep_events=True)
    traced_floor = floor_of(graph, unswapped)[0]
    lines = [f"  as traced: floor {traced_floor / GIB:.2f} GiB (budget {budget / GIB:.2f} GiB); "
             f"its largest tensors then:"]
    lines += held_at_the_floor(graph, unswapped, config, link, traced.data_inputs)
    within = FloorCheck(floor_of, max(budget, traced_floor))
    for label, check in (("at the peak alone", None), ("within the floor", within)):
        chosen = plan_recompute(graph, config.settings(), costs, link, budget, config.min_tensor_bytes,
                                floor_check=check)
        replay = simulate(chosen.graph, Plan(settings=config.settings()), chosen.costs, link, keep_events=True)
        lines.append(f"  recomputes chosen {label}: {len(chosen.recomputes)} tensors, "
                     f"{sum(e.nbytes for e in chosen.recomputes) / GIB:.2f} GiB; floor "
                     f"{floor_of(chosen.graph, replay)[0] / GIB:.2f} GiB")
    return lines


def held_at_the_floor(graph, unswapped, config, link, data_inputs, top: int = 6) -> list[str]:
    """The `top` largest buffers the step as traced holds at its floor's moment: what sets it."""
    from lms_core.access_order import Schedule, find_candidates, held_at_floor
    from lms_core.graph import split_tensor

    schedule = Schedule(graph, unswapped)
    candidates, _ = find_candidates(graph, config, schedule, link, "/device:GPU:0", data_inputs)
    _, resident = held_at_floor(unswapped, schedule, candidates)
    largest = sorted(((graph.tensor(buffer).nbytes or 0, buffer) for buffer in resident), reverse=True)[:top]
    return [f"    {nbytes / GIB:6.2f} GiB  {graph[split_tensor(buffer)[0]].type:<14} {buffer}"
            for nbytes, buffer in largest]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write the lines to this file")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    lines = [time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             f"machine: {platform.node()}, {os.cpu_count()} CPU cores, no GPU: simulator figures",
             f"command: .venv/bin/python benchmarks/recompute_floors.py {' '.join(sys.argv[1:])}"]
    for line in lines:
        print(line, flush=True)
    for name, (recipe, overrides, device, link) in CASES.items():
        case = [f"{name}: {recipe} {' '.join(overrides)}, {device} on {link}, 16 GiB"]
        case += floors(recipe, overrides, device, link)
        print("\n".join(case), flush=True)
        lines += case
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
