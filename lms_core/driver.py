"""The planning loop: a plan for a budget, judged, planned again for another budget until it fits.

    outcome = plan_until_it_fits(propose, judge, budget_bytes=..., limit_bytes=..., rounds=4,
                                 next_budget=miss_based(device_bytes), log=print)
    outcome.chosen         # the better of the rounds that fit (None: none did)
    outcome.best           # the better of all rounds (fitting or not)
    outcome.rounds         # every round: the budget, the planner's figures, the judge's, the next budget

A strategy proposes a plan for a device budget (`propose(budget) -> Proposal`, with the planner's own
figures for it); a judge says what the plan really needs (`judge(proposal) -> Feedback`); a policy
turns what was said into the next budget, or ends the loop. Every re-plan of lms-launch is this loop
with one of four judges (docs/lms.md, "One planning loop"):

- the simulator's replay of an access-order plan, against the budget: copies back held past the
  replay's peak or tensors forced at the same budget, else the target lowered by the overshoot
  (lms_core.access_order);
- the allocator model (BFC), against the budget: lowered by the overshoot (`overshoot_based`;
  lms_core.planning);
- Grappler's estimate, against the device memory: lowered by the overshoot (`overshoot_based`;
  lms_core.tf.rewrite_within_estimate);
- the GPU, the rank's first steps, against the device less `FIT_HEADROOM`: lowered by what the
  models missed, or raised where the plan stalls (`miss_based`; launcher.lms.calibrate).

The models of the first three count what the planner counts, so their overshoot is what the next
plan must shed. The GPU holds what no model counts: cuDNN's workspaces, the executor running ahead of
the GPU, the allocator's rounding and fragmentation (on an H100, 2026-11-27, a plan the simulator put
at 3.36 GiB peaked at 4.29; on an H200 the same day cuDNN could not get a 604 MiB workspace beside a
plan of 14.39 GiB in 16). That miss, measured minus predicted, is what the next budget is lowered by.

Two decisions are made here and nowhere else:
- what fits (`fits`): the plan ran (no out-of-memory error) and its peak is within the judge's limit;
- which of two plans is better (`better`): one that fits beats one that does not; of two that fit
  the faster, then the lower peak; of two that do not, the lower peak, then the faster.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

from lms_core.units import format_bytes

#: The share of the device a measured peak must leave free to count as fitting: the executor's order,
#: and so the peak, varies from step to step (3.75 and 4.29 GiB in consecutive steps of one plan on an H100).
FIT_HEADROOM = 0.05
#: What each re-plan after a measurement keeps below the figure it aims for, as a share of the device.
MARGIN = 0.02
#: A plan whose predicted step is this much over the unswapped one stalls enough to try a larger budget.
STALL_SHARE = 0.05
#: The smallest budget worth planning for, as a share of the device: below it nothing is left to swap into.
MIN_BUDGET_SHARE = 0.05
#: Two peaks over the limit within this share of it count alike (the same moment can differ by a few
#: small tensors), and the faster plan is the better.
PEAK_TIE = 0.01
#: Two measured step times within this share of each other count alike (run-to-run noise).
MEASURED_TIE = 0.01

PlanT = TypeVar("PlanT")


@dataclass(frozen=True)
class Proposal(Generic[PlanT]):
    """A strategy's plan for one budget, with the planner's own figures for it."""

    plan: PlanT
    budget_bytes: int
    predicted_bytes: int  # the planner's peak for the plan (the simulator's)
    predicted_step_s: float | None = None
    unswapped_step_s: float | None = None  # the same step without swaps, by the same model
    estimated_bytes: int | None = None  # a second model's peak (Grappler's estimate), for the log only

    @property
    def stalls(self) -> bool:
        """The planner expects the link to slow the step down (a larger budget would swap less)."""
        if not self.predicted_step_s or not self.unswapped_step_s:
            return False
        return self.predicted_step_s > self.unswapped_step_s * (1 + STALL_SHARE)


@dataclass(frozen=True)
class Feedback:
    """What a judge said of one plan: its peak and step time, or that it ran out of memory. After an
    out-of-memory error `peak_bytes` is a lower bound (the allocator's peak when it gave up plus the
    allocation it refused, at least the device memory)."""

    peak_bytes: int
    step_s: float | None = None
    out_of_memory: str | None = None  # the allocator's message
    steps: int = 0  # steps measured (0 for a model)
    measured: bool = True  # on a device (its times are noisy), or by a model (exact and repeatable)
    traffic_bytes: int = 0  # moved over the link per step, where the judge knows it

    def describe(self) -> str:
        if self.out_of_memory:
            return f"out of memory (needed more than {format_bytes(self.peak_bytes)})"
        step = f", step {self.step_s * 1000:.0f} ms" if self.step_s is not None else ""
        return f"{'measured' if self.measured else 'judged'} peak {format_bytes(self.peak_bytes)}{step}"


@dataclass(frozen=True)
class Round(Generic[PlanT]):
    """One plan, what the judge said of it, and the budget planned for next (None: the loop ends)."""

    number: int
    proposal: Proposal[PlanT]
    feedback: Feedback
    fits: bool
    next_budget_bytes: int | None

    @property
    def unmodeled_bytes(self) -> int:
        """What the judge counted that the planner's peak did not (negative: the planner counted more)."""
        return self.feedback.peak_bytes - self.proposal.predicted_bytes

    def describe(self, label: str = "calibration round") -> str:
        proposal, feedback = self.proposal, self.feedback
        predicted = f"predicted peak {format_bytes(proposal.predicted_bytes)}"
        if proposal.estimated_bytes is not None:
            predicted += f" (Grappler {format_bytes(proposal.estimated_bytes)})"
        if proposal.predicted_step_s is not None:
            predicted += f", step {proposal.predicted_step_s * 1000:.0f} ms"
        verdict = feedback.describe()
        if not feedback.out_of_memory:
            verdict += f" ({self.unmodeled_bytes / max(1, proposal.predicted_bytes):+.0%} on the predicted peak)"
        ending = (f"next budget {format_bytes(self.next_budget_bytes)}" if self.next_budget_bytes is not None
                  else ("fits" if self.fits else "does not fit"))
        return f"{label} {self.number}: budget {format_bytes(proposal.budget_bytes)}, {predicted}; {verdict}; {ending}"


