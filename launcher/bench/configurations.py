"""The configurations compared, each judged by Grappler's estimate on a virtual GPU (the estimate
judge; `run_judge` judges the same three by running them):

- `none`: the traced step as it is, no swapping;
- `grappler`: TensorFlow's own swapping, Grappler's memory optimizer at SWAPPING_HEURISTICS for a
  virtual GPU of the device memory (lms_core.tf.grappler_swapping);
- `lms-launch`: `lms.mode: auto` for the target (link, device profile, device and host memory), the
  recipe's other `lms` settings kept, applied with the gated placement, estimated with its swap-outs
  and swap-ins on the host (lms_core.tf.rewrite and estimate_rewrite: planner changes show up here);
- `floor`: no configuration, the bound none can pass: the largest op's working set plus weights and
  optimizer state (launcher.bench.floor) must fit.

A size fits when the estimated device peak is at most the device memory. Every probe traces the step
afresh at its size (launcher.bench.steps) and keeps only small results (peaks, predictions, the plan
as a dict), so no two large graphs are alive at once.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from launcher.bench.search import Probe
from launcher.bench.steps import StepSource
from lms_core.config import LMSConfig
from lms_core.planning import Target
from lms_core.units import format_bytes

COMPUTE_DEVICE = "/device:GPU:0"  # what the estimate places the step on: the virtual GPU
HOST_DEVICE = "/device:CPU:0"
CONFIGURATIONS = ("none", "grappler", "lms-launch")
LABELS = {
    "none": "no swapping",
    "grappler": "TensorFlow Grappler SWAPPING_HEURISTICS",
    "lms-launch": "lms-launch, lms.mode auto",
    "floor": "floor: largest op + weights + optimizer state",
}


@dataclass
class EstimateSetting:
    """What every estimate-judged probe shares."""

    source: StepSource
    device_memory_bytes: int
    target: Target  # link, device profile and memory for lms-launch's tuner and every predicted time
    lms: LMSConfig  # lms-launch's settings: the recipe's, enabled, mode auto


def probe_none(setting: EstimateSetting, size: int) -> Probe:
    import lms_core.tf as lms_tf

    started = time.perf_counter()
    sized = setting.source.at(size)
    concrete = lms_tf.trace(sized.step, *sized.specs)
    estimate = lms_tf.estimate_peak(concrete.graph.as_graph_def(), concrete, setting.device_memory_bytes)
    return Probe(size, estimate.fits, estimate.device_bytes, time.perf_counter() - started)


def probe_grappler(setting: EstimateSetting, size: int) -> Probe:
    import lms_core.tf as lms_tf
    from lms_core.tf.grappler_swapping import estimate_with_swapping

    started = time.perf_counter()
    sized = setting.source.at(size)
    concrete = lms_tf.trace(sized.step, *sized.specs)
    estimate, swapping = estimate_with_swapping(concrete.graph.as_graph_def(), concrete, setting.device_memory_bytes)
    swaps = len(swapping.swaps)
    return Probe(size, estimate.fits, estimate.device_bytes, time.perf_counter() - started,
                 detail=f"{swaps} swap(s) inserted", data={"swaps": swaps, "host_bytes": estimate.host_bytes})


def probe_lms(setting: EstimateSetting, size: int, target: Target | None = None) -> Probe:
    """lms-launch at `size`, tuned for `target` (the setting's, unless another link is asked for)."""
    import lms_core.tf as lms_tf

    started = time.perf_counter()
    target = target or setting.target
    sized = setting.source.at(size)
    rewritten = lms_tf.rewrite(sized.step, *sized.specs, config=setting.lms, compute_device=COMPUTE_DEVICE,
                               host_device=HOST_DEVICE, target=target)
    estimate = lms_tf.estimate_rewrite(rewritten, setting.device_memory_bytes)
    report = rewritten.report.with_estimate(estimate)
    plan, prediction = report.plan, report.prediction
    detail = f"{len(plan.swaps)} swap(s), {format_bytes(plan.swapped_bytes)} to host"
    if prediction.overhead is not None:
        detail += f"; predicted step {prediction.step_time_s * 1000:.0f} ms ({prediction.overhead:+.0%})"
    data = {"swaps": len(plan.swaps), "swapped_bytes": plan.swapped_bytes, "prediction": dataclasses.asdict(prediction),
            "overhead": prediction.overhead, "baseline_peak_bytes": estimate.baseline_bytes,
            "host_bytes": estimate.host_bytes, "link": target.link.name,
            # What was tuned, not the tuner's verdict on its own budget: the row's judge is the estimate.
            "tuning": rewritten.planning.tuning.settings_text() if rewritten.planning.tuning else None,
            "report_object": report}
    return Probe(size, estimate.lms_fits, estimate.lms_bytes, time.perf_counter() - started, detail=detail, data=data)


def probe_floor(setting: EstimateSetting, size: int) -> Probe:
    started = time.perf_counter()
    floor = setting.source.floor_at(size)
    detail = f"largest op {floor.op_type} {format_bytes(floor.working_set_bytes)}"
    return Probe(size, floor.total_bytes <= setting.device_memory_bytes, floor.total_bytes,
                 time.perf_counter() - started, detail=detail, data={"floor": floor.to_dict(), "floor_object": floor})


PROBES = {"none": probe_none, "grappler": probe_grappler, "lms-launch": probe_lms, "floor": probe_floor}
