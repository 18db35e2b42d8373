"""The planning loop: a plan for a budget, judged by what the device says, planned again until it fits.

    outcome = plan_until_it_fits(propose, measure, budget_bytes=..., device_bytes=..., rounds=4, log=print)
    outcome.chosen         # the round whose plan is kept (None: no plan ran within the device)
    outcome.rounds         # every round: budget, the planner's figures, the device's, the next budget

A strategy proposes a plan for a device budget (`propose(budget) -> Proposal`); a feedback source
runs it and says what it really needed (`measure(proposal) -> Feedback`: the rank's own first steps
on its GPU). Every model the planner judges by misses something the device holds: cuDNN's
workspaces, the executor running ahead of the GPU, the allocator's rounding and fragmentation (on an
H100, 2026-11-27, a plan the simulator put at 3.36 GiB peaked at 4.29). That miss, measured minus
predicted, is what the next budget is lowered by, plus a margin. The other way too: where a plan
stalls on the link and the device had room to spare, the next budget is raised by what is left.

The three decisions are made here and nowhere else:
- what fits the device (`fits`): it ran, and its peak left `FIT_HEADROOM` of the device free (the
  executor's order, and so the peak, varies from step to step: 3.75 and 4.29 GiB in consecutive
  steps of one plan on that H100);
- the next budget (`next_budget`);
- which of the plans that fit is kept (`better`): the faster measured step, then the lower peak.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from lms_core.units import format_bytes

#: The share of the device a measured peak must leave free to count as fitting.
FIT_HEADROOM = 0.05
#: What each re-plan keeps below the figure it aims for, as a share of the device.
MARGIN = 0.02
#: A plan whose predicted step is this much over the unswapped one stalls enough to try a larger budget.
STALL_SHARE = 0.05
#: The smallest budget worth planning for, as a share of the device: below it nothing is left to swap into.
MIN_BUDGET_SHARE = 0.05

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
    """What the device said of one plan: its measured peak and step, or that it ran out of memory.
    After an out-of-memory error `peak_bytes` is a lower bound (the allocator's peak when it gave
    up, plus the allocation it refused)."""

    peak_bytes: int
    step_s: float | None = None
    out_of_memory: str | None = None  # the allocator's message
    steps: int = 0  # steps measured
    source: str = "device"

    def describe(self) -> str:
        if self.out_of_memory:
            return f"out of memory (needed more than {format_bytes(self.peak_bytes)})"
        step = f", step {self.step_s * 1000:.0f} ms" if self.step_s is not None else ""
        return f"measured peak {format_bytes(self.peak_bytes)}{step}"


@dataclass(frozen=True)
class Round(Generic[PlanT]):
    """One plan, what the device said of it, and the budget planned for next (None: the loop ends)."""

    number: int
    proposal: Proposal[PlanT]
    feedback: Feedback
    fits: bool
    next_budget_bytes: int | None

    @property
    def unmodeled_bytes(self) -> int:
        """What the device held that the planner's peak did not count (negative: it counted too much)."""
        return self.feedback.peak_bytes - self.proposal.predicted_bytes

    def describe(self) -> str:
        proposal, feedback = self.proposal, self.feedback
        predicted = f"predicted peak {format_bytes(proposal.predicted_bytes)}"
        if proposal.estimated_bytes is not None:
            predicted += f" (Grappler {format_bytes(proposal.estimated_bytes)})"
        if proposal.predicted_step_s is not None:
            predicted += f", step {proposal.predicted_step_s * 1000:.0f} ms"
        if feedback.out_of_memory:
            verdict = feedback.describe()
        else:
            share = self.unmodeled_bytes / max(1, proposal.predicted_bytes)
            verdict = f"{feedback.describe()} ({share:+.0%} on the predicted peak)"
        ending = (f"next budget {format_bytes(self.next_budget_bytes)}" if self.next_budget_bytes is not None
                  else ("fits" if self.fits else "does not fit"))
        return (f"calibration round {self.number}: budget {format_bytes(proposal.budget_bytes)}, {predicted}; "
                f"{verdict}; {ending}")


