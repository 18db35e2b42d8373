"""The TensorFlow adapter of LMS: the only package here that imports TensorFlow.

    rewritten = lms_core.tf.rewrite(step, *input_specs, config=LMSConfig(...),
                                    compute_device="/device:GPU:0", host_device="/device:CPU:0")
    loss = rewritten(images, labels)   # same inputs, outputs and variable updates as step
    rewritten.plan                     # what was swapped, and why other tensors were not
    rewritten.report                   # the plan with its target and prediction (lms_core.report)
    lms_core.tf.estimate_rewrite(rewritten, 16 << 30)              # Grappler's peaks, without and with
    rewritten, estimate = lms_core.tf.rewrite_within_estimate(...)  # both, planned again until both fit
    lms_core.tf.gating.verify_gating(rewritten, images, labels)   # proven on the executed partitions

It traces the step, describes its graph in the framework-neutral IR, hands it to
`lms_core.planning` (which decides what to swap), applies the plan to the GraphDef and re-imports it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lms_core.add_chains import with_add_chains
from lms_core.config import LMSConfig, SettingError
from lms_core.driver import Feedback, Proposal, overshoot_based, plan_until_it_fits
from lms_core.graph import Graph
from lms_core.loops import unseen_bytes
from lms_core.passes.pipeline import analyze as run_analyses
from lms_core.plan import Plan
from lms_core.report import MemoryEstimate, PlanReport
from lms_core.planner import device_kind
from lms_core.planning import Planning, Target, plan_graph, tunes, with_memory
from lms_core.recompute import with_recomputes
from lms_core.reserved_lists import with_reserved_lists
from lms_core.units import format_bytes
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


#: How many times `rewrite_within_estimate` plans again, each for a budget lowered by the last overshoot.
REPLANS = 3


def rewrite_within_estimate(step, *input_specs, config: LMSConfig, compute_device: str, host_device: str,
                            target: Target, describe_memory: bool = False) -> tuple[RewrittenStep, MemoryEstimate]:
    """`rewrite` for `target`, and Grappler's estimate of the result (`estimate_rewrite`), planned again
    where the two models disagree: lms_core.driver's loop with Grappler's estimate as the judge. The
    tuner judges a plan by its simulator against device memory x `lms.memory_ratio`; the estimate,
    which says "fits" in `plan`, the bench and a rank's log, counts otherwise (its copies take no
    time; it adds the loop lists a plan keeps at its own peak). Where the estimate puts the tuner's
    plan over the device memory, the plan is made again for a budget lowered by that overshoot (and
    again, by the next overshoot, up to REPLANS times), and the first that fits is kept. A re-plan
    whose estimate is no lower does not end the search: plans for nearby budgets pick different
    tensors, and the next budget down may fit (the Seq2Seq recipe at batch 6976 without its AddN
    chain: 16.96 GiB, then 17.88, then 15.10, which fits). Before those, a plan refined on its replay
    (`lms.refine_on_replay`: copies moved into the link's idle time, and for access-order swaps
    dropped) that the estimate puts over is tried as it was before that (the planner keeps it: an
    estimate, not a plan), and the re-plans go on without refining. With none that fits, the tuner's
    first plan (the unrefined one, if it was tried) is returned. Without tuning (`lms.mode: manual`)
    this is `rewrite` and `estimate_rewrite`."""
    check_device("compute_device", compute_device)
    check_device("host_device", host_device)
    traced = trace_step(step, *input_specs)
    device_memory = target.device_memory_bytes
    baseline: list[PeakEstimate] = []  # the unswapped step's estimate, made once for every try

    def estimated(planning: Planning) -> tuple[RewrittenStep, MemoryEstimate]:
        rewritten = _applied(traced, planning, compute_device, host_device, Placement.GATED_ON_HOST)
        if not baseline:
            baseline.append(estimate_peak(traced.concrete.graph.as_graph_def(), traced.concrete, device_memory))
        return rewritten, estimate_rewrite(rewritten, device_memory, baseline[0])

    first = estimated(plan_graph(traced.graph, config, compute_device, traced.data_inputs, target, describe_memory))
    if not tunes(config, target):
        return first
    proposals = _EstimateProposals(first, estimated, traced, config, compute_device, target, describe_memory)
    outcome = plan_until_it_fits(proposals.propose, _estimate_judge, int(device_memory * config.memory_ratio),
                                 device_memory, REPLANS + 1 + proposals.unrefined_round, proposals.next_budget)
    kept = outcome.chosen or outcome.rounds[proposals.unrefined_round]
    return _with_replan_notes(kept.proposal.plan, outcome, proposals.unrefined_round)


class _EstimateProposals:
    """The plans `rewrite_within_estimate`'s loop judges: the tuner's first; at the same budget, the
    same plan as it was before it was refined on its replay (where it was, and the estimate put it
    over); then plans for lower budgets, not refined."""

    def __init__(self, first, estimated, traced: TracedStep, config: LMSConfig, compute_device: str, target: Target,
                 describe_memory: bool):
        self.first, self.estimated, self.traced, self.config = first, estimated, traced, config
        self.compute_device, self.target, self.describe_memory = compute_device, target, describe_memory
        self.unrefined = first[0].planning.unrefined if not first[1].lms_fits else None
        self.unrefined_round = int(self.unrefined is not None)  # which round holds the tuner's own plan
        self.calls = 0

    def propose(self, budget: int) -> Proposal:
        self.calls += 1
        if self.calls == 1:
            return _estimate_proposal(self.first, budget)
        config = dataclasses.replace(self.config, refine_on_replay=False) if self.unrefined else self.config
        if self.calls == 2 and self.unrefined is not None:
            # Grappler's copies take no time: it holds a copy moved into the link's idle time from its
            # trigger on, so the plan as the replay left it may fit where the refined one does not.
            unrefined = self.unrefined
            planning = (with_memory(unrefined, config, self.compute_device, self.target) if self.describe_memory
                        else unrefined)
            return _estimate_proposal(self.estimated(planning), budget)
        ratio = budget / self.target.device_memory_bytes
        planning = plan_graph(self.traced.graph, dataclasses.replace(config, memory_ratio=ratio), self.compute_device,
                              self.traced.data_inputs, self.target, self.describe_memory)
        return _estimate_proposal(self.estimated(planning), budget)

    def next_budget(self, rounds, limit_bytes: int) -> int | None:
        if len(rounds) == 1 and self.unrefined is not None:
            return rounds[0].proposal.budget_bytes  # the same budget, the plan as it was before its refinement
        return overshoot_based()(rounds, limit_bytes)


def _estimate_proposal(pair: tuple[RewrittenStep, MemoryEstimate], budget: int) -> Proposal:
    simulation = pair[0].planning.simulation
    predicted = simulation.peak_device_bytes if simulation is not None else pair[1].lms_bytes
    return Proposal(pair, budget, predicted)


def _estimate_judge(proposal: Proposal) -> Feedback:
    _, estimate = proposal.plan
    return Feedback(estimate.lms_bytes, measured=False)


def _with_replan_notes(kept: tuple[RewrittenStep, MemoryEstimate], outcome, unrefined_round: int):
    """`kept` with the loop's rounds said in its report's tuning text."""
    notes = []
    for done in outcome.rounds[:-1]:
        said = f"the estimate put the plan at {format_bytes(done.feedback.peak_bytes)}"
        if unrefined_round and done.number == 1:
            notes.append(f"{said}: tried it without refining it on the replay")
        else:
            notes.append(f"{said}: re-planned for a budget of {format_bytes(done.next_budget_bytes)}")
    if not notes:
        return kept
    rewritten, estimate = kept
    ending = "kept that plan" if outcome.chosen else "none fits both the estimate and the simulated budget: kept the first plan"
    note = f"{'; '.join(notes)}; {ending}"
    report = rewritten.planning.report
    report = dataclasses.replace(report, tuning=f"{report.tuning}; {note}" if report.tuning else note)
    rewritten.planning = dataclasses.replace(rewritten.planning, report=report)
    return rewritten, estimate


def rewrite_with_plan(step, *input_specs, plan: Plan, compute_device: str, host_device: str) -> RewrittenStep:
    """Traces `step` and applies a plan made elsewhere (for instance on the same model traced at
    another batch size: op names do not depend on shapes). Raises ValueError naming the first op the
    plan refers to that this trace does not have."""
    check_device("compute_device", compute_device)
    check_device("host_device", host_device)
    traced = trace_step(step, *input_specs)
    graph = with_add_chains(traced.graph, [c for c in plan.add_chains if c.op in traced.graph.ops])
    graph = with_reserved_lists(graph, plan.reserved_lists)
    recomputed = [name for entry in plan.recomputes for name in (*entry.ops, entry.trigger, *entry.consumers)]
    missing = next((name for name in recomputed if name not in graph.ops), None)
    if missing is not None:
        raise ValueError(f"the plan refers to op {missing!r}, which this trace of the step does not have")
    graph = with_recomputes(graph, plan.recomputes)
    rewritten_ops = [chain.op for chain in plan.add_chains] + [entry.op for entry in plan.reserved_lists]
    ordered_ops = [name for edge in [*plan.control_edges, *plan.deferred_zeros] for name in (edge.before, edge.after)]
    referenced = rewritten_ops + ordered_ops + [name for swap in plan.swaps
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


def estimate_rewrite(rewritten: RewrittenStep, device_memory_bytes: int,
                     baseline: PeakEstimate | None = None) -> MemoryEstimate:
    """Grappler's peak estimates for the original and the rewritten step on a virtual GPU of this
    size, with the rewrite's host-side ops on the host. `baseline`: the original step's estimate,
    where the caller has it (the same for every rewrite of one trace)."""
    if baseline is None:
        baseline = estimate_peak(rewritten.concrete.graph.as_graph_def(), rewritten.concrete, device_memory_bytes)
    lms = estimate_peak(rewritten.graph_def, rewritten.concrete, device_memory_bytes, host_ops=rewritten.host_ops)
    # Grappler sizes a loop's TensorList accumulators as nothing; the IR knows their size.
    loops = unseen_bytes(rewritten.planning.graph, {swap.tensor for swap in rewritten.plan.swaps})
    return MemoryEstimate(baseline_bytes=baseline.device_bytes + loops.baseline_bytes,
                          lms_bytes=lms.device_bytes + loops.lms_bytes, host_bytes=lms.host_bytes + loops.host_bytes,
                          device_memory_bytes=device_memory_bytes, loop_accumulators=loops if loops.count else None)


__all__ = ["Target", "Planning", "TracedStep", "Placement", "estimate_rewrite", "estimate_peak", "PeakEstimate",
           "RewrittenStep", "LMSConfig", "Plan", "analyze", "plan_step", "rewrite", "rewrite_within_estimate",
           "rewrite_with_plan", "trace",
           "trace_step", "graph_ir", "apply_plan"]
