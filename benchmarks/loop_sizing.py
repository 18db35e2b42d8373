"""Loop accumulators: the project's sizing against TensorFlow's CPU allocator (issue 18).

    .venv/bin/python benchmarks/loop_sizing.py [--sizes B,T,U ...] [--out benchmarks/results/loop-sizing.txt]

For each size, the training step of a rolled 2-layer Keras LSTM (benchmarks.architectures.rolled_lstm:
batch B, T time steps, U units, input width U, SGD with momentum), without LMS, in a fresh process with
TensorFlow's BFC CPU allocator (`TF_CPU_ALLOCATOR_USE_BFC`), one inter-op and one intra-op thread and
oneDNN off (as benchmarks/bfc_worker.py; its single-threaded executor cannot run a lowered loop):

- sized: the accumulators as lms_core.loops sizes them (element shape x trip count, from the graph);
- held: what the allocator holds for them, measured (`get_memory_info('CPU:0')['current']` around a
  call of the forward pass that returns them);
- zeros: the zero lists the gradient loops fill (the gradient of the second layer's unstacked input),
  sized the same way (lms_core.loops.gradient_lists);
- Grappler: its peak estimate of the step, which sizes every TensorList as nothing, and the figure
  `lms-launch plan` prints: Grappler + sized + zeros;
- peak: the allocator's peak over one step (`get_memory_info('CPU:0')['peak']`, stats reset before
  it), with the loops as traced (Keras asks 32 parallel iterations) and with every loop made to run
  one iteration at a time (`parallel_iterations` 1): iterations in flight together hold their
  temporaries together, which the graph alone does not say;
- unset: the same peak, one iteration at a time, with the zero lists left unset until their gradient
  loop fills them (`lms.reserve_gradient_lists`, lms_core/reserved_lists.py; nothing swapped), and
  the figure for it (Grappler + the lists as lms_core.loops counts them with LMS).

The goal (issue 18): the sizing within 5% of the measured figure.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lms_core.tf.reimport import RewrittenStep  # noqa: E402

DEFAULT_SIZES = ["16,32,64", "16,128,64", "16,32,128", "32,64,128"]
GOAL = 0.05
CPU = "/device:CPU:0"


def measure(batch: int, steps: int, units: int, repeats: int = 4, layers: int = 2) -> dict:
    """One size, in this process (call it in a fresh one: the allocator's regions are its own)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import lms_core.tf as lms_tf
    from benchmarks.architectures import rolled_lstm, training_step
    from lms_core.config import LMSConfig
    from lms_core.loops import accumulators, unseen_bytes

    _, _, step, specs, batch_tensors = training_step(rolled_lstm(batch, steps, units, units, layers_count=layers))
    # The step without LMS, re-imported unchanged (a plan that swaps and orders nothing), as a rank
    # runs it: the same graph TensorFlow would run for the tf.function.
    unchanged = LMSConfig(enabled=True, mode="manual", swapout_threshold=10**9, serialize_branches=False,
                          reserve_gradient_lists=False)
    step_as_run = lms_tf.rewrite(step, *specs, config=unchanged, compute_device=CPU, host_device=CPU)
    assert step_as_run.graph_def == step_as_run.concrete.graph.as_graph_def() and not step_as_run.plan.swaps
    graph = step_as_run.planning.graph
    loops = unseen_bytes(graph, set())
    grappler = lms_tf.estimate_peak(step_as_run.graph_def, step_as_run.concrete).device_bytes
    held = held_by_accumulators(step_as_run.concrete, batch_tensors, [a.tensor for a in accumulators(graph)])
    one_at_a_time = RewrittenStep(step_as_run.concrete, with_parallel_iterations(step_as_run.graph_def, 1),
                                  step_as_run.planning, CPU, CPU)
    measured = {"batch": batch, "steps": steps, "units": units, "grappler": grappler,
                "accumulators": sum(a.nbytes for a in accumulators(graph)), "accumulator_count": loops.count,
                "gradient_lists": loops.gradient_list_bytes, "held": held, "figure": grappler + loops.baseline_bytes,
                "peaks": peaks(step_as_run, batch_tensors, repeats),
                "peaks_one_iteration": peaks(one_at_a_time, batch_tensors, repeats)}
    # The same step with the zero lists left unset, made only now: rewriting it first (a trace and a
    # Grappler run) left the peaks above 0.3-0.6 MiB higher at 32,64,128.
    unset = lms_tf.rewrite(step, *specs, config=dataclasses.replace(unchanged, reserve_gradient_lists=True),
                           compute_device=CPU, host_device=CPU)
    unset_one_at_a_time = RewrittenStep(unset.concrete, with_parallel_iterations(unset.graph_def, 1), unset.planning,
                                        CPU, CPU)
    measured.update(unset_lists=len(unset.plan.reserved_lists),
                    figure_unset_lists=(lms_tf.estimate_peak(unset.graph_def, unset.concrete).device_bytes
                                        + unseen_bytes(unset.planning.graph, set()).lms_bytes),
                    peaks_unset_lists=peaks(unset_one_at_a_time, batch_tensors, repeats))
    return measured


def peaks(run, batch, repeats: int) -> list[int]:
    """The CPU allocator's peak over each of `repeats` steps, after a first that instantiates."""
    import tensorflow as tf

    run(*batch).numpy()
    found = []
    for _ in range(repeats):
        tf.config.experimental.reset_memory_stats("CPU:0")
        run(*batch).numpy()
        found.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    return found


def with_parallel_iterations(graph_def, count: int):
    """A copy of `graph_def` whose loops run at most `count` iterations at once (Keras asks 32)."""
    from tensorflow.core.framework import graph_pb2

    result = graph_pb2.GraphDef()
    result.CopyFrom(graph_def)
    for node in [*result.node, *(n for f in result.library.function for n in f.node_def)]:
        if node.op in ("While", "StatelessWhile"):
            node.attr["parallel_iterations"].i = count
    return result


def held_by_accumulators(concrete, batch, tensors: list[str]) -> int:
    """Bytes the allocator holds for `tensors` (the forward loops' accumulators), measured: the step's
    graph re-imported to return just them (so only the forward pass runs), called once to instantiate,
    then again with the allocator's in-use bytes read before and after. The returned lists keep their
    elements alive and everything else the call made is freed."""
    import tensorflow as tf

    graph = concrete.graph
    captured = {id(internal) for _, internal in graph.captures}
    data = [t for t in graph.inputs if id(t) not in captured]
    names = [t.name for t in data] + [internal.name for _, internal in graph.captures]
    signature = [tf.TensorSpec(t.shape, t.dtype) for t in data]
    signature += [tf.TensorSpec(internal.shape, internal.dtype) for _, internal in graph.captures]
    graph_def = graph.as_graph_def()

    def forward_lists(*args):
        return tf.graph_util.import_graph_def(graph_def, input_map=dict(zip(names, args)), return_elements=tensors,
                                              name="lists")

    function = tf.compat.v1.wrap_function(forward_lists, signature)
    handles = [external for external, _ in graph.captures]
    del function(*batch, *handles)[:]  # the first call instantiates the function
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    lists = function(*batch, *handles)
    held = tf.config.experimental.get_memory_info("CPU:0")["current"] - before
    del lists
    return held


def mib(n: int) -> str:
    return f"{n / 2**20:8.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/loop_sizing.py")
    parser.add_argument("--sizes", nargs="*", default=DEFAULT_SIZES, help="B,T,U (batch, time steps, units)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # B,T,U: measure in this process, print JSON
    parser.add_argument("--repeats", type=int, default=4, help="steps measured per peak (after one that instantiates)")
    parser.add_argument("--layers", type=int, default=2, help="stacked LSTM layers")
    parser.add_argument("--out", help="also write the table (with date, machine and command) here")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(*(int(v) for v in args.one.split(",")), repeats=args.repeats, layers=args.layers)))
        return 0
    lines = [time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             f"machine: {platform.node() or 'vm'}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, no GPU",
             "command: .venv/bin/python benchmarks/loop_sizing.py " + " ".join(sys.argv[1:]), "",
             f"Rolled {args.layers}-layer Keras LSTM (B batch, T steps, U units, input width U), training step without LMS;",
             "MiB. sized: the accumulators as lms_core.loops sizes them; held: what the allocator holds for them",
             "(measured: the forward pass returning them). zeros: the zero lists the gradient loops fill (sized).",
             "figure = Grappler + sized + zeros (what lms-launch plan prints).",
             "peak: the CPU allocator's peak over one step (min-max of 4), loops as traced (Keras: 32 parallel",
             "iterations), and with every loop at parallel_iterations 1 (one iteration at a time).",
             "unset: with the zero lists left unset until their loop fills them (lms.reserve_gradient_lists):",
             "its figure, its peak one iteration at a time, and what that saves against the peak without.", "",
             f"{'B,T,U':>10} {'lists':>5} {'sized':>7} {'held':>7} {'err':>6} | {'zeros':>6} {'Grappler':>8} {'figure':>7} | "
             f"{'peak, 1 at a time':>17} {'figure err':>13} | {'peak, as traced':>15} {'figure err':>13} | "
             f"{'unset: figure':>13} {'peak':>17} {'saved':>13}"]
    worst_lists, worst_serial = 0.0, 0.0
    for size in args.sizes:
        done = subprocess.run([sys.executable, __file__, "--one", size, "--repeats", str(args.repeats),
                               "--layers", str(args.layers)],
                              capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        list_error = row["accumulators"] / row["held"] - 1
        worst_lists = max(worst_lists, abs(list_error))
        serial, traced = row["peaks_one_iteration"], row["peaks"]
        serial_errors = [row["figure"] / p - 1 for p in (max(serial), min(serial))]
        traced_errors = [row["figure"] / p - 1 for p in (max(traced), min(traced))]
        worst_serial = max(worst_serial, *(abs(e) for e in serial_errors))
        unset = row["peaks_unset_lists"]
        saved = [a - b for a, b in zip(serial, unset)]
        lines.append(f"{size:>10} {row['accumulator_count']:>5} {mib(row['accumulators'])} {mib(row['held'])} "
                     f"{list_error:>+6.1%} | {mib(row['gradient_lists']).strip():>6} {mib(row['grappler']):>8} "
                     f"{mib(row['figure'])} | "
                     f"{mib(min(serial)).strip():>8}-{mib(max(serial)).strip():<8} "
                     f"{serial_errors[0]:>+6.1%}/{serial_errors[1]:>+6.1%} | "
                     f"{mib(min(traced)).strip():>7}-{mib(max(traced)).strip():<7} "
                     f"{traced_errors[0]:>+6.1%}/{traced_errors[1]:>+6.1%} | "
                     f"{mib(row['figure_unset_lists']):>13} "
                     f"{mib(min(unset)).strip():>8}-{mib(max(unset)).strip():<8} "
                     f"{mib(min(saved)).strip():>6}-{mib(max(saved)).strip():<6}")
        print(lines[-1], flush=True)
    lines += ["", f"accumulators, sized against held: largest error {worst_lists:.1%} (goal: within {GOAL:.0%}): "
                  f"{'met' if worst_lists <= GOAL else 'NOT met'}",
              f"the step's figure against its peak, loops one iteration at a time: largest error {worst_serial:.1%} "
              f"(goal: within {GOAL:.0%}): {'met' if worst_serial <= GOAL else 'NOT met'}",
              "the step's figure against its peak as traced: see the last column (iterations in flight at once",
              "hold their temporaries together; no figure of the graph alone can say how many the executor runs)"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
