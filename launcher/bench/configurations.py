"""The configurations compared, each judged by Grappler's estimate on a virtual GPU (the estimate
judge; `run_judge` judges the same three by running them):

- `none`: the traced step as it is, no swapping;
- `grappler`: TensorFlow's own swapping, Grappler's memory optimizer at SWAPPING_HEURISTICS for a
  virtual GPU of the device memory (lms_core.tf.grappler_swapping);
- `lms-launch`: `lms.mode: auto` for the target (link, device profile, device and host memory), the
  recipe's other `lms` settings kept, applied with the gated placement, estimated with its swap-outs
  and swap-ins on the host (lms_core.tf.rewrite and estimate_rewrite: planner changes show up here);
- `floor`: no configuration, the bound no plan of swaps can pass: the largest op's working set plus
  weights and optimizer state (launcher.bench.floor) must fit;
- `floor-rewritten`: the same bound for the step with the floor-lowering rewrites a plan can make
  (lms_core.add_chains: the AddNs that set the floor as chains of two-input adds).

A size fits when the estimated device peak is at most the device memory. For a step with recurrent
loops every row's peak is Grappler's plus the loop accumulators it cannot size (lms_core.loops):
all of them for `none` and `grappler`, what the plan leaves for `lms-launch` (estimate_rewrite). Every probe traces the step
afresh at its size (launcher.bench.steps) and keeps only small results (peaks, predictions, the plan
as a dict), so no two large graphs are alive at once.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from functools import partial

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
    "floor-rewritten": "floor after rewrites (AddN as chains of adds)",
}
FLOORS = ("floor", "floor-rewritten")  # the rows that are bounds, not configurations


@dataclass
class EstimateSetting:
    """What every estimate-judged probe shares."""

    source: StepSource
    device_memory_bytes: int
    target: Target  # link, device profile and memory for lms-launch's tuner and every predicted time
    lms: LMSConfig  # lms-launch's settings: the recipe's, enabled, mode auto


def unswapped_lists(traced) -> tuple[int, str]:
    """What a step's loop accumulators and zero lists add to Grappler's peak when nothing swaps them
    (Grappler sizes a TensorList as nothing; lms_core.loops sizes them), and the words that say so."""
    from lms_core.loops import unseen_bytes

    lists = unseen_bytes(traced.graph, set())
    if not lists.count:
        return 0, ""
    return lists.baseline_bytes, f"incl. {format_bytes(lists.baseline_bytes)} of loop accumulators"


def probe_none(setting: EstimateSetting, size: int) -> Probe:
    import lms_core.tf as lms_tf

    started = time.perf_counter()
    sized = setting.source.at(size)
    traced = lms_tf.trace_step(sized.step, *sized.specs)
    concrete = traced.concrete
    estimate = lms_tf.estimate_peak(concrete.graph.as_graph_def(), concrete, setting.device_memory_bytes)
    lists, detail = unswapped_lists(traced)
    peak = estimate.device_bytes + lists
    return Probe(size, peak <= setting.device_memory_bytes, peak, time.perf_counter() - started, detail=detail)


def probe_grappler(setting: EstimateSetting, size: int) -> Probe:
    import lms_core.tf as lms_tf
    from lms_core.tf.grappler_swapping import estimate_with_swapping

    started = time.perf_counter()
    sized = setting.source.at(size)
    traced = lms_tf.trace_step(sized.step, *sized.specs)
    concrete = traced.concrete
    estimate, swapping = estimate_with_swapping(concrete.graph.as_graph_def(), concrete, setting.device_memory_bytes)
    # Grappler's swapping cannot see the lists (it sizes them as nothing), so it never swaps them.
    lists, lists_detail = unswapped_lists(traced)
    peak = estimate.device_bytes + lists
    swaps = len(swapping.swaps)
    detail = f"{swaps} swap(s) inserted" + (f"; {lists_detail}" if lists else "")
    return Probe(size, peak <= setting.device_memory_bytes, peak, time.perf_counter() - started,
                 detail=detail, data={"swaps": swaps, "host_bytes": estimate.host_bytes})


def probe_lms(setting: EstimateSetting, size: int, target: Target | None = None) -> Probe:
    """lms-launch at `size`, tuned for `target` (the setting's, unless another link is asked for)."""
    import lms_core.tf as lms_tf

    started = time.perf_counter()
    target = target or setting.target
    sized = setting.source.at(size)
    rewritten, estimate = lms_tf.rewrite_within_estimate(
        sized.step, *sized.specs, config=setting.lms, compute_device=COMPUTE_DEVICE, host_device=HOST_DEVICE,
        target=target)  # its device memory is the setting's (lms.device_memory, set by the bench)
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


def probe_floor(setting: EstimateSetting, size: int, rewritten: bool = False) -> Probe:
    """The floor of the traced step at `size`, or with `rewritten` the floor after the rewrites."""
    started = time.perf_counter()
    floor = setting.source.floors_at(size)[1 if rewritten else 0]
    detail = f"largest op {floor.op_type} {format_bytes(floor.working_set_bytes)}"
    if rewritten:
        detail += f"; {floor.add_chains} AddN(s) as chains"
    return Probe(size, floor.total_bytes <= setting.device_memory_bytes, floor.total_bytes,
                 time.perf_counter() - started, detail=detail, data={"floor": floor.to_dict(), "floor_object": floor})


PROBES = {"none": probe_none, "grappler": probe_grappler, "lms-launch": probe_lms, "floor": probe_floor,
          "floor-rewritten": partial(probe_floor, rewritten=True)}
