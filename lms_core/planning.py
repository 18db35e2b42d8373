"""From an analysed step graph and a rank's hardware to a plan: the framework-neutral half of a rewrite.

    planning = plan_graph(graph, config, compute_device, data_inputs, target)
    planning.plan          # what is swapped (lms_core.plan)
    planning.report        # the plan with its target and the simulator's prediction (lms_core.report)
    planning.simulation    # the simulator's replay of that plan on the target's link and device

`lms_core.tf` traces and applies; this module decides. `lms.mode` is decided here and nowhere else
(`tunes`): `auto` tunes the four TFLMS knobs for the target by simulation, and without a target
(nothing to tune for) the config's own settings are used, as in `manual`. What "fits" means is
lms_core.fit's (`lms.fit_judge`): every candidate plan, of either strategy, is judged by it, and, when
asked (`lms-launch plan`), the chosen plan's report carries the allocator's and a planned pool's
figures (`PlanReport.memory`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lms_core.access_order import (AccessOrderResult, Schedule, find_candidates, held_at_floor, lower_bound_s,
                                   plan_access_order)
from lms_core.add_chains import plan_add_chains, with_add_chains
from lms_core.config import LMSConfig
from lms_core.costs import DeviceProfile, calibrated_costs, step_costs
from lms_core.deferred_zeros import plan_deferred_zeros
from lms_core.driver import PEAK_TIE, Feedback, Proposal, best_of, overshoot_based, plan_until_it_fits, replayed
from lms_core.fit import FitJudge, make_judge
from lms_core.graph import BACKWARD, Graph, split_tensor
from lms_core.link import LinkRates
from lms_core.memory.bfc import MIB
from lms_core.plan import Plan
from lms_core.recompute import FloorCheck, plan_recompute, recompute_relief
from lms_core.planner import plan_swaps
from lms_core.reserved_lists import plan_reserved_lists, with_reserved_lists
from lms_core.report import PlannedFor, PlanReport, Prediction
from lms_core.serialize import order_edges, with_control_edges
from lms_core.simulator import SimulationResult, simulate
from lms_core.tuner import TuningResult, plan_warnings, tune
from lms_core.units import format_bytes

BFC_REPLANS = 2  # access-order plans for live bytes; times it plans again for less when the BFC judge says no


@dataclass
class Target:
    """What one rank plans for: its host-device link, its device's cost profile, and the memory it
    may use on the device and on the host."""

    link: LinkRates
    device: DeviceProfile
    device_memory_bytes: int
    host_memory_bytes: int
    measured_op_seconds: dict[str, float] | None = None  # from the profiler (lms.measure_ops), by op name


@dataclass(frozen=True)
class Planning:
    """A plan and what stands behind it."""

    graph: Graph  # the analysed IR the plan was made on (with the backward order, if one was imposed)
    report: PlanReport  # the plan, and when planned for a target, that target and the prediction
    tuning: TuningResult | None = None  # when the tuner chose the settings
    simulation: SimulationResult | None = None  # the prediction for the plan, when planned for a target
    costs: dict[str, float] | None = None  # seconds per op the simulation used, when planned for a target
    traced: Graph | None = None  # the step's IR as traced, without the order: what runs without LMS
    access_order: AccessOrderResult | None = None  # when the access-order planner made the plan
    unrefined: Planning | None = None  # when the plan was refined on its replay: the planning without that

    @property
    def plan(self) -> Plan:
        return self.report.plan

    @property
    def refined(self) -> bool:
        """Whether the plan was changed on its replay (`lms.refine_on_replay`), by either strategy."""
        return bool((self.access_order is not None and self.access_order.refined)
                    or (self.tuning is not None and self.tuning.copies_moved))


def tunes(config: LMSConfig, target: Target | None) -> bool:
    """Whether the auto-tuner picks the settings: `lms.mode: auto` with a target to tune for."""
    return config.mode == "auto" and target is not None


def plan_graph(graph: Graph, config: LMSConfig, compute_device: str = "", data_inputs: frozenset[str] = frozenset(),
               target: Target | None = None, describe_memory: bool = False) -> Planning:
    """Plans `graph` (analysed: categories, levels, regions) for `target`. `data_inputs` names the
    step's batch placeholders, which are swap candidates like forward activations. With
    `lms.serialize_branches` the backward branches are ordered first (lms_core.serialize) and the
    swaps are planned, and simulated, on the ordered graph, which `Planning.graph` then is. With
    `describe_memory` (planned for a target), the report carries the chosen plan's device memory as
    TensorFlow's allocator and a planned pool would need it: another simulation and a bisection
    (about a second on ResNet-50), which only `lms-launch plan` asks for."""
    traced, edges = graph, []
    # The AddN chains (lms.chain_add_n) come first: swaps are planned on the graph that will run.
    chains = plan_add_chains(graph) if config.chain_add_n else []
    graph = with_add_chains(graph, chains)
    # So do the unset zero lists (lms.reserve_gradient_lists): a recurrent step's peak moves with them.
    reserved = plan_reserved_lists(graph) if config.reserve_gradient_lists else []
    graph = with_reserved_lists(graph, reserved)
    # And the gradient loops' zeros, made just before their loop (lms.defer_gradient_zeros).
    deferred = plan_deferred_zeros(graph, max(1, config.min_tensor_bytes)) if config.defer_gradient_zeros else []
    if deferred:
        graph = with_control_edges(graph, deferred)
    if config.serialize_branches:
        edges = order_edges(graph, max(1, config.min_tensor_bytes))
        graph = with_control_edges(graph, edges)
    if target is None:
        plan = plan_swaps(graph, config, compute_device, data_inputs, control_edges=edges)
        return _with_rewrites(Planning(graph, PlanReport(plan), traced=traced), chains, reserved, deferred)
    return _with_rewrites(_plan_for_target(graph, config, compute_device, data_inputs, target, traced, edges,
                                           describe_memory), chains, reserved, deferred)


def _with_rewrites(planning: Planning, chains: list, reserved: list, deferred: list) -> Planning:
    """`planning` with the AddN chains, unset zero lists and deferred zeros its graph was rewritten
    with recorded in its plan."""
    if not chains and not reserved and not deferred:
        return planning
    plan = dataclasses.replace(planning.plan, add_chains=list(chains), reserved_lists=list(reserved),
                               deferred_zeros=list(deferred))
    unrefined = planning.unrefined and _with_rewrites(planning.unrefined, chains, reserved, deferred)
    return dataclasses.replace(planning, report=dataclasses.replace(planning.report, plan=plan), unrefined=unrefined)


def _plan_for_target(graph: Graph, config: LMSConfig, compute_device: str, data_inputs: frozenset[str],
                     target: Target, traced: Graph, edges: list, describe_memory: bool) -> Planning:
    """The plan of the strategy (or, asked to choose, the better of all) for `target`, replayed: the
    swap strategies planned on the step as it is and, where `lms.actions` allows recompute, on the
    step with the recomputes lms_core.recompute chooses. Where the chosen plan was refined on its
    replay, the planning carries the choice among the plans as they were before
    (`Planning.unrefined`: what `lms.refine_on_replay: false` plans)."""
    costs, cost_model = op_costs(graph, target)
    device_budget = int(target.device_memory_bytes * config.memory_ratio)
    host_budget = int(target.host_memory_bytes * config.host_memory_ratio)
    unlimited = simulate(graph, Plan(settings=config.settings()), costs, target.link, keep_events=True)
    bases = _bases(graph, config, costs, unlimited, target, compute_device, data_inputs, device_budget, host_budget)
    options = [option for base in bases
               for option in _options(base, config, target, compute_device, data_inputs, edges)]

    def planning_of(choices: list[_Option], describe: bool) -> Planning:
        chosen = best_of([replayed(option, option.simulation, option.fits, device_budget) for option in choices],
                         device_budget).proposal.plan
        text = chosen.text
        if len(choices) > 1:
            other = best_of([replayed(o, o.simulation, o.fits, device_budget) for o in choices if o is not chosen],
                            device_budget).proposal.plan
            text = f"{chosen.text}; chosen over {other.label()}: step {other.simulation.step_time_s * 1000:.0f} ms, " \
                   f"peak {format_bytes(other.simulation.peak_device_bytes)}"
        plan = dataclasses.replace(chosen.plan, recomputes=list(chosen.base.recomputes))
        report = PlanReport(plan, PlannedFor(target.link, target.device, cost_model),
                            prediction(chosen.simulation, unlimited, bound_s),
                            tuning=text, warnings=chosen.warnings)
        base = chosen.base
        planning = Planning(base.graph, report, chosen.tuning, chosen.simulation, base.costs, traced,
                            chosen.access_order)
        return _with_memory(planning, base.judge) if describe else planning

    bound_s = step_bound_s(graph, config, costs, unlimited, target.link, device_budget)
    planning = planning_of(options, describe_memory)
    if planning.refined:
        # Described only if used (with_memory): the allocator model replays the plan.
        before = planning_of([option.unrefined() for option in options], describe=False)
        plan = dataclasses.replace(before.plan, settings={**before.plan.settings, "refine_on_replay": False})
        planning = dataclasses.replace(planning, unrefined=dataclasses.replace(
            before, report=dataclasses.replace(before.report, plan=plan)))
    return planning


def step_bound_s(graph: Graph, config: LMSConfig, costs: dict[str, float], unlimited: SimulationResult,
                 link: LinkRates, device_budget: int) -> float:
    """The least step any plan of the allowed actions makes for the budget in the step's order
    (lms_core.access_order.lower_bound_s): over swaps alone, over both actions where recompute is
    allowed too; none (0) with recompute alone, which the link does not bound."""
    if "swap" not in config.actions:
        return 0.0
    schedule = Schedule(graph, unlimited)
    relief = (recompute_relief(graph, schedule.start, schedule.end, costs, config.min_tensor_bytes)
              if "recompute" in config.actions else None)
    return lower_bound_s(schedule, link, device_budget, relief)[0]


@dataclass(frozen=True)
class _Base:
    """The step a set of options is planned on: as traced, or with recomputes applied (their clones
    in the graph and its costs), with the judge of plans on it and its replay without swaps."""

    graph: Graph
    costs: dict[str, float]
    judge: FitJudge
    unswapped: SimulationResult
    link: LinkRates
    recomputes: tuple = ()
    swaps_allowed: bool = True


@dataclass(frozen=True)
class RecomputeAim:
    """What recompute is asked to take off the device in one base, the swaps taking the rest: at each
    moment, the step's excess over the budget, less `excess_left` of the excess at its peak, less
    `link_share` of what the link could carry off by then and back after (lms_core.recompute.plan_recompute)."""

    excess_left: float = 0.0
    link_share: float = 0.0


#: The recompute bases. Swaps the link hides cost nothing, recomputes always cost their time, so some
#: excess is left to the swaps: on ResNet-50 at batch 256, v100 and pcie3 (simulated, 2026-11-27)
#: recompute covering all of it ran +6%, half +1%, a quarter +1%, swapping alone +10%. Where the link
#: cannot carry the excess in time, recompute takes what it cannot, the link trusted for less than
#: its rate (its copies out also wait for their tensors to be made, its copies back for room): at
#: batch 1024 on an h100 and pcie5, 16 GiB, the bases of the excess alone ran +89%, with these +35%
#: (simulated, 2026-11-28, benchmarks/recompute.py). The step is not smooth in the share (there, one
#: base each: 0.4 +36%, 0.5 +35%, 0.55 +46%, 0.6 +49%, 0.8 +50%; `benchmarks/recompute.py
#: --link-shares`), so three are planned and the simulator keeps the fastest.
RECOMPUTE_AIMS = (RecomputeAim(0.0), RecomputeAim(0.5), RecomputeAim(0.75),
                  RecomputeAim(link_share=0.8), RecomputeAim(link_share=0.5), RecomputeAim(link_share=0.4))


def _bases(graph: Graph, config: LMSConfig, costs: dict[str, float], unlimited: SimulationResult, target: Target,
           compute_device: str, data_inputs: frozenset[str], device_budget: int, host_budget: int) -> list[_Base]:
    """The step as traced (where swapping is allowed), and with the recomputes lms_core.recompute
    chooses for each of RECOMPUTE_AIMS (where recompute is allowed; the whole excess only, where
    swapping is not), each also with its clones shared where the step has room (a base of its own:
    sharing can cost the swaps more than it saves). Where swaps take the rest, the recomputes may not
    raise the swaps' floor over the budget or, where the step as traced is over it already, over that
    floor; where that floor is over the device memory itself, there are no recompute bases."""
    def judge_on(step: Graph, step_costs: dict[str, float]) -> FitJudge:
        return make_judge(config, compute_device, step, step_costs, target.link, device_budget, host_budget)

    def floor_of(step: Graph, unswapped: SimulationResult) -> tuple[int, frozenset[str]]:
        return swap_floor(step, unswapped, config, target.link, compute_device, data_inputs)

    swaps = "swap" in config.actions
    bases = [_Base(graph, costs, judge_on(graph, costs), unlimited, target.link)] if swaps else []
    if "recompute" not in config.actions or not tunes(config, target):
        return bases
    traced_floor = floor_of(graph, unlimited)[0] if swaps else 0
    if traced_floor > target.device_memory_bytes * (1 + PEAK_TIE):
        # No plan in the step's order holds less than its floor, and recompute lowers no floor (what
        # it frees, a swap could have off then too): over the device itself, the access-order plans
        # of recompute bases could not run. Only the tuned distance plan, whose ops wait for copies,
        # gets under a floor. (Between the budget and the device they are kept: over the budget, a
        # recompute base's plan can still be the lowest, and fit where a judge allows the whole device.)
        return bases
    floor = FloorCheck(floor_of, max(device_budget, traced_floor)) if swaps else None
    excess, seen = max(0, unlimited.peak_device_bytes - device_budget), set()
    for aim in RECOMPUTE_AIMS if swaps else (RecomputeAim(),):
        chosen = plan_recompute(graph, config.settings(), costs, target.link,
                                device_budget + int(aim.excess_left * excess), config.min_tensor_bytes,
                                floor_check=floor, link_share=aim.link_share)
        # Each set of recomputes as chosen and, where a clone could serve two segments, with it shared:
        # sharing saves the clone's time and holds its result longer, which can cost the swaps more.
        for variant in (chosen, chosen.sharing_clones(graph, costs)) if chosen.shares else (chosen,):
            made = frozenset((entry.tensor, *entry.shared) for entry in variant.recomputes)
            if made in seen or (swaps and not made):
                continue
            seen.add(made)
            replay = simulate(variant.graph, Plan(settings=config.settings()), variant.costs, target.link,
                              keep_events=True)
            bases.append(_Base(variant.graph, variant.costs, judge_on(variant.graph, variant.costs), replay,
                               target.link, tuple(variant.recomputes), swaps))
    return bases


def swap_floor(step: Graph, unswapped: SimulationResult, config: LMSConfig, link: LinkRates, compute_device: str,
               data_inputs: frozenset[str]) -> tuple[int, frozenset[str]]:
    """The swaps' floor of `step` (lms_core.access_order.schedule_floor, from its `unswapped` replay
    with memory events), and what it holds then that a plan could move: tensors that may be swapped,
    and the backward pass's own results (recomputes' clones among them)."""
    schedule = Schedule(step, unswapped)
    candidates, _ = find_candidates(step, config, schedule, link, compute_device, data_inputs)
    floor, resident = held_at_floor(unswapped, schedule, candidates)
    movable = {candidate.tensor for candidate in candidates}
    return floor, frozenset(buffer for buffer in resident
                            if buffer in movable or step[split_tensor(buffer)[0]].category == BACKWARD)


def _options(base: _Base, config: LMSConfig, target: Target, compute_device: str, data_inputs: frozenset[str],
             edges: list) -> list["_Option"]:
    """The options planned on `base`: each swap strategy `lms.strategy` asks for, or with swapping not
    allowed, the recomputes alone."""
    graph, costs, judge, link = base.graph, base.costs, base.judge, base.link
    if not base.swaps_allowed:
        plan = Plan(settings=config.settings(), control_edges=list(edges), ops=len(graph))
        return [_judged_option(plan, base.unswapped, _recompute_text(base), judge, base.unswapped, link, base=base)]
    options = []
    wanted = strategies(config)
    if base.recomputes and "access-order" in wanted:
        wanted = {"access-order"}  # the tuner's search per base costs seconds; access-order plans a base in one
    if wanted & {"distance"}:
        if tunes(config, target):
            tuning = tune(graph, costs, link, judge.device_budget_bytes, judge.host_budget_bytes, config,
                          compute_device, data_inputs, control_edges=edges, judge=judge)
            options.append(_tuned_option(tuning, base))
        else:
            plan = plan_swaps(graph, config, compute_device, data_inputs, control_edges=edges)
            options.append(_judged_option(plan, simulate(graph, plan, costs, link), None, judge, base.unswapped, link,
                                          base=base))
    if wanted & {"access-order"}:
        options.append(_access_order_option(base, config, compute_device, data_inputs, edges))
    return options


def _recompute_text(base: _Base) -> str:
    """What the recomputes of `base` are, for the plan's tuning line."""
    seconds = sum(entry.seconds for entry in base.recomputes)
    cloned = sum(len(entry.made()) for entry in base.recomputes)  # each clone once, by the segment making it
    return (f"recompute: {len(base.recomputes)} tensor(s) of "
            f"{format_bytes(sum(entry.nbytes for entry in base.recomputes))} made again in the backward pass "
            f"({cloned} op(s) cloned, {seconds * 1000:.0f} ms by the cost model)")


