"""How long LMS auto-tuning takes for ResNet-50's step (the goal: under 10 s on a 2-core machine),
on two links, and what it chooses.

    .venv/bin/python benchmarks/tune_speed.py [--batch 256]

Timed: the whole tuner (every simulation of the step with its plan) after tracing and analysis.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()

    import lms_core.tf as lms_tf
    from keras_steps import resnet_step  # beside this script
    from lms_core.config import LMSConfig
    from lms_core.costs import PROFILES, step_costs
    from lms_core.link import NAMED_LINKS
    from lms_core.tuner import tune

    step, specs = resnet_step("ResNet50", args.batch)
    config = LMSConfig(enabled=True, mode="manual")
    _, graph, _ = lms_tf.plan_step(step, *specs, config=config)
    device = PROFILES["v100"]
    costs = step_costs(graph, device)
    budget = int(device.memory_bytes * 0.9)
    print(f"ResNet-50 batch {args.batch}, {len(graph)} ops, v100 profile, budget {budget / 2**30:.1f} GiB, "
          f"{os.cpu_count()} CPU(s)")
    for link in ("nvlink2", "pcie3"):
        started = time.perf_counter()
        result = tune(graph, costs, NAMED_LINKS[link], budget, 1 << 40, config, "/device:GPU:0")
        print(f"{link:<8} {time.perf_counter() - started:5.1f} s  {result.describe()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
