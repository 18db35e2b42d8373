"""A GPU rank's first steps measure its plan, and the rank plans again until the real peak fits.

`lms.calibrate_steps` steps of each plan run on the rank's GPU before training (weights restored
after them); lms_core.driver decides from the measured peak whether the plan fits and, if not, the
budget the next plan is made for: lower by what the models missed (cuDNN's workspaces, the executor
running ahead, the allocator's fragmentation), plus a margin. At most `lms.calibrate_rounds` plans.

Each plan is measured on the rank's step without its gradient allreduce (the same model, loss and
optimizer, traced for one rank, with the same plan applied): a rank that runs out of memory then
cannot leave the others waiting in a collective. With one rank that is the step itself. What the
allreduce adds (Horovod's fusion buffer, 64 MiB by default) is within the margin.

Where no plan fits after the last round and the last one ran out of memory, the rank stops with
TensorFlow's out-of-memory error (the worker turns it into advice); where the last ones ran but
peaked inside the headroom, the lowest of them is kept with a warning.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from lms_core.config import LMSConfig
from lms_core.driver import Feedback, Outcome, Proposal, Round, fit_limit, plan_until_it_fits
from lms_core.planning import Target, tunes
from lms_core.units import format_bytes


@dataclass(frozen=True)
class Calibrated:
    """The plan the rank keeps, with Grappler's estimate of it, and every round that led there."""

    rewritten: object  # lms_core.tf.RewrittenStep
    estimate: object  # lms_core.report.MemoryEstimate
    outcome: Outcome
    warning: str | None = None

    def to_dicts(self) -> list[dict]:
        """The rounds as plan-rank<N>.json keeps them."""
        return [round_dict(r, r is self.outcome.chosen) for r in self.outcome.rounds]


def round_dict(done: Round, kept: bool) -> dict:
    proposal, feedback = done.proposal, done.feedback
    return {"round": done.number, "budget_bytes": proposal.budget_bytes, "predicted_peak_bytes": proposal.predicted_bytes,
            "estimated_peak_bytes": proposal.estimated_bytes, "predicted_step_s": proposal.predicted_step_s,
            "measured_peak_bytes": feedback.peak_bytes, "measured_step_s": feedback.step_s,
            "out_of_memory": feedback.out_of_memory, "steps": feedback.steps, "fits": done.fits,
            "next_budget_bytes": done.next_budget_bytes, "kept": kept}


def proposal_of(rewritten, estimate, budget_bytes: int) -> Proposal:
    """A planned step as lms_core.driver's loop sees it: the simulator's peak and step time."""
    prediction = rewritten.report.prediction
    predicted = prediction.peak_device_bytes if prediction is not None else estimate.lms_bytes
    return Proposal((rewritten, estimate), budget_bytes, predicted,
                    prediction.step_time_s if prediction else None,
                    prediction.unlimited_step_time_s if prediction else None, estimate.lms_bytes)


def calibrate(first, rewrite: Callable, lms: LMSConfig, target: Target, device: str, device_bytes: int,
              run_plan: Callable[[object], Callable[[], object]], variables: list,
              log: Callable[[str], None]) -> Calibrated:
    """Measures `first` (a (rewritten step, estimate) pair planned for `target` at `lms.memory_ratio`)
    and plans again with `rewrite(target=..., config=...)` while lms_core.driver says so.
    `run_plan(rewritten)` gives the function one measured step calls (lms_core.tf.calibrate).
    `device_bytes` is what the rank's allocator may hold. Raises TensorFlow's ResourceExhaustedError
    when every round ran out of memory."""
    from lms_core.tf.calibrate import measure_step

    planned_for = target.device_memory_bytes
    first_budget = int(planned_for * lms.memory_ratio)

    def propose(budget: int) -> Proposal:
        if budget == first_budget:
            return proposal_of(*first, budget)
        ratio = min(1.0, budget / planned_for)
        return proposal_of(*rewrite(target=target, config=dataclasses.replace(lms, memory_ratio=ratio)), budget)

    def measure(proposal: Proposal) -> Feedback:
        rewritten, _ = proposal.plan
        return measure_step(run_plan(rewritten), device, lms.calibrate_steps, variables, device_bytes)

    rounds = lms.calibrate_rounds if tunes(lms, target) else 1  # a manual plan has no budget to move
    outcome = plan_until_it_fits(propose, measure, first_budget, device_bytes, rounds, log)
    return kept(outcome, device_bytes, rounds)


def kept(outcome: Outcome, device_bytes: int, rounds: int) -> Calibrated:
    """The round to train with: the chosen one; else the lowest that ran, with a warning; else the
    out-of-memory error of the last round, raised."""
    chosen = outcome.chosen
    if chosen is not None:
        return Calibrated(*chosen.proposal.plan, outcome)
    ran = [r for r in outcome.rounds if not r.feedback.out_of_memory]
    if ran:
        lowest = min(ran, key=lambda r: r.feedback.peak_bytes)
        warning = (f"no plan kept its measured peak under {format_bytes(fit_limit(device_bytes))} (the device's "
                   f"{format_bytes(device_bytes)} less the headroom) in {len(outcome.rounds)} round(s); training "
                   f"with the lowest, {format_bytes(lowest.feedback.peak_bytes)}: it may run out of memory. "
                   f"Lower train.batch_size, or raise lms.calibrate_rounds")
        return Calibrated(*lowest.proposal.plan, outcome, warning)
    import tensorflow as tf

    last = outcome.rounds[-1].feedback
    raise tf.errors.ResourceExhaustedError(None, None, (
        f"{last.out_of_memory} (LMS calibration: every one of {len(outcome.rounds)} plan(s) ran out of memory, "
        f"the last planned for {format_bytes(outcome.rounds[-1].proposal.budget_bytes)}; "
        f"lms.calibrate_rounds={rounds})"))