@dataclass(frozen=True)
class Outcome(Generic[PlanT]):
    rounds: tuple[Round[PlanT], ...]
    device_bytes: int

    @property
    def chosen(self) -> Round[PlanT] | None:
        """The kept round: the better of those that fit (`better`), or None when none did."""
        fitting = [r for r in self.rounds if r.fits]
        if not fitting:
            return None
        best = fitting[0]
        for candidate in fitting[1:]:
            best = better(best, candidate)
        return best


def fit_limit(device_bytes: int) -> int:
    """The highest measured peak that fits a device of this size."""
    return int(device_bytes * (1 - FIT_HEADROOM))


def margin_bytes(device_bytes: int) -> int:
    return int(device_bytes * MARGIN)


def fits(feedback: Feedback, device_bytes: int) -> bool:
    """The plan ran and its peak left the headroom free."""
    return not feedback.out_of_memory and feedback.peak_bytes <= fit_limit(device_bytes)


def better(a: Round, b: Round) -> Round:
    """Of two rounds that fit, the faster measured step; where neither was timed, or within 1% of each
    other, the lower peak."""
    a_step, b_step = a.feedback.step_s, b.feedback.step_s
    if a_step and b_step and abs(a_step - b_step) > 0.01 * min(a_step, b_step):
        return a if a_step < b_step else b
    return a if a.feedback.peak_bytes <= b.feedback.peak_bytes else b


def next_budget(proposal: Proposal, feedback: Feedback, device_bytes: int, ceiling_bytes: int) -> int | None:
    """The budget the next round plans for, or None where there is nothing better to try.

    The planner's miss (`feedback.peak_bytes - proposal.predicted_bytes`) is taken to be the same for
    the next plan, so the budget that would put that plan's real peak `margin_bytes` under the fit
    limit is the limit less the miss and the margin. A plan that did not fit is planned again for at
    most its own budget less the margin (each round asks for strictly less). A plan that fitted is
    planned again for more only where it stalls on the link and the device had room, and never up to
    `ceiling_bytes`, the lowest budget that did not fit."""
    margin = margin_bytes(device_bytes)
    aimed = fit_limit(device_bytes) - (feedback.peak_bytes - proposal.predicted_bytes) - margin
    if not fits(feedback, device_bytes):
        budget = min(aimed, proposal.budget_bytes - margin)
        return budget if budget >= device_bytes * MIN_BUDGET_SHARE else None
    budget = min(aimed, ceiling_bytes - margin, device_bytes)
    if proposal.stalls and budget >= proposal.budget_bytes + margin:
        return budget
    return None


def plan_until_it_fits(propose: Callable[[int], Proposal[PlanT]], measure: Callable[[Proposal[PlanT]], Feedback],
                       budget_bytes: int, device_bytes: int, rounds: int,
                       log: Callable[[str], None] | None = None) -> Outcome[PlanT]:
    """Plans for `budget_bytes`, measures, and plans again for `next_budget` until a plan fits and
    nothing better is left to try, or `rounds` rounds have run. Each round is one log line."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    done: list[Round[PlanT]] = []
    ceiling = device_bytes + margin_bytes(device_bytes)  # no budget has failed yet
    budget: int | None = budget_bytes
    while budget is not None and len(done) < rounds:
        proposal = propose(budget)
        feedback = measure(proposal)
        fitted = fits(feedback, device_bytes)
        if not fitted:
            ceiling = min(ceiling, proposal.budget_bytes)
        budget = next_budget(proposal, feedback, device_bytes, ceiling)
        if budget is not None and len(done) + 1 == rounds:
            budget = None  # the last round: say where it ends, not a budget nobody plans for
        done.append(Round(len(done) + 1, proposal, feedback, fitted, budget))
        if log:
            log(done[-1].describe())
    return Outcome(tuple(done), device_bytes)
