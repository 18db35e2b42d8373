"""The TensorFlow adapter of LMS: the only package here that imports TensorFlow.

    rewritten = lms_core.tf.rewrite(step, *input_specs, config=LMSConfig(...),
                                    compute_device="/device:GPU:0", host_device="/device:CPU:0")
    loss = rewritten(images, labels)   # same inputs, outputs and variable updates as step
    rewritten.plan                     # what was swapped, and why other tensors were not
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lms_core.config import LMSConfig, SettingError
from lms_core.costs import DeviceProfile, calibrated_costs, step_costs
from lms_core.graph import Graph
from lms_core.link import LinkRates
from lms_core.passes.pipeline import analyze as run_analyses
from lms_core.plan import Plan
from lms_core.planner import device_kind, plan_swaps
from lms_core.tf.apply import apply_plan
from lms_core.tf.capture import graph_ir, trace
from lms_core.tf.estimate import PeakEstimate, estimate_peak
from lms_core.tf.reimport import RewrittenStep
from lms_core.simulator import SimulationResult, simulate
from lms_core.tuner import TuningResult, tune


@dataclass
class Target:
    """What one rank plans for: its host-device link, its device's cost profile, and the memory it
    may use on the device and on the host."""

    link: LinkRates
    device: DeviceProfile
    device_memory_bytes: int
    host_memory_bytes: int
    measured_op_seconds: dict[str, float] | None = None  # from the profiler (lms.measure_ops), by op name


@dataclass
class PlannedStep:
    concrete: object
    graph: Graph
    plan: Plan
    tuning: TuningResult | None  # when lms.mode is auto
    simulation: SimulationResult | None  # the prediction for the chosen plan, when planned for a target
    costs: dict[str, float] | None = None  # seconds per op the simulation used, when planned for a target


def analyze(graph: Graph) -> Graph:
    """Categories, levels and v1 control-flow regions on every op, in place."""
    return run_analyses(graph)


def check_device(key: str, device: str) -> None:
    if device_kind(device) not in ("GPU", "CPU"):
        raise SettingError(key, f"must name a GPU or CPU device such as /device:GPU:0; got {device!r}")


def plan_for(step, *input_specs, config: LMSConfig, compute_device: str = "/device:GPU:0",
             target: Target | None = None) -> PlannedStep:
    """Traces `step` and plans its swaps: with `lms.mode: auto` the tuner picks the settings for
    `target`; with `manual` the config's settings are used and, given a target, simulated."""
    check_device("compute_device", compute_device)
    concrete = trace(step, *input_specs)
    graph = analyze(graph_ir(concrete.graph))
    captured = {id(internal) for _, internal in concrete.graph.captures}
    batch = frozenset(t.op.name for t in concrete.graph.inputs if id(t) not in captured)
    if config.mode == "auto" and target is None:
        raise SettingError("mode", "auto needs a target (link, device, memory) to tune for; use manual or give one")
    if target is None:
        return PlannedStep(concrete, graph, plan_swaps(graph, config, compute_device, data_inputs=batch), None, None)
    if target.measured_op_seconds:
        costs, calibration = calibrated_costs(graph, target.device, target.measured_op_seconds)
        cost_model = calibration.describe()
    else:
        costs, cost_model = step_costs(graph, target.device), f"costs: roofline model of {target.device.name}"
    tuning = None
    if config.mode == "auto":
        tuning = tune(graph, costs, target.link, int(target.device_memory_bytes * config.memory_ratio),
                      int(target.host_memory_bytes * config.host_memory_ratio), config, compute_device, batch)
        plan, simulation = tuning.plan, tuning.simulation
        plan.tuning, plan.warnings = tuning.describe(), list(tuning.warnings)
        unlimited = tuning.unlimited
    else:
        plan = plan_swaps(graph, config, compute_device, data_inputs=batch)
        simulation = simulate(graph, plan, costs, target.link)
        unlimited = simulate(graph, Plan(settings=plan.settings), costs, target.link)
    plan.link, plan.device_profile, plan.cost_model = target.link.describe(), target.device.describe(), cost_model
    plan.prediction = {
        "peak_device_bytes": simulation.peak_device_bytes, "peak_host_bytes": simulation.peak_host_bytes,
        "step_time_s": simulation.step_time_s, "unlimited_step_time_s": unlimited.step_time_s,
        "stall_time_s": simulation.stall_time_s, "transfer_time_s": simulation.transfer_time_s,
        "hidden_share": simulation.hidden_share,
    }
    return PlannedStep(concrete, graph, plan, tuning, simulation, costs)


def plan_step(step, *input_specs, config: LMSConfig, compute_device: str = "/device:GPU:0"):
    """Traces `step` and plans its swaps with the config's own settings (whatever `lms.mode` says:
    there is no target to tune for): (concrete, IR, plan)."""
    planned = plan_for(step, *input_specs, config=_manual(config), compute_device=compute_device)
    return planned.concrete, planned.graph, planned.plan


def rewrite(step, *input_specs, config: LMSConfig, compute_device: str = "/device:GPU:0",
            host_device: str = "/device:CPU:0", target: Target | None = None) -> RewrittenStep:
    """The step with the plan applied. With nothing to swap, the graph is re-imported unchanged.
    `.planned` keeps the IR, the tuning and the simulation behind the plan. Without a `target`
    there is nothing to tune for, so the config's own settings are used even in auto mode."""
    check_device("host_device", host_device)
    if config.mode == "auto" and target is None:
        config = _manual(config)
    planned = plan_for(step, *input_specs, config=config, compute_device=compute_device, target=target)
    graph_def = apply_plan(planned.concrete.graph.as_graph_def(), planned.plan, compute_device, host_device)
    rewritten = RewrittenStep(planned.concrete, graph_def, planned.plan)
    rewritten.planned = planned
    return rewritten


def _manual(config: LMSConfig) -> LMSConfig:
    return dataclasses.replace(config, mode="manual")


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


__all__ = ["Target", "PlannedStep", "plan_for", "estimate_rewrite", "estimate_peak", "PeakEstimate", "RewrittenStep", "LMSConfig", "Plan", "analyze", "plan_step", "rewrite", "trace", "graph_ir", "apply_plan"]
