"""Simulation-based auto-tuning (Le et al. ISMM 2019), with a clock: the settings that minimise the
predicted step time while the predicted device peak stays within the budget.

The search is a deterministic coordinate descent over TFLMS's four knobs, one at a time, every value
of the knob simulated with the others where the search stands:
1. `swapout_threshold`, powers of two from the step's depth (fewest swaps, least traffic) down; the
   fastest plan that fits is kept (if none fits, the lowest device peak, then the most swapped);
2. `swapin_ahead`: how early copies back start (earlier hides more, holds memory longer);
3. `swapin_groupby`, then 4. `sync_mode`.
Rounds repeat while a round moves some knob (at most MAX_ROUNDS), because the best threshold depends
on the other three: with swap-ins started too late no threshold fits, with them on time one does.
Settings already simulated are not simulated again. ResNet-50 takes 35 (nvlink2) to 68 (pcie3)
simulations, each replaying the whole step with the rank's link and device.

With `lms.refine_on_replay`, the chosen plan's copies back are then triggered earlier where its
replay leaves the host-to-device queue idle and the device room (lms_core.prefetch, as for the
access-order planner): one `swapin_ahead` serves every copy, so on a link the step outruns the queue
idles between copies that start only when their trigger has run. ResNet-50 at batch 1317 on
nvlink2: 16056 -> 14240 ms, the same peak, 365 of 413 copies moved (2026-11-27).

"Fits" is the judge's (lms_core.fit): by default the simulated peak against the budget; with the BFC
judge, each candidate's allocation trace replayed on the model of TensorFlow's GPU allocator.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lms_core.config import LMSConfig
from lms_core.driver import better as better_plan, replayed
from lms_core.fit import FitJudge
from lms_core.graph import Graph
from lms_core.link import GB, LinkRates
from lms_core.plan import ControlEdge, Plan
from lms_core.planner import plan_swaps
from lms_core.prefetch import fill_idle_link
from lms_core.simulator import SimulationResult, simulate
from lms_core.units import format_bytes

KNOBS = ("swapout_threshold", "swapin_ahead", "swapin_groupby", "sync_mode")  # in the order they are tuned
GROUPBYS = (0, 4, 16)
SYNC_MODES = (0, 1, 2, 3)
MAX_ROUNDS = 3  # rounds of the coordinate search; it stops early when a round moves no knob
# Moving the chosen plan's copies: passes end after one that gains less than this share of the step.
# Each pass replays the step several times: ResNet-50 at batch 1024 on nvlink2 took 7.5 s more to
# tune for 40 ms (0.4%) with no such end, 2026-11-27.
REFINE_MIN_GAIN = 0.005


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
    judge: str = "live"  # what "fits" was judged by (lms_core.fit)
    device_needed_bytes: int = 0  # the chosen plan's need by that judge (the BFC requirement, or the peak)
    copies_moved: int = 0  # copies back triggered earlier than `swapin_ahead` put them (lms.refine_on_replay)
    unrefined: TuningResult | None = None  # when copies were moved: the plan as tuned (refine_on_replay off)

    @property
    def overhead(self) -> float:
        """Predicted step time over the unlimited-memory step time, minus one."""
        return self.simulation.step_time_s / self.unlimited.step_time_s - 1 if self.unlimited.step_time_s else 0.0

    def settings_text(self) -> str:
        """The settings chosen and what they swap, without the tuner's own verdict on its budget (for
        reports whose rows another judge decides, such as the bench's)."""
        c = self.config
        moved = f"; {self.copies_moved} copies back moved into the link's idle time" if self.copies_moved else ""
        return (f"auto-tuned: threshold {c.swapout_threshold}, ahead {c.swapin_ahead}, groupby {c.swapin_groupby}, "
                f"sync {c.sync_mode}; {len(self.plan.swaps)} swaps, {format_bytes(self.plan.swapped_bytes)}{moved}")

    def describe(self) -> str:
        sim = self.simulation

        def against(used: int, budget: int) -> str:
            return f"{format_bytes(used)} of {format_bytes(budget)}{'' if used <= budget else ': OVER'}"

        device = against(sim.peak_device_bytes, self.device_budget_bytes)
        if self.judge == "bfc":
            # The requirement is bisected to whole MiB; the judge replays the exact budget, and its
            # verdict, not the rounded figure, says whether the device is over.
            over = "" if self.fits or self.device_needed_bytes <= self.device_budget_bytes else ": OVER"
            device = (f"{format_bytes(sim.peak_device_bytes)} simulated, BFC requirement "
                      f"{format_bytes(self.device_needed_bytes)} (to the MiB) of "
                      f"{format_bytes(self.device_budget_bytes)}{over}")
        return (f"{self.settings_text()}; predicted "
                f"peak: device {device}, host "
                f"{against(sim.peak_host_bytes, self.host_budget_bytes)} budget ({'fits' if self.fits else 'does NOT fit'}), "
                f"step {sim.step_time_s * 1000:.0f} ms vs {self.unlimited.step_time_s * 1000:.0f} ms unlimited "
                f"(+{self.overhead:.0%}), {sim.hidden_share:.0%} of transfer hidden; {self.simulations} simulations")


