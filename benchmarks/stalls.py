"""Where a plan's predicted stalls are: the simulator's idle compute stream, op by op.

    .venv/bin/python benchmarks/stalls.py recipes/resnet50.yaml --batch 1024 --strategy access-order
    .venv/bin/python benchmarks/stalls.py recipes/resnet50.yaml --batch 1024 --fused-batch-norm

Plans the recipe's step at `--batch` as `lms-launch bench` does (mode auto, the given strategy, 16 GiB,
v100 profile, the link given), replays the plan on the simulator and prints the largest buffers at its peak,
the stalls per half second of the step, and the longest waits with the op that waited. `plan --plot` draws the same step;
this says which ops wait and for how long.

`--fused-batch-norm` is an experiment, not a recipe setting: it traces ResNet-50 with every Keras
`BatchNormalization` computed by TensorFlow's fused kernel in training (`FusedBatchNormV3`, whose
gradient is one `FusedBatchNormGradV3`), as TF 1.x Keras did and the LMS papers ran, instead of
Keras 3's decomposition into moments and element-wise ops. The moving statistics are updated with
the kernel's batch statistics; nothing is trained here, the step is only traced and simulated, so
this model is used for its sizes and times only.
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


def use_fused_batch_norm() -> None:
    """Replace Keras' BatchNormalization, for models built after this call, by one that trains with
    TensorFlow's fused kernel (channels-last inputs of rank 4 or 5; anything else as Keras does)."""
    import keras.src.layers as keras_layers
    import tensorflow as tf
    from keras.src.layers.normalization.batch_normalization import BatchNormalization

    class FusedBatchNormalization(BatchNormalization):
        def call(self, inputs, training=None, mask=None):
            rank = len(inputs.shape)
            if not training or mask is not None or rank not in (4, 5) or self.axis not in (-1, rank - 1):
                return super().call(inputs, training=training, mask=mask)
            channels = inputs.shape[-1]
            scale = self.gamma if self.scale else tf.ones([channels])
            offset = self.beta if self.center else tf.zeros([channels])
            outputs, mean, variance = tf.compat.v1.nn.fused_batch_norm(
                inputs, scale, offset, epsilon=self.epsilon, is_training=True,
                data_format="NHWC" if rank == 4 else "NDHWC")
            self.moving_mean.assign(self.moving_mean * self.momentum + mean * (1 - self.momentum))
            self.moving_variance.assign(self.moving_variance * self.momentum + variance * (1 - self.momentum))
            return outputs

    keras_layers.BatchNormalization = FusedBatchNormalization


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--strategy", choices=("distance", "access-order"), default="access-order")
    parser.add_argument("--link", default="nvlink2")
    parser.add_argument("--fused-batch-norm", action="store_true", help="the experiment in the docstring")
    parser.add_argument("--top", type=int, default=15, help="longest waits to list")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from launcher.rank.devices import split_cpu

    split_cpu()  # the gating check of the rewrite runs on two CPU devices, as in the bench
    if args.fused_batch_norm:
        use_fused_batch_norm()
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
    print(f"{setup.recipe.model.name} batch {args.batch}{' (fused batch norm)' if args.fused_batch_norm else ''}, "
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
