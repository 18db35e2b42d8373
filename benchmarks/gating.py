"""Are the swap-ins gated in what TensorFlow executes, and do the numbers stay the same? For each test
architecture, on split devices (compute /device:CPU:1, host /device:CPU:0):

- `swap-ins gated` on the partition graphs of one executed step, with the placement the project had
  before (the swap-in on the compute device) and with the gated one;
- the largest loss difference (relative) and weight difference (relative to the model's largest
  weight) between 3 steps with the gated rewrite and 3 steps of the original step.

    .venv/bin/python benchmarks/gating.py

Every tensor that can be swapped is (`swapout_threshold: 1`, `min_tensor_bytes: 0`), brought back one
level ahead. The models are those of benchmarks/architectures.py.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    from launcher.rank.devices import HOST_DEVICE, split_cpu

    split_cpu()
    import numpy as np
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")  # the models are traced again on purpose

    import lms_core.tf as lms_tf
    from lms_core.config import LMSConfig
    from lms_core.tf.gating import verify_gating
    from benchmarks.architectures import ARCHITECTURES, training_step

    compute = "/device:CPU:1"
    config = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, swapin_ahead=1, min_tensor_bytes=0)
    print(f"{'model':<18} {'swap-ins':>8} {'gated, old placement':>21} {'gated, new':>11} {'loss diff':>10} "
          f"{'weight diff':>12}")
    for name in sorted(ARCHITECTURES):
        counts = {}
        for placement in (lms_tf.Placement.UNGATED_ON_COMPUTE, lms_tf.Placement.GATED_ON_HOST):
            _, _, step, specs, batch = training_step(ARCHITECTURES[name], device=compute)
            rewritten = lms_tf.rewrite(step, *specs, config=config, compute_device=compute, host_device=HOST_DEVICE,
                                       placement=placement)
            report = verify_gating(rewritten, *batch)
            counts[placement] = (report.gated, len(report.gates))
        model_a, _, step_a, specs, batch = training_step(ARCHITECTURES[name], device=compute)
        with tf.device(compute):
            losses_a = [float(step_a(*batch)) for _ in range(3)]
        model_b, _, step_b, _, _ = training_step(ARCHITECTURES[name], device=compute)
        rewritten = lms_tf.rewrite(step_b, *specs, config=config, compute_device=compute, host_device=HOST_DEVICE)
        losses_b = [float(rewritten(*batch)) for _ in range(3)]
        loss_diff = max(abs(b - a) / max(abs(a), 1e-30) for a, b in zip(losses_a, losses_b))
        scale = max(float(np.max(np.abs(v.numpy()))) for v in model_a.weights)
        weight_diff = max(float(np.max(np.abs(b.numpy() - a.numpy()))) for a, b in zip(model_a.weights, model_b.weights))
        old, new = counts[lms_tf.Placement.UNGATED_ON_COMPUTE], counts[lms_tf.Placement.GATED_ON_HOST]
        print(f"{name:<18} {new[1]:>8} {old[0]:>16}/{old[1]:<4} {new[0]:>6}/{new[1]:<4} {loss_diff:>10.1e} "
              f"{weight_diff / scale:>12.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