def with_memory(planning: Planning, config: LMSConfig, compute_device: str, target: Target) -> Planning:
    """`planning` (for `target`) with its device memory as TensorFlow's allocator and a planned pool
    would need it in its report: what `plan_graph`'s `describe_memory` adds."""
    judge = make_judge(config, compute_device, planning.graph, planning.costs, target.link,
                       int(target.device_memory_bytes * config.memory_ratio),
                       int(target.host_memory_bytes * config.host_memory_ratio))
    return _with_memory(planning, judge)


def _with_memory(planning: Planning, judge: FitJudge) -> Planning:
    memory = judge.memory(planning.plan)
    warnings = planning.report.warnings
    if memory.judge == "live" and not memory.bfc_fits:
        warnings += (allocator_warning(memory),)
    return dataclasses.replace(planning, report=dataclasses.replace(planning.report, warnings=warnings,
                                                                    memory=memory))


def allocator_warning(memory) -> str:
    """For a plan judged by its live peak that the allocator model says TensorFlow's GPU allocator
    cannot hold: on an H100 (2026-11-27) such a plan of the U-Net at 256^3 ran out of memory."""
    return (f"by the allocator model TensorFlow's GPU allocator needs {format_bytes(memory.bfc_bytes)} for this plan "
            f"(budget {format_bytes(memory.budget_bytes)}), which lms.fit_judge live does not check; on a GPU, "
            f"--set lms.fit_judge=bfc plans for the allocator")


