"""What TensorFlow's allocator holds where the backward pass joins, against what the simulator counts.

    .venv/bin/python benchmarks/join_peaks.py [--mib 64] [--out FILE]

The swaps' floor that holds ResNet-50 at batch 1024 (and the 3D U-Net at 384^3) over its budget is
set at a block boundary of the backward pass: the residual gradients' AddN and the ReLU gradient
after it (docs/lms.md, "Keep, swap or recompute"). The simulator, like Grappler's estimate, counts an
op's new buffers together with those its predecessor frees at the same instant, and gives every op
an output buffer of its own. TensorFlow's executor releases an op's inputs before its successor
allocates, and element-wise kernels may write into an input they read last. Which one holds on the
device decides whether those plans fit.

Each case is a small tf.function on tensors of --mib MiB, run on the GPU if there is one (else on the
CPU, with TensorFlow's BFC allocator for the CPU so that it keeps a peak); the peak is the
allocator's, above what the inputs hold, against the simulator's for the same traced graph (the
inputs left out: the caller holds them). Measured on whatever machine runs it; the figures are the
allocator's, not a model's.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # the CPU allocator keeps peak statistics only so
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MIB = 1 << 20


def cases(tf):
    """name -> (what it is, the function of (x, y)): x and y are the inputs, y of mixed sign."""
    def chain(x, y):
        return tf.reduce_sum(tf.tanh(tf.cos(tf.sin(x))))

    def join(terms):
        def step(x, y):
            parts = [tf.sin(x), tf.cos(x), tf.tanh(x)][:terms]
            gradient = tf.raw_ops.ReluGrad(gradients=tf.math.add_n(parts), features=y)
            return tf.reduce_sum(gradient)
        return step

    return {
        "chain": ("sin -> cos -> tanh -> sum: each op the last reader of its input", chain),
        "join-2": ("AddN of 2 terms -> ReluGrad -> sum: a residual block's boundary", join(2)),
        "join-3": ("AddN of 3 terms -> ReluGrad -> sum: a batch norm's gradient terms", join(3)),
    }


def measured_peak(tf, function, x, y, device: str) -> int:
    """The allocator's peak while one call runs, above what was allocated before it (the inputs)."""
    function(x, y).numpy()  # traced and run once: kernels and constants are in place
    tf.config.experimental.reset_memory_stats(device)
    before = tf.config.experimental.get_memory_info(device)["current"]
    function(x, y).numpy()
    return tf.config.experimental.get_memory_info(device)["peak"] - before


def simulated_peak(function, x, y) -> int:
    """The simulator's device peak for the traced graph, the inputs' buffers left out."""
    import tensorflow as tf

    import lms_core.tf as lms_tf
    from lms_core.link import link_named
    from lms_core.plan import Plan
    from lms_core.simulator import simulate

    traced = lms_tf.trace_step(function, tf.TensorSpec(x.shape, x.dtype), tf.TensorSpec(y.shape, y.dtype))
    graph = traced.graph
    result = simulate(graph, Plan(settings={}), {name: 1.0 for name in graph.order}, link_named("pcie3"),
                      keep_events=True)
    inputs = {op for op in graph.order if graph[op].type == "Placeholder"}
    held, peak = 0, 0
    for event in sorted(result.memory_events, key=lambda e: (e.time, e.phase)):
        if event.buffer.split(":")[0] not in inputs:
            held += event.nbytes
            peak = max(peak, held)
    return peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="each tensor's size in MiB (default 64)")
    parser.add_argument("--out", help="also write the lines to this file")
    args = parser.parse_args()
    if args.mib < 1:
        parser.error("--mib: must be at least 1")
    import tensorflow as tf

    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    out = open(args.out, "w") if args.out else None

    def say(line: str) -> None:
        print(line, flush=True)
        if out:
            out.write(line + "\n")

    say(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    say(f"machine: {platform.node()}, {os.cpu_count()} CPU cores; device {device}; TensorFlow {tf.__version__}; "
        f"inter-op threads {tf.config.threading.get_inter_op_parallelism_threads() or 'default'} (ops may run "
        f"side by side, as in training)")
    say(f"command: python benchmarks/join_peaks.py {' '.join(sys.argv[1:])}")
    say(f"tensors of {args.mib} MiB; peaks above the inputs, in tensors of that size")
    n = args.mib * MIB // 4
    with tf.device(device):
        x = tf.random.uniform([n])
        y = tf.random.uniform([n]) - 0.5
    for name, (what, body) in cases(tf).items():
        function = tf.function(body)
        with tf.device(device):
            measured = measured_peak(tf, function, x, y, device)
        simulated = simulated_peak(function, x, y)
        size = args.mib * MIB
        say(f"{name:<7} allocator {measured / size:4.1f}  simulator {simulated / size:4.1f}  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
