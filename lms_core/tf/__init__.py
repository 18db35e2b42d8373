"""The TensorFlow adapter of LMS: the only package here that imports TensorFlow.

    rewritten = lms_core.tf.rewrite(step, *input_specs, config=LMSConfig(...),
                                    compute_device="/device:GPU:0", host_device="/device:CPU:0")
    loss = rewritten(images, labels)   # same inputs, outputs and variable updates as step
    rewritten.plan                     # what was swapped, and why other tensors were not
    rewritten.report                   # the plan with its target and prediction (lms_core.report)
    lms_core.tf.estimate_rewrite(rewritten, 16 << 30)              # Grappler's peaks, without and with
    lms_core.tf.gating.verify_gating(rewritten, images, labels)   # proven on the executed partitions

It traces the step, describes its graph in the framework-neutral IR, hands it to
`lms_core.planning` (which decides what to swap), applies the plan to the GraphDef and re-imports it.
"""
from __future__ import annotations

from dataclasses import dataclass

from lms_core.add_chains import with_add_chains
from lms_core.config import LMSConfig, SettingError
from lms_core.graph import Graph
from lms_core.loops import unseen_bytes
from lms_core.passes.pipeline import analyze as run_analyses
from lms_core.plan import Plan
from lms_core.report import MemoryEstimate, PlanReport
from lms_core.planner import device_kind
from lms_core.planning import Planning, Target, plan_graph
from lms_core.tf.apply import Placement, apply_plan, host_ops
from lms_core.tf.capture import graph_ir, trace
from lms_core.tf.estimate import PeakEstimate, estimate_peak
from lms_core.tf.reimport import RewrittenStep


@dataclass
class TracedStep:
    """A traced step, its analysed IR and the names of its batch inputs."""

    concrete: object  # the tf ConcreteFunction
    graph: Graph
    data_inputs: frozenset[str]


def analyze(graph: Graph) -> Graph:
    """Categories, levels and v1 control-flow regions on every op, in place."""
    return run_analyses(graph)


def check_device(key: str, device: str) -> None:
    if device_kind(device) not in ("GPU", "CPU"):
        raise SettingError(key, f"must name a GPU or CPU device such as /device:GPU:0; got {device!r}")


def trace_step(step, *input_specs) -> TracedStep:
    concrete = trace(step, *input_specs)
    captured = {id(internal) for _, internal in concrete.graph.captures}
    batch = frozenset(t.op.name for t in concrete.graph.inputs if id(t) not in captured)
    return TracedStep(concrete, analyze(graph_ir(concrete.graph)), batch)


def plan_step(step, *input_specs, config: LMSConfig, compute_device: str = "/device:GPU:0") -> tuple:
    """Traces `step` and plans its swaps with the config's own settings: (concrete, IR, plan)."""
    check_device("compute_device", compute_device)
    traced = trace_step(step, *input_specs)
    planning = plan_graph(traced.graph, config, compute_device, traced.data_inputs)
    return traced.concrete, traced.graph, planning.plan


def rewrite(step, *input_specs, config: LMSConfig, compute_device: str = "/device:GPU:0",
            host_device: str = "/device:CPU:0", target: Target | None = None,
            placement: Placement = Placement.GATED_ON_HOST, describe_memory: bool = False) -> RewrittenStep:
    """The step with its plan applied (planned for `target`; see lms_core.planning for how
    `lms.mode` is decided, and what `describe_memory` adds to the report). With nothing to swap,
    the graph is re-imported unchanged. `placement` is for the gating check's negative control only."""
    check_device("compute_device", compute_device)
    check_device("host_device", host_device)
    traced = trace_step(step, *input_specs)
    planning = plan_graph(traced.graph, config, compute_device, traced.data_inputs, target, describe_memory)
    return _applied(traced, planning, compute_device, host_device, placement)


def rewrite_with_plan(step, *input_specs, plan: Plan, compute_device: str, host_device: str) -> RewrittenStep:
    """Traces `step` and applies a plan made elsewhere (for instance on the same model traced at
    another batch size: op names do not depend on shapes). Raises ValueError naming the first op the
    plan refers to that this trace does not have."""
    check_device("compute_device", compute_device)
    check_device("host_device", host_device)
    traced = trace_step(step, *input_specs)
    graph = with_add_chains(traced.graph, [c for c in plan.add_chains if c.op in traced.graph.ops])
    referenced = [chain.op for chain in plan.add_chains] + [name for swap in plan.swaps
                  for name in [swap.tensor.rpartition(":")[0], *swap.waiters,
                               *(n for s in swap.swap_ins for n in (s.trigger, *s.consumers, *s.waiters))]]
    missing = next((name for name in referenced if name not in graph.ops), None)
    if missing is not None:
        raise ValueError(f"the plan refers to op {missing!r}, which this trace of the step does not have")
    return _applied(traced, Planning(graph, PlanReport(plan), traced=traced.graph), compute_device, host_device,
                    Placement.GATED_ON_HOST)


def _applied(traced: TracedStep, planning: Planning, compute_device: str, host_device: str,
             placement: Placement) -> RewrittenStep:
    graph_def = apply_plan(traced.concrete.graph.as_graph_def(), planning.plan, compute_device, host_device, placement)
    return RewrittenStep(traced.concrete, graph_def, planning, compute_device=compute_device, host_device=host_device,
                         host_ops=frozenset(host_ops(planning.plan, placement)))


def estimate_rewrite(rewritten: RewrittenStep, device_memory_bytes: int) -> MemoryEstimate:
    """Grappler's peak estimates for the original and the rewritten step on a virtual GPU of this
    size, with the rewrite's host-side ops on the host."""
    baseline = estimate_peak(rewritten.concrete.graph.as_graph_def(), rewritten.concrete, device_memory_bytes)
    lms = estimate_peak(rewritten.graph_def, rewritten.concrete, device_memory_bytes, host_ops=rewritten.host_ops)
    # Grappler sizes a loop's TensorList accumulators as nothing; the IR knows their size.
    loops = unseen_bytes(rewritten.planning.graph, {swap.tensor for swap in rewritten.plan.swaps})
    return MemoryEstimate(baseline_bytes=baseline.device_bytes + loops.baseline_bytes,
                          lms_bytes=lms.device_bytes + loops.lms_bytes, host_bytes=lms.host_bytes + loops.host_bytes,
                          device_memory_bytes=device_memory_bytes, loop_accumulators=loops if loops.count else None)


__all__ = ["Target", "Planning", "TracedStep", "Placement", "estimate_rewrite", "estimate_peak", "PeakEstimate",
           "RewrittenStep", "LMSConfig", "Plan", "analyze", "plan_step", "rewrite", "rewrite_with_plan", "trace",
           "trace_step", "graph_ir", "apply_plan"]