def thresholds(graph: Graph) -> list[int]:
    """1, 2, 4, ... up to the step's depth in levels, largest first."""
    return _powers_of_two(_depth(graph))[::-1]


def aheads(graph: Graph) -> list[int]:
    """1, 2, 4, ... up to half the step's depth, smallest first. A slow link needs swap-ins started
    far ahead (on PCIe gen3, ResNet-50's swap-ins take longer than its whole backward pass), so the
    range grows with the step rather than stopping at a fixed count of levels."""
    return _powers_of_two(max(1, _depth(graph) // 2))


def _depth(graph: Graph) -> int:
    return max((op.level for op in graph.ops.values()), default=1)


def _powers_of_two(limit: int) -> list[int]:
    values, t = [], 1
    while t <= limit:
        values.append(t)
        t *= 2
    return values


def tune(graph: Graph, costs: dict[str, float], link: LinkRates, device_budget_bytes: int, host_budget_bytes: int,
         base: LMSConfig, compute_device: str = "", data_inputs: frozenset[str] = frozenset(),
         control_edges: list[ControlEdge] = (), judge: FitJudge | None = None) -> TuningResult:
    """`graph` carries categories and levels (and `control_edges`, the order imposed on it, which
    every plan records). `base` supplies what is not tuned (filters, size floor). `judge` decides
    what fits (default: the simulated peaks against the two budgets)."""
    judge = judge or FitJudge.live(device_budget_bytes, host_budget_bytes)
    count = 0

    def run(config: LMSConfig) -> _Candidate:
        nonlocal count
        count += 1
        plan = plan_swaps(graph, config, compute_device, data_inputs, control_edges)
        return _Candidate(config, plan, simulate(graph, plan, costs, link), judge)

    unlimited = simulate(graph, Plan(settings=base.settings()), costs, link)
    if judge.fits(Plan(settings=base.settings()), unlimited):
        none = dataclasses.replace(base, swapout_threshold=max(thresholds(graph)[0] * 2, 1))
        return _result(run(none), unlimited, judge, count, link)

    seen: dict[tuple[int, ...], _Candidate] = {}

    def settings_of(config: LMSConfig) -> tuple[int, ...]:
        return tuple(getattr(config, knob) for knob in KNOBS)

    best = None
    config = dataclasses.replace(base, swapin_ahead=2, swapin_groupby=0, sync_mode=0)
    for _ in range(MAX_ROUNDS):
        settled = settings_of(config)
        for knob, values in zip(KNOBS, (thresholds(graph), aheads(graph), GROUPBYS, SYNC_MODES)):
            for value in values:
                trial = dataclasses.replace(config, **{knob: value})
                key = settings_of(trial)
                if key not in seen:  # a later round re-scans a knob with the others moved, not twice
                    seen[key] = run(trial)
                if _keeps(seen[key], best, device_budget_bytes):
                    best = seen[key]
            config = best.config
        if settings_of(config) == settled:
            break
    tuned = _result(best, unlimited, judge, count, link)
    if not base.refine_on_replay:
        return tuned
    refined, moved = _refined(best, graph, costs, link, judge)
    if not moved:
        return tuned
    return dataclasses.replace(_result(refined, unlimited, judge, count, link, moved), unrefined=tuned)


def _keeps(a: "_Candidate", b: "_Candidate | None", device_budget: int) -> bool:
    """Whether the search keeps `a` over `b`: lms_core.driver.better where either fits. Between two
    that do not fit yet, the search's own order: the lower device peak, then the one swapping more,
    since the knobs tuned next (ahead, groupby, sync) can only lower the peak of tensors that are
    swapped. (Host memory is the plentiful one; it only constrains plans that fit.)"""
    if b is None:
        return True
    if b.fits and a.simulation.step_time_s > b.simulation.step_time_s:
        return False  # slower than a plan that fits: loses whether it fits or not, so it is not judged
    if a.fits or b.fits:
        mine, theirs = replayed(a, a.simulation, a.fits, device_budget), replayed(b, b.simulation, b.fits, device_budget)
        return better_plan(theirs, mine, device_budget) is mine
    return ((a.simulation.peak_device_bytes, -a.plan.swapped_bytes)
            < (b.simulation.peak_device_bytes, -b.plan.swapped_bytes))


def _refined(chosen: "_Candidate", graph: Graph, costs: dict[str, float], link: LinkRates,
             judge: FitJudge) -> tuple["_Candidate", int]:
    """The chosen plan with its copies back moved into the link's idle time (no higher peak, and
    still fitting if it did), and how many were moved."""
    if not chosen.plan.swaps:
        return chosen, 0
    replay = simulate(graph, chosen.plan, costs, link, keep_events=True)
    plan, simulation = fill_idle_link(graph, chosen.plan, replay, costs, link, judge.device_budget_bytes,
                                      REFINE_MIN_GAIN)
    triggers = {s.name: s.trigger for swap in chosen.plan.swaps for s in swap.swap_ins}
    moved = sum(s.trigger != triggers[s.name] for swap in plan.swaps for s in swap.swap_ins)
    refined = _Candidate(chosen.config, plan, simulation, judge)
    if not moved or (chosen.fits and not refined.fits):  # the BFC judge can refuse what the live peak allows
        return chosen, 0
    return refined, moved


class _Candidate:
    """Settings, their plan and its replay; whether it fits is judged when first asked (a BFC
    judgement replays the plan's allocation trace, and the search can often decide without it)."""

    def __init__(self, config: LMSConfig, plan: Plan, simulation: SimulationResult, judge: FitJudge):
        self.config, self.plan, self.simulation, self._judge = config, plan, simulation, judge
        self._fits: bool | None = None

    @property
    def fits(self) -> bool:
        if self._fits is None:
            self._fits = self._judge.fits(self.plan, self.simulation)
        return self._fits


def _result(chosen: _Candidate, unlimited, judge: FitJudge, count, link, moved: int = 0) -> TuningResult:
    plan, sim = chosen.plan, chosen.simulation
    needed = judge.device_needed(plan, sim)
    return TuningResult(config=chosen.config, plan=plan, simulation=sim, unlimited=unlimited,
                        device_budget_bytes=judge.device_budget_bytes, host_budget_bytes=judge.host_budget_bytes,
                        fits=chosen.fits, simulations=count, judge=judge.kind, device_needed_bytes=needed[0],
                        copies_moved=moved,
                        warnings=plan_warnings(plan, sim, unlimited, link, judge.device_budget_bytes,
                                               judge.host_budget_bytes, chosen.fits, needed))


def plan_warnings(plan: Plan, sim: SimulationResult, unlimited: SimulationResult, link: LinkRates, device_budget: int,
                  host_budget: int, fits: bool | None = None, device_needed: tuple[int, str] | None = None
                  ) -> list[str]:
    """What a user should know about a plan made for a budget: that its copies out cannot all be
    hidden behind the forward pass, and that even it does not fit. `fits` is the judge's verdict and
    `device_needed` its figure for the device (lms_core.fit); without them the simulated peaks judge."""
    warnings = []
    # What the link can carry out while the forward pass computes (measured on the unswapped step; a
    # plan that waits for its copies stretches its own forward pass).
    forward = unlimited.forward_time_s
    movable = forward * link.d2h_bytes_per_s
    if plan.swapped_bytes > movable:
        warnings.append(
            f"the plan swaps {plan.swapped_bytes / GB:.1f} GB per step but the {link.name} link moves only "
            f"{movable / GB:.1f} GB during the {forward * 1000:.0f} ms forward pass "
            f"({link.d2h_bytes_per_s / GB:.0f} GB/s): copies will stall the step; use a smaller batch or a faster "
            f"link (nvlink2, c2c)")
    needed, what = device_needed or (sim.peak_device_bytes, "peak")
    if fits is None:
        fits = needed <= device_budget and sim.peak_host_bytes <= host_budget
    if not fits:
        short = "device" if needed > device_budget or sim.peak_host_bytes <= host_budget else "host"
        fix = ("lower train.batch_size, or plan for more host memory (lms.host_memory, lms.host_memory_ratio)"
               if short == "host" else "lower train.batch_size")
        by = "" if what == "peak" else f" by its {what}"
        warnings.append(
            f"even the best plan needs {format_bytes(needed)} of device memory{by} (budget "
            f"{format_bytes(device_budget)}) and {format_bytes(sim.peak_host_bytes)} of host memory (budget "
            f"{format_bytes(host_budget)}): too little {short} memory; {fix}")
    return warnings
