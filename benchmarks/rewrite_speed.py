"""How long the LMS rewrite takes after tracing, for ResNet-50, -101 and -152, so growth with graph
size is visible (the goal for ResNet-50: under 2 s on a 2-core machine).

    .venv/bin/python benchmarks/rewrite_speed.py [--batch 64] [--repeats 3]

"rewrite" is everything lms_core.tf.rewrite does after the step is traced: the IR, categories,
levels, the plan, the GraphDef edit, and the re-import as a callable. Tracing is timed apart,
since it is TensorFlow's and happens with or without LMS.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import lms_core.tf as lms_tf
    from keras_steps import resnet_step  # beside this script
    from lms_core.config import LMSConfig
    from lms_core.plan import Plan
    from lms_core.planner import plan_swaps
    from lms_core.tf.apply import apply_plan
    from lms_core.tf.capture import graph_ir
    from lms_core.tf.reimport import RewrittenStep

    config = LMSConfig(enabled=True)
    print(f"batch {args.batch} at 224x224, SGD with momentum; median of {args.repeats} rewrites; "
          f"{os.cpu_count()} CPU(s)")
    print(f"{'model':<11} {'ops':>6} {'swaps':>6} {'trace s':>8} {'plan s':>7} {'rewrite s':>10}")
    for name in ("ResNet50", "ResNet101", "ResNet152"):
        step, specs = resnet_step(name, args.batch)
        started = time.perf_counter()
        concrete = lms_tf.trace(step, *specs)
        traced = time.perf_counter() - started
        plan_times, rewrite_times = [], []
        plan: Plan | None = None
        for _ in range(args.repeats):
            started = time.perf_counter()
            graph = lms_tf.analyze(graph_ir(concrete.graph))
            plan = plan_swaps(graph, config, "/device:GPU:0")
            planned = time.perf_counter()
            graph_def = apply_plan(concrete.graph.as_graph_def(), plan, "/device:GPU:0", "/device:CPU:0")
            RewrittenStep(concrete, graph_def, plan)
            done = time.perf_counter()
            plan_times.append(planned - started)
            rewrite_times.append(done - started)
        print(f"{name:<11} {len(graph):>6} {len(plan.swaps):>6} {traced:>8.2f} {statistics.median(plan_times):>7.2f} "
              f"{statistics.median(rewrite_times):>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
