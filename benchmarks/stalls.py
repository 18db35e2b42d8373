"""Where a plan's predicted stalls are: the simulator's idle compute stream, op by op.

    .venv/bin/python benchmarks/stalls.py recipes/resnet50.yaml --batch 1024 --strategy access-order
    .venv/bin/python benchmarks/stalls.py recipes/resnet50.yaml --batch 1024 --set model.batch_norm=keras

Plans the recipe's step at `--batch` as `lms-launch bench` does (mode auto, the given strategy, 16 GiB,
v100 profile, the link given; `--set` overrides recipe keys as the bench's does), replays the plan on
the simulator and prints the largest buffers at its peak, the stalls per half second of the step, and
the longest waits with the op that waited. `plan --plot` draws the same step; this says which ops
wait and for how long.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
WINDOW_S = 0.5  # the stall histogram's bin
MIN_WAIT_S = 1e-4  # an idle gap shorter than this is rounding, not a wait


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--strategy", choices=("distance", "access-order"), default="access-order")
    parser.add_argument("--link", default="nvlink2")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override")
    parser.add_argument("--top", type=int, default=15, help="longest waits to list")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from launcher.rank.devices import split_cpu

    split_cpu()  # the gating check of the rewrite runs on two CPU devices, as in the bench
    import lms_core.tf as lms_tf
    from launcher.bench.command import lms_config, parser as bench_parser, resolve
    from launcher.bench.configurations import COMPUTE_DEVICE, HOST_DEVICE
    from launcher.bench.steps import StepSource
    from launcher.lms.target import rank_target
    from lms_core.planning import op_costs
    from lms_core.simulator import simulate
    from lms_core.units import format_bytes

    print(f"command: .venv/bin/python benchmarks/stalls.py {shlex.join(sys.argv[1:])}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; simulator predictions, not GPU measurements")
    bench_argv = ["max-batch", args.recipe, "--link", args.link, "--links", args.link]
    bench_argv += [item for override in args.set for item in ("--set", override)]
    setup = resolve(bench_parser().parse_args(bench_argv), bench_argv)
    config = dataclasses.replace(lms_config(setup), strategy=args.strategy)
    target, _ = rank_target(config, rank=0, local_rank=0, local_size=1, on_gpu=False)
    sized = StepSource(setup.axis, setup.recipe).at(args.batch)
    rewritten = lms_tf.rewrite(sized.step, *sized.specs, config=config, compute_device=COMPUTE_DEVICE,
                               host_device=HOST_DEVICE, target=target)
    graph, plan = rewritten.planning.graph, rewritten.plan
    costs, _ = op_costs(graph, target)
    result = simulate(graph, plan, costs, target.link, keep_events=True)
    unswapped = rewritten.report.prediction.unlimited_step_time_s
    batch_norm = f" ({setup.recipe.model.batch_norm} batch norm)" if setup.recipe.model.name == "resnet50" else ""
    print(f"{setup.recipe.model.name} batch {args.batch}{batch_norm}, "
          f"{len(graph.ops)} ops, {args.strategy} on {args.link}: {len(plan.swaps)} swaps, "
          f"{format_bytes(plan.swapped_bytes)} out; step {result.step_time_s * 1000:.0f} ms vs {unswapped * 1000:.0f} ms "
          f"unswapped ({result.step_time_s / unswapped - 1:+.0%}), stalls {result.stall_time_s * 1000:.0f} ms, "
          f"forward pass ends at {result.forward_time_s * 1000:.0f} ms, peak {format_bytes(result.peak_device_bytes)}")
    print("largest buffers at the simulated peak:")
    for buffer, nbytes in result.resident_at_peak[:6]:
        print(f"  {format_bytes(nbytes):>10}  {buffer}")
    waits, previous_end = [], 0.0
    for name, start, end in result.executed:
        if start - previous_end > MIN_WAIT_S:
            waits.append((start, start - previous_end, name))
        previous_end = end
    by_window = Counter()
    for start, wait, _ in waits:
        by_window[int(start / WINDOW_S)] += wait
    print("stalls by part of the step:")
    for window in sorted(by_window):
        print(f"  {window * WINDOW_S:5.1f}-{(window + 1) * WINDOW_S:4.1f} s  {by_window[window] * 1000:7.1f} ms")
    print(f"longest waits ({args.top}):")
    for start, wait, name in sorted(waits, key=lambda w: -w[1])[:args.top]:
        print(f"  at {start * 1000:7.1f} ms waited {wait * 1000:5.1f} ms: {graph[name].category:<8} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