def _judged_option(plan: Plan, simulation: SimulationResult, text: str | None, judge: FitJudge,
                   unlimited: SimulationResult, link: LinkRates, **made_by) -> "_Option":
    """A plan, its replay and the judge's verdict, with the warnings that verdict calls for."""
    fits = judge.fits(plan, simulation)
    needed = None if fits else judge.device_needed(plan, simulation)
    warnings = plan_warnings(plan, simulation, unlimited, link, judge.device_budget_bytes, judge.host_budget_bytes,
                             fits, needed)
    return _Option(plan, simulation, text, tuple(warnings), fits, **made_by)


def _tuned_option(tuning: TuningResult, base: "_Base") -> "_Option":
    """The tuner's plan, judged by the tuner."""
    text = tuning.describe() if not base.recomputes else f"{_recompute_text(base)}; then {tuning.describe()}"
    return _Option(tuning.plan, tuning.simulation, text, tuple(tuning.warnings), tuning.fits, base=base,
                   tuning=tuning)


def _ordered_option(ordered: AccessOrderResult, base: "_Base") -> "_Option":
    """An access-order plan, judged."""
    judge, budget = base.judge, ordered.budget_bytes
    text = ordered.describe() + (f"; planned for {format_bytes(budget)} of live bytes so that the BFC "
                                 f"requirement fits" if budget < judge.device_budget_bytes else "")
    if base.recomputes:
        text = f"{_recompute_text(base)}; then {text}"
    return _judged_option(ordered.plan, ordered.simulation, text, judge, base.unswapped, base.link, base=base,
                          access_order=ordered)


