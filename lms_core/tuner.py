"""Simulation-based auto-tuning (Le et al. ISMM 2019), with a clock: the settings that minimise the
predicted step time while the predicted device peak stays within the budget.

The search is a deterministic coordinate descent over TFLMS's four knobs:
1. `swapout_threshold`, from the largest (fewest swaps, least traffic) down; every threshold is
   simulated and the fastest that fits is kept (if none fits, the lowest peak);
2. `swapin_ahead`: how early copies back start (earlier hides more, holds memory longer);
3. `swapin_groupby`, then 4. `sync_mode`, each kept only if it is faster and still fits.
About 25 simulations; each replays the whole step with the rank's link and device.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lms_core.config import LMSConfig
from lms_core.graph import Graph
from lms_core.link import GB, LinkRates
from lms_core.plan import Plan
from lms_core.planner import plan_swaps
from lms_core.simulator import SimulationResult, simulate
from lms_core.units import format_bytes

AHEADS = (1, 2, 4, 8, 16, 32)
GROUPBYS = (0, 4, 16)
SYNC_MODES = (0, 1, 2, 3)


@dataclass
class TuningResult:
    config: LMSConfig  # the chosen settings
    plan: Plan
    simulation: SimulationResult
    unlimited: SimulationResult  # no swaps, as if memory were unlimited: the time to compare with
    device_budget_bytes: int
    host_budget_bytes: int
    fits: bool
    simulations: int
    warnings: list[str] = field(default_factory=list)

    @property
    def overhead(self) -> float:
        """Predicted step time over the unlimited-memory step time, minus one."""
        return self.simulation.step_time_s / self.unlimited.step_time_s - 1 if self.unlimited.step_time_s else 0.0

    def describe(self) -> str:
        c, sim = self.config, self.simulation
        verdict = "fits" if self.fits else "does NOT fit"
        return (f"auto-tuned: threshold {c.swapout_threshold}, ahead {c.swapin_ahead}, groupby {c.swapin_groupby}, "
                f"sync {c.sync_mode}; {len(self.plan.swaps)} swaps, {format_bytes(self.plan.swapped_bytes)}; predicted "
                f"peak {format_bytes(sim.peak_device_bytes)} ({verdict} in {format_bytes(self.device_budget_bytes)}), "
                f"step {sim.step_time_s * 1000:.0f} ms vs {self.unlimited.step_time_s * 1000:.0f} ms unlimited "
                f"(+{self.overhead:.0%}), {sim.hidden_share:.0%} of transfer hidden; {self.simulations} simulations")


def thresholds(graph: Graph) -> list[int]:
    """1, 2, 4, ... up to the step's depth in levels, largest first."""
    depth = max((op.level for op in graph.ops.values()), default=1)
    values, t = [], 1
    while t <= depth:
        values.append(t)
        t *= 2
    return values[::-1]


def tune(graph: Graph, costs: dict[str, float], link: LinkRates, device_budget_bytes: int, host_budget_bytes: int,
         base: LMSConfig, compute_device: str = "", data_inputs: frozenset[str] = frozenset()) -> TuningResult:
    """`graph` carries categories and levels. `base` supplies what is not tuned (filters, size floor)."""
    count = 0

    def run(config: LMSConfig) -> tuple[LMSConfig, Plan, SimulationResult]:
        nonlocal count
        count += 1
        plan = plan_swaps(graph, config, compute_device, data_inputs)
        return config, plan, simulate(graph, plan, costs, link)

    def fits(result: SimulationResult) -> bool:
        return result.peak_device_bytes <= device_budget_bytes and result.peak_host_bytes <= host_budget_bytes

    def better(a, b) -> bool:
        """Fitting beats not fitting. Among fitting plans the faster step wins, then the lower peak.
        Among plans that do not fit yet the lower peak wins, then the one swapping more: the knobs
        tuned next (ahead, groupby, sync) can only lower the peak of tensors that are swapped."""
        if b is None:
            return True

        def key(candidate):
            _, plan, result = candidate
            if fits(result):
                return (0, result.step_time_s, result.peak_device_bytes)
            return (1, result.peak_device_bytes, -plan.swapped_bytes)

        return key(a) < key(b)

    unlimited = simulate(graph, Plan(settings=dataclasses.asdict(base)), costs, link)
    if fits(unlimited):
        none = dataclasses.replace(base, swapout_threshold=max(thresholds(graph)[0] * 2, 1))
        chosen = run(none)
        return _result(chosen, unlimited, device_budget_bytes, host_budget_bytes, fits(chosen[2]), count, link)

    best = None
    start = dataclasses.replace(base, swapin_ahead=2, swapin_groupby=0, sync_mode=0)
    for threshold in thresholds(graph):
        candidate = run(dataclasses.replace(start, swapout_threshold=threshold))
        if better(candidate, best):
            best = candidate
    for knob, values in (("swapin_ahead", AHEADS), ("swapin_groupby", GROUPBYS), ("sync_mode", SYNC_MODES)):
        for value in values:
            if getattr(best[0], knob) == value:
                continue
            candidate = run(dataclasses.replace(best[0], **{knob: value}))
            if better(candidate, best):
                best = candidate
    return _result(best, unlimited, device_budget_bytes, host_budget_bytes, fits(best[2]), count, link)


def _result(chosen, unlimited, device_budget, host_budget, fit, count, link) -> TuningResult:
    config, plan, sim = chosen
    warnings = []
    # The physical bound: what the link can carry out while the forward pass computes (measured on
    # the unswapped step; a synchronous plan stretches its own forward pass by waiting).
    forward = unlimited.forward_time_s
    movable = forward * link.d2h_bytes_per_s
    if plan.swapped_bytes > movable:
        warnings.append(
            f"the plan swaps {plan.swapped_bytes / GB:.1f} GB per step but the {link.name} link moves only "
            f"{movable / GB:.1f} GB during the {forward * 1000:.0f} ms forward pass "
            f"({link.d2h_bytes_per_s / GB:.0f} GB/s): copies will stall the step; use a smaller batch or a faster "
            f"link (nvlink2, c2c)")
    if not fit:
        warnings.append(
            f"even the best plan needs {format_bytes(sim.peak_device_bytes)} of device memory (budget "
            f"{format_bytes(device_budget)}) and {format_bytes(sim.peak_host_bytes)} of host memory (budget "
            f"{format_bytes(host_budget)}): lower train.batch_size")
    return TuningResult(config=config, plan=plan, simulation=sim, unlimited=unlimited, device_budget_bytes=device_budget,
                        host_budget_bytes=host_budget, fits=fit, simulations=count, warnings=warnings)