#: A policy: from the rounds so far (the last is the one just judged) and the judge's limit, the next budget.
Policy = Callable[[Sequence[Round], int], "int | None"]


@dataclass(frozen=True)
class Outcome(Generic[PlanT]):
    rounds: tuple[Round[PlanT], ...]
    limit_bytes: int

    @property
    def chosen(self) -> Round[PlanT] | None:
        """The better of the rounds that fit; None when none did."""
        return best_of([r for r in self.rounds if r.fits], self.limit_bytes)

    @property
    def best(self) -> Round[PlanT]:
        """The better of all rounds: a fitting one if any, else the nearest to fitting."""
        return best_of(self.rounds, self.limit_bytes)


def fits(feedback: Feedback, limit_bytes: int) -> bool:
    """The plan ran and its peak is within the limit."""
    return not feedback.out_of_memory and feedback.peak_bytes <= limit_bytes


def better(a: Round, b: Round, limit_bytes: int) -> Round:
    """Of two judged plans, the better (`a` where they are alike): one that fits beats one that does
    not; of two that fit the faster (measured times within MEASURED_TIE count alike), then the lower
    peak; of two that do not, the lower peak (within PEAK_TIE of the limit alike), then the faster,
    then the one that moves fewer bytes."""
    if a.fits != b.fits:
        return a if a.fits else b
    fa, fb = a.feedback, b.feedback
    if a.fits:
        if _faster(fa, fb) is not None:
            return a if _faster(fa, fb) else b
        return a if fa.peak_bytes <= fb.peak_bytes else b
    if abs(fa.peak_bytes - fb.peak_bytes) > limit_bytes * PEAK_TIE:
        return a if fa.peak_bytes < fb.peak_bytes else b
    if _faster(fa, fb) is not None:
        return a if _faster(fa, fb) else b
    return a if fa.traffic_bytes <= fb.traffic_bytes else b