def _access_order_option(base: "_Base", config: LMSConfig, compute_device: str, data_inputs: frozenset[str],
                         edges: list) -> "_Option":
    """The access-order plan, judged. The planner meets a budget of live bytes; where the BFC judge
    says the allocator needs more than the budget for its plan (fragmentation), it is planned again
    for a budget lower by that excess (lms_core.driver's loop, the allocator model judging), at most
    BFC_REPLANS times."""
    judge = base.judge

    def propose(budget: int) -> Proposal:
        ordered = plan_access_order(base.graph, config, base.costs, base.link, budget, compute_device, data_inputs,
                                    edges, unswapped=base.unswapped)
        option = _ordered_option(ordered, base)
        return Proposal(option, budget, ordered.simulation.peak_device_bytes, ordered.simulation.step_time_s)

    def allocator(proposal: Proposal) -> Feedback:
        option: _Option = proposal.plan
        sim = option.simulation
        if sim.peak_host_bytes > judge.host_budget_bytes:
            return Feedback(sim.peak_device_bytes, sim.step_time_s, out_of_memory="over the host budget", measured=False)
        if option.fits or judge.kind != "bfc":
            return Feedback(sim.peak_device_bytes, sim.step_time_s, measured=False)
        needed, _ = judge.device_needed(option.plan, sim)
        return Feedback(needed, sim.step_time_s, measured=False, traffic_bytes=sim.traffic_bytes)

    def next_budget(rounds, limit_bytes: int) -> int | None:
        if judge.kind != "bfc" or rounds[-1].feedback.out_of_memory:
            return None  # it misses by live bytes or by the host: no lower device budget helps the allocator
        return overshoot_based(MIB)(rounds, limit_bytes)

    budget = judge.device_budget_bytes
    outcome = plan_until_it_fits(propose, allocator, budget, budget, BFC_REPLANS + 1, next_budget)
    return outcome.rounds[-1].proposal.plan


