"""The simulator's peak-memory prediction against TensorFlow's Grappler estimate, on the papers' two
networks at three sizes each, before and after the LMS rewrite.

    .venv/bin/python benchmarks/simulator_vs_grappler.py

With an infinitely fast link the simulator models what Grappler models (no transfer time), so the two
peaks should agree (the goal: within 10%) where every copy out is waited for; with the real links
nvlink2 and pcie3, copies hold device buffers longer, so the simulator's peak should never be below
Grappler's. Where no op waits for a copy out (`sync_mode` 0) they should not agree: Grappler counts the
swapped tensor gone when its readers end, while TensorFlow's executor, running ahead of the GPU, sees
it gone only at its next wait for the GPU, which the simulator models (HOST_RUNS_AHEAD; on an H100,
2026-11-27: 20.48 GiB measured for a plan Grappler put at 3.25, docs/benchmarks.md, "An H100"). ResNet-50 is
planned with the default settings but `swapin_ahead: 1`, at `sync_mode` 0 and 1, the U-Net with
threshold 4, ahead 1, sync 3: each swap-in triggered by the op right before its consumer, the one
schedule both models describe alike. (Grappler runs a swapped value's _Recv just before its consumer whatever the trigger;
the simulator allocates it at the trigger, as a GPU does: with swapin_ahead 2 ResNet-50 at batch 128
is 17% apart. The baseline is the step as traced, without the order LMS imposes on the backward pass.)
"""
from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

GIB = 2**30


def main() -> int:
    import lms_core.tf as lms_tf
    from keras_steps import resnet_step, unet3d_step  # beside this script
    from lms_core.config import LMSConfig
    from lms_core.costs import PROFILES, step_costs
    from lms_core.link import INFINITE, NAMED_LINKS
    from lms_core.plan import Plan
    from lms_core.simulator import simulate

    cases = [(f"ResNet-50 sync {sync}", f"batch {b}", lambda b=b: resnet_step("ResNet50", b),
              LMSConfig(enabled=True, swapin_ahead=1, sync_mode=sync)) for sync in (0, 1) for b in (32, 64, 128)]
    unet_lms = LMSConfig(enabled=True, swapout_threshold=4, swapin_ahead=1, sync_mode=3)
    cases += [("3D U-Net", f"{s}^3", lambda s=s: unet3d_step(s), unet_lms) for s in (96, 144, 192)]
    print(f"peaks in GiB; sim = simulator (v100 costs), ratio = sim / Grappler; {os.cpu_count()} CPU(s)")
    print(f"{'model':<16} {'size':<10} {'Grappler':>9} {'sim':>7} {'ratio':>6} | {'Grappler LMS':>12} {'sim LMS':>8} "
          f"{'ratio':>6} | {'nvlink2':>8} {'pcie3':>7}  seconds")
    for model, size, build, config in cases:
        started = time.perf_counter()
        step, specs = build()
        rewritten = lms_tf.rewrite(step, *specs, config=config)
        estimate = lms_tf.estimate_rewrite(rewritten, 1 << 40)
        graph, plan = rewritten.planning.graph, rewritten.plan
        costs = step_costs(graph, PROFILES["v100"])
        base = simulate(rewritten.planning.traced, Plan(settings=plan.settings), costs, INFINITE).peak_device_bytes
        lms = simulate(graph, plan, costs, INFINITE).peak_device_bytes
        real = [simulate(graph, plan, costs, NAMED_LINKS[link]).peak_device_bytes for link in ("nvlink2", "pcie3")]
        print(f"{model:<16} {size:<10} {estimate.baseline_bytes / GIB:9.2f} {base / GIB:7.2f} "
              f"{base / estimate.baseline_bytes:6.3f} | {estimate.lms_bytes / GIB:12.2f} {lms / GIB:8.2f} "
              f"{lms / estimate.lms_bytes:6.3f} | {real[0] / GIB:8.2f} {real[1] / GIB:7.2f}  "
              f"{time.perf_counter() - started:.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