def _faster(a: Feedback, b: Feedback) -> bool | None:
    """Whether `a`'s step is faster than `b`'s; None where they are alike or one was not timed."""
    if not a.step_s or not b.step_s:
        return None
    tie = MEASURED_TIE if (a.measured or b.measured) else 0.0
    if abs(a.step_s - b.step_s) <= tie * min(a.step_s, b.step_s):
        return None
    return a.step_s < b.step_s


def replayed(plan, simulation, fits_budget: bool, budget_bytes: int) -> Round:
    """A plan judged by its replay on the simulator (a lms_core.simulator.SimulationResult: its peak,
    step time and traffic) as one round, so that `better` compares it with others."""
    feedback = Feedback(simulation.peak_device_bytes, simulation.step_time_s, measured=False,
                        traffic_bytes=simulation.traffic_bytes)
    proposal = Proposal(plan, budget_bytes, simulation.peak_device_bytes, simulation.step_time_s)
    return Round(0, proposal, feedback, fits_budget, None)


def best_of(rounds: Sequence[Round], limit_bytes: int) -> Round | None:
    best = None
    for candidate in rounds:
        best = candidate if best is None else better(best, candidate, limit_bytes)
    return best


def fit_limit(device_bytes: int) -> int:
    """The highest measured peak that fits a device of this size."""
    return int(device_bytes * (1 - FIT_HEADROOM))


def miss_based(device_bytes: int) -> Policy:
    """The policy after a measurement on the device, whose limit is `fit_limit(device_bytes)`.

    The planner's miss (measured minus predicted peak) is taken to be the same for the next plan,
    so the budget that would put that plan's real peak `MARGIN` of the device under the limit is the
    limit less the miss and the margin. A plan that did not fit is planned again for at most its
    own budget less the margin (each such round asks for strictly less). A plan that fitted is
    planned again for more only where it stalls on the link and the device had room, and never up
    to the lowest budget that did not fit."""
    margin = int(device_bytes * MARGIN)

    def next_budget(rounds: Sequence[Round], limit_bytes: int) -> int | None:
        last = rounds[-1]
        aimed = limit_bytes - last.unmodeled_bytes - margin
        if not last.fits:
            budget = min(aimed, last.proposal.budget_bytes - margin)
            return budget if budget >= device_bytes * MIN_BUDGET_SHARE else None
        failed = [r.proposal.budget_bytes for r in rounds if not r.fits]
        budget = min(aimed, min(failed, default=device_bytes + margin) - margin, device_bytes)
        if last.proposal.stalls and budget >= last.proposal.budget_bytes + margin:
            return budget
        return None

    return next_budget


def overshoot_based(min_step_bytes: int = 0) -> Policy:
    """The policy after a model that counts what the planner counts: a plan over the limit is planned
    again for its budget lowered by the overshoot (at least `min_step_bytes`). A plan already over its
    own budget by the planner's figure ends the loop: a smaller budget cannot help it."""
    def next_budget(rounds: Sequence[Round], limit_bytes: int) -> int | None:
        last = rounds[-1]
        proposal = last.proposal
        if last.fits or proposal.predicted_bytes > proposal.budget_bytes:
            return None
        budget = proposal.budget_bytes - max(last.feedback.peak_bytes - limit_bytes, min_step_bytes)
        return budget if budget > 0 else None

    return next_budget


def plan_until_it_fits(propose: Callable[[int], Proposal[PlanT]], judge: Callable[[Proposal[PlanT]], Feedback],
                       budget_bytes: int, limit_bytes: int, rounds: int, next_budget: Policy,
                       log: Callable[[Round[PlanT]], None] | None = None) -> Outcome[PlanT]:
    """Plans for `budget_bytes`, judges, and plans again for what `next_budget` says until it says
    nothing more is worth trying, or `rounds` plans have been judged. `log` sees each round."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    done: list[Round[PlanT]] = []
    budget: int | None = budget_bytes
    while budget is not None and len(done) < rounds:
        proposal = propose(budget)
        feedback = judge(proposal)
        current = Round(len(done) + 1, proposal, feedback, fits(feedback, limit_bytes), None)
        budget = next_budget([*done, current], limit_bytes) if len(done) + 1 < rounds else None
        done.append(Round(current.number, proposal, feedback, current.fits, budget))
        if log:
            log(done[-1])
    return Outcome(tuple(done), limit_bytes)