def strategies(config: LMSConfig) -> set[str]:
    """The planners `lms.strategy` asks for: both for `auto` when tuning, else the one named
    (`auto` in mode manual is the distance planner with the knobs as given)."""
    if config.strategy == "auto":
        return {"distance", "access-order"} if config.mode == "auto" else {"distance"}
    return {config.strategy}


@dataclass(frozen=True)
class _Option:
    """One strategy's plan on one base (the step as traced, or with recomputes), and its replay."""

    plan: Plan
    simulation: SimulationResult
    text: str | None
    warnings: tuple[str, ...]
    fits: bool  # by the judge (lms_core.fit)
    base: _Base
    tuning: TuningResult | None = None
    access_order: AccessOrderResult | None = None

    def label(self) -> str:
        """The strategy, as the plan's tuning line names the options it was chosen over."""
        strategy = self.plan.settings.get("strategy", "distance") if self.base.swaps_allowed else "no swaps"
        return f"{strategy} with recompute" if self.base.recomputes else strategy

    def unrefined(self) -> "_Option":
        """This option as it was before it was refined on its replay (itself if it was not)."""
        if self.tuning is not None and self.tuning.unrefined is not None:
            return _tuned_option(self.tuning.unrefined, self.base)
        if self.access_order is not None and self.access_order.unrefined is not None:
            return _ordered_option(self.access_order.unrefined, self.base)
        return self


def op_costs(graph: Graph, target: Target) -> tuple[dict[str, float], str]:
    """Seconds per op, and where they came from: the profiler's measurements when the target has
    them (the model fills the ops it did not see), else the roofline model of the target's device."""
    if target.measured_op_seconds:
        costs, calibration = calibrated_costs(graph, target.device, target.measured_op_seconds)
        return costs, calibration.describe()
    return step_costs(graph, target.device), f"costs: roofline model of {target.device.name}"


def prediction(simulation: SimulationResult, unlimited: SimulationResult, bound_s: float = 0.0) -> Prediction:
    """The simulator's figures for the plan, the unswapped step time, and the bound."""
    return Prediction(
        peak_device_bytes=simulation.peak_device_bytes, peak_host_bytes=simulation.peak_host_bytes,
        step_time_s=simulation.step_time_s, unlimited_step_time_s=unlimited.step_time_s,
        stall_time_s=simulation.stall_time_s, transfer_time_s=simulation.transfer_time_s,
        hidden_share=simulation.hidden_share, bound_s=bound_s, traffic_bytes=simulation.traffic_bytes)
