"""The TensorFlow adapter of LMS: the only package here that imports TensorFlow.

    rewritten = lms_core.tf.rewrite(step, *input_specs, config=LMSConfig(...),
                                    compute_device="/device:GPU:0", host_device="/device:CPU:0")
    loss = rewritten(images, labels)   # same inputs, outputs and variable updates as step
    rewritten.plan                     # what was swapped, and why other tensors were not
"""
from __future__ import annotations

from lms_core.config import LMSConfig, SettingError
from lms_core.graph import Graph
from lms_core.passes import run_passes
from lms_core.passes.categorize import CATEGORIZE
from lms_core.passes.levels import ASSIGN_LEVELS
from lms_core.plan import Plan
from lms_core.planner import device_kind, plan_swaps
from lms_core.tf.apply import apply_plan
from lms_core.tf.capture import graph_ir, trace
from lms_core.tf.estimate import PeakEstimate, estimate_peak
from lms_core.tf.reimport import RewrittenStep


def analyze(graph: Graph) -> Graph:
    """Categories and levels on every op, in place."""
    run_passes(graph, [CATEGORIZE, ASSIGN_LEVELS])
    return graph


def check_device(key: str, device: str) -> None:
    if device_kind(device) not in ("GPU", "CPU"):
        raise SettingError(key, f"must name a GPU or CPU device such as /device:GPU:0; got {device!r}")


def plan_step(step, *input_specs, config: LMSConfig, compute_device: str = "/device:GPU:0"):
    """Traces `step` and plans its swaps. Returns (concrete function, IR, plan)."""
    check_device("compute_device", compute_device)
    concrete = trace(step, *input_specs)
    graph = analyze(graph_ir(concrete.graph))
    captured = {id(internal) for _, internal in concrete.graph.captures}
    batch = frozenset(t.op.name for t in concrete.graph.inputs if id(t) not in captured)
    return concrete, graph, plan_swaps(graph, config, compute_device, data_inputs=batch)


def rewrite(step, *input_specs, config: LMSConfig, compute_device: str = "/device:GPU:0",
            host_device: str = "/device:CPU:0") -> RewrittenStep:
    """The step with the plan applied. With nothing to swap, the graph is re-imported unchanged."""
    check_device("host_device", host_device)
    concrete, _, plan = plan_step(step, *input_specs, config=config, compute_device=compute_device)
    graph_def = apply_plan(concrete.graph.as_graph_def(), plan, compute_device, host_device)
    return RewrittenStep(concrete, graph_def, plan)


def estimate_rewrite(rewritten: RewrittenStep, device_memory_bytes: int) -> tuple[PeakEstimate, PeakEstimate]:
    """Grappler's peak estimates for the original and the rewritten step on a virtual GPU of this
    size; also written into `rewritten.plan` (`estimated_peak_bytes`, `estimated_host_bytes`)."""
    baseline = estimate_peak(rewritten.concrete.graph.as_graph_def(), rewritten.concrete, device_memory_bytes)
    swap_outs = {swap.swap_out for swap in rewritten.plan.swaps}
    lms = estimate_peak(rewritten.graph_def, rewritten.concrete, device_memory_bytes, host_ops=swap_outs)
    plan = rewritten.plan
    plan.device_memory_bytes = device_memory_bytes
    plan.estimated_peak_bytes = {"baseline": baseline.device_bytes, "lms": lms.device_bytes}
    plan.estimated_host_bytes = lms.host_bytes
    return baseline, lms


__all__ = ["estimate_rewrite", "estimate_peak", "PeakEstimate", "RewrittenStep", "LMSConfig", "Plan", "analyze", "plan_step", "rewrite", "trace", "graph_ir", "apply_plan"]
