"""A GPU rank's first steps measure its plan, and the rank plans again until the real peak fits.

`lms.calibrate_steps` steps of each plan run on the rank's GPU before training (weights restored
after them); lms_core.driver decides from the measured peak whether the plan fits and, if not, the
budget the next plan is made for: lower by what the models missed (cuDNN's workspaces, the executor
running ahead, the allocator's fragmentation), plus a margin. At most `lms.calibrate_rounds` plans.
With `lms.measure_ops` the first plan's steps are also profiled, and the plans after it are made
with the measured op times: where the first plan fits, it is made once more, at the same budget,
with them (the costs are the loop's other lever).

Each plan is measured on the rank's step without its gradient allreduce (the same model, loss and
optimizer, traced for one rank, with the same plan applied): a rank that runs out of memory then
cannot leave the others waiting in a collective. With one rank that is the step itself. What the
allreduce adds (Horovod's fusion buffer, 64 MiB by default) is within the margin. The ranks decide
each round together (`Agreement`): every rank judges by the worst reading of all (an out-of-memory
error anywhere, else the highest peak) and plans next for the lowest budget any rank asks for, so
they run the same rounds, and ranks on like devices end with the same plan.

Where every plan ran out of memory, the rank stops with TensorFlow's out-of-memory error (the worker
turns it into advice), naming the smallest peak seen and the largest batch that would fit by the
bytes per sample measured; where plans ran but peaked inside the headroom, the lowest is kept with a
warning.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from launcher import env
from lms_core.config import LMSConfig
from lms_core.driver import Feedback, Outcome, Proposal, Round, fit_limit, fits, miss_based, plan_until_it_fits
from lms_core.planning import Target, tunes
from lms_core.units import format_bytes

if TYPE_CHECKING:
    from launcher.lms.calibration_cache import CacheKey


@dataclass(frozen=True)
class Calibrated:
    """The plan the rank keeps, with Grappler's estimate of it, and every round that led there."""

    rewritten: object  # lms_core.tf.RewrittenStep
    estimate: object  # lms_core.report.MemoryEstimate
    outcome: Outcome
    warning: str | None = None
    verifications: dict = dataclasses.field(default_factory=dict)  # id(proposal) -> its gating check

    @property
    def verification(self):
        """The kept plan's gating check, where calibration made one (lms_core.report.Verification)."""
        kept = next((r for r in self.outcome.rounds if r.proposal.plan[0] is self.rewritten), None)
        return kept and self.verifications.get(id(kept.proposal))

    def to_dicts(self) -> list[dict]:
        """The rounds as plan-rank<N>.json keeps them."""
        return [round_dict(r, r.proposal.plan[0] is self.rewritten, self.verifications.get(id(r.proposal)))
                for r in self.outcome.rounds]


def round_dict(done: Round, kept: bool, verification=None) -> dict:
    proposal, feedback = done.proposal, done.feedback
    return {"round": done.number, "budget_bytes": proposal.budget_bytes,
            "predicted_peak_bytes": proposal.predicted_bytes, "estimated_peak_bytes": proposal.estimated_bytes, "predicted_step_s": proposal.predicted_step_s,
            "measured_peak_bytes": feedback.peak_bytes, "measured_step_s": feedback.step_s,
            "out_of_memory": feedback.out_of_memory, "steps": feedback.steps, "fits": done.fits,
            "next_budget_bytes": done.next_budget_bytes, "kept": kept,
            "gated": f"{verification.gated}/{verification.swap_ins}" if verification is not None else None}


def proposal_of(rewritten, estimate, budget_bytes: int) -> Proposal:
    """A planned step as lms_core.driver's loop sees it: the simulator's peak and step time."""
    prediction = rewritten.report.prediction
    predicted = prediction.peak_device_bytes if prediction is not None else estimate.lms_bytes
    return Proposal((rewritten, estimate), budget_bytes, predicted,
                    prediction.step_time_s if prediction else None,
                    prediction.unlimited_step_time_s if prediction else None, estimate.lms_bytes)


@dataclass(frozen=True)
class Agreement:
    """How the ranks decide each round together: `gather(value)` returns every rank's value (one
    collective; with one rank, [value])."""

    gather: Callable[[object], list]

    def feedback(self, mine: Feedback) -> Feedback:
        """The worst reading of all ranks: an out-of-memory error anywhere (the highest lower bound),
        else the highest peak."""
        every = self.gather(mine)
        failed = [f for f in every if f.out_of_memory]
        return max(failed or every, key=lambda f: f.peak_bytes)

    def budget(self, mine: int | None) -> int | None:
        """The lowest next budget any rank asks for; None only when no rank asks for another round."""
        asked = [b for b in self.gather(mine) if b is not None]
        return min(asked) if asked else None


ALONE = Agreement(lambda value: [value])


class DeviceRounds:
    """The plans calibration measures (`propose`), how (`measure`), and what comes next (`next_budget`).

    `first` is the (rewritten step, estimate) pair planned for `target` at `lms.memory_ratio`;
    `rewrite(target=..., config=...)` makes another; `run_plan(rewritten)` gives the function one
    measured step calls; `profile(rewritten, run)` gives measured op times (lms.measure_ops);
    `verify(rewritten)` checks a plan that fits on the partition graphs TensorFlow executes (every
    rank together: the ranks agreed it fits); `extra_bytes`, for tests without a GPU only
    (env.LMS_LAUNCH_TEST_CALIBRATION), makes the reading the predicted peak plus that."""

    def __init__(self, first, rewrite: Callable, lms: LMSConfig, target: Target, device: str, device_bytes: int,
                 run_plan: Callable, variables: list, batch_size: int, profile: Callable | None = None,
                 agreement: Agreement = ALONE, extra_bytes: int | None = None, verify: Callable | None = None,
                 first_budget: int | None = None):
        self.first, self.rewrite, self.lms, self.target = first, rewrite, lms, target
        self.device, self.device_bytes, self.run_plan, self.variables = device, device_bytes, run_plan, variables
        self.batch_size, self.agreement, self.extra_bytes, self.verify = batch_size, agreement, extra_bytes, verify
        self.verifications: dict = {}  # id(proposal) -> its gating check
        self.profile = profile if lms.measure_ops else None
        self.first_budget = first_budget or int(target.device_memory_bytes * lms.memory_ratio)
        self.op_seconds: dict[str, float] | None = None  # measured, once the first plan was profiled
        self.planned_with_measured: set[int] = set()  # ids of proposals made with the measured op times
        self.policy = miss_based(device_bytes)

    def propose(self, budget: int) -> Proposal:
        if budget == self.first_budget and self.op_seconds is None:
            return proposal_of(*self.first, budget)
        target = self.target if self.op_seconds is None else dataclasses.replace(
            self.target, measured_op_seconds=self.op_seconds)
        ratio = min(1.0, budget / self.target.device_memory_bytes)
        proposal = proposal_of(*self.rewrite(target=target, config=dataclasses.replace(self.lms, memory_ratio=ratio)),
                               budget)
        if self.op_seconds is not None:
            self.planned_with_measured.add(id(proposal))
        return proposal

    def measure(self, proposal: Proposal) -> Feedback:
        from lms_core.tf.calibrate import measure_step

        rewritten, _ = proposal.plan
        run = self.run_plan(rewritten)
        feedback = measure_step(run, self.device, self.lms.calibrate_steps, self.variables, self.device_bytes)
        if self.extra_bytes is not None and not feedback.out_of_memory:
            feedback = dataclasses.replace(feedback, peak_bytes=proposal.predicted_bytes + self.extra_bytes)
        if self.profile is not None and self.op_seconds is None and not feedback.out_of_memory:
            self.op_seconds = self.profile(rewritten, run)
        agreed = self.agreement.feedback(feedback)
        if self.verify is not None and fits(agreed, fit_limit(self.device_bytes)):
            self.verifications[id(proposal)] = self.verify(rewritten)
        return agreed

    def next_budget(self, rounds: Sequence[Round], limit_bytes: int) -> int | None:
        budget = self.policy(rounds, limit_bytes)
        last = rounds[-1]
        if budget is None and last.fits and self.op_seconds is not None \
                and id(last.proposal) not in self.planned_with_measured:
            budget = last.proposal.budget_bytes  # the same budget, planned with the measured op times
        return self.agreement.budget(budget)


def calibrate(rounds_of: DeviceRounds, log: Callable[[str], None]) -> Calibrated:
    """Runs lms_core.driver's loop on the device. Raises TensorFlow's ResourceExhaustedError when
    every round ran out of memory."""
    lms = rounds_of.lms
    rounds = lms.calibrate_rounds if tunes(lms, rounds_of.target) else 1  # a manual plan has no budget to move
    outcome = plan_until_it_fits(rounds_of.propose, rounds_of.measure, rounds_of.first_budget,
                                 fit_limit(rounds_of.device_bytes), rounds, rounds_of.next_budget,
                                 lambda done: log(done.describe()))
    calibrated = kept(outcome, rounds_of.device_bytes, rounds, rounds_of.batch_size)
    return dataclasses.replace(calibrated, verifications=rounds_of.verifications)


def kept(outcome: Outcome, device_bytes: int, rounds: int, batch_size: int) -> Calibrated:
    """The round to train with: the chosen one; else the lowest that ran, with a warning; else the
    out-of-memory error of the last round, raised."""
    chosen = outcome.chosen
    if chosen is not None:
        return Calibrated(*chosen.proposal.plan, outcome)
    lowest = min(outcome.rounds, key=lambda r: r.feedback.peak_bytes)
    limit = fit_limit(device_bytes)
    would_fit = (f"by the {format_bytes(lowest.feedback.peak_bytes / batch_size)} per sample of that peak, "
                 f"batch {largest_batch(lowest.feedback.peak_bytes, batch_size, limit)} would")
    ran = [r for r in outcome.rounds if not r.feedback.out_of_memory]
    if ran:
        lowest = min(ran, key=lambda r: r.feedback.peak_bytes)
        warning = (f"no plan kept its measured peak under {format_bytes(limit)} (the device's "
                   f"{format_bytes(device_bytes)} less the headroom) in {len(outcome.rounds)} round(s); training "
                   f"with the lowest, {format_bytes(lowest.feedback.peak_bytes)}: it may run out of memory "
                   f"({would_fit}). Lower train.batch_size, or raise lms.calibrate_rounds")
        return Calibrated(*lowest.proposal.plan, outcome, warning)
    import tensorflow as tf

    last = outcome.rounds[-1]
    raise tf.errors.ResourceExhaustedError(None, None, (
        f"{last.feedback.out_of_memory} (LMS calibration: every one of {len(outcome.rounds)} plan(s) ran out of "
        f"memory, the last planned for {format_bytes(last.proposal.budget_bytes)}; the smallest needed more than "
        f"{format_bytes(lowest.feedback.peak_bytes)}, and {would_fit} fit at most; lms.calibrate_rounds={rounds})"))


def largest_batch(peak_bytes: int, batch_size: int, limit_bytes: int) -> int:
    """The batch whose peak, at `peak_bytes / batch_size` a sample, stays within `limit_bytes`. Weights
    and optimizer state count as if per sample, so the figure errs low."""
    return max(0, int(limit_bytes / (peak_bytes / batch_size)))


def injected_extra_bytes(environ, rank: int) -> int | None:
    """env.LMS_LAUNCH_TEST_CALIBRATION's extra bytes for `rank` (None when it is not listed). Raises
    ValueError naming the variable when it is malformed."""
    from lms_core.units import parse_bytes

    text = environ.get(env.LMS_LAUNCH_TEST_CALIBRATION, "").strip()
    extras = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        who, sep, extra = entry.partition(":")
        try:
            extras[int(who)] = 0 if extra.strip() in ("0", "+0") else parse_bytes(extra.strip().lstrip("+"))
        except ValueError:
            raise ValueError(f"{env.LMS_LAUNCH_TEST_CALIBRATION}={text!r}: write RANK:EXTRA_BYTES[,...], e.g. "
                             f"1:2GiB") from None
    return extras.get(rank)


def calibrate_rank(step: Callable, specs: tuple, rewrite: Callable, lms: LMSConfig, ctx, target: Target,
                   variables: list, local_step: Callable | None, verify: Callable, lines: list[str]) -> Calibrated:
    """Calibration on a rank's device (launcher.lms.step): the first plan, from the cached budget
    where this step was calibrated on this kind of device before; each plan measured on the step
    itself (one rank) or on `local_step`, the same step without its allreduce, with the same plan
    applied; the budget that fitted kept in the cache."""
    from launcher.rank.devices import allocator_limit_bytes

    device_bytes = allocator_limit_bytes(target.device_memory_bytes)
    start = CalibrationStart.find(step, specs, lms, target, device_bytes, lines)
    first = rewrite(target=target, config=dataclasses.replace(lms, memory_ratio=start.ratio(target)))
    run_plan, profile = _measurers(specs, lms, ctx.device, local_step, variables, lines)
    agreement = Agreement(lambda value: _allgather(ctx, value)) if ctx.size > 1 else ALONE
    rounds = DeviceRounds(first, rewrite, lms, target, ctx.device, device_bytes, run_plan, list(variables),
                          batch_size=start.key.batch, profile=profile, agreement=agreement,
                          extra_bytes=injected_extra_bytes(os.environ, ctx.rank), verify=verify,
                          first_budget=start.budget_bytes)
    calibrated = calibrate(rounds, lines.append)
    start.keep(calibrated, lines)
    return calibrated


def _allgather(ctx, value) -> list:
    from launcher.rank.collectives import allgather_object

    return allgather_object(ctx, value)


def _measurers(specs: tuple, lms: LMSConfig, device: str, local_step: Callable | None, variables: list,
               lines: list[str]) -> tuple[Callable, Callable]:
    """(run_plan, profile) for DeviceRounds on `device`, with one batch of sample inputs made there."""
    import lms_core.tf as lms_tf
    from lms_core.tf.op_profile import profile_step, sample_inputs

    batch = sample_inputs(specs, f"/device:{device}")

    def run_plan(planned) -> Callable[[], object]:
        measured = planned if local_step is None else lms_tf.rewrite_with_plan(
            local_step, *specs, plan=planned.plan, compute_device=planned.compute_device,
            host_device=planned.host_device)
        return lambda: float(measured(*batch))

    def profile(planned, run: Callable[[], object]) -> dict[str, float]:
        times = profile_step(run, planned.planning.graph.order, steps=lms.profile_steps, restore=list(variables))
        lines.append(f"lms.measure_ops: {times.describe()}; the plans after the first are made with them")
        return times.seconds

    return run_plan, profile


@dataclass(frozen=True)
class CalibrationStart:
    """Where a rank's calibration starts: its cache key and folder, and the budget of its first plan
    (the cached one on a hit, else the device memory x lms.memory_ratio)."""

    key: "CacheKey"
    directory: Path | None
    budget_bytes: int

    @staticmethod
    def find(step: Callable, specs: tuple, lms: LMSConfig, target: Target, device_bytes: int,
             lines: list[str]) -> "CalibrationStart":
        import lms_core.tf as lms_tf
        from launcher.lms.calibration_cache import CacheKey, cache_dir, entry_path, load

        traced = lms_tf.trace(step, *specs)  # the same trace the rewrite uses (tf.function keeps it)
        budget = int(target.device_memory_bytes * lms.memory_ratio)
        key = CacheKey(lms_tf.graph_ir(traced.graph).fingerprint(), target.device.name, device_bytes,
                       target.link.describe(), budget, int(specs[0].shape[0]))
        directory = cache_dir(lms.calibration_cache, os.environ)
        cached, problem = load(directory, key)
        if problem:
            lines.append(problem)
        if cached is None:
            return CalibrationStart(key, directory, budget)
        lines.append(f"calibration: starting from {format_bytes(cached.budget_bytes)}, the budget that fitted this "
                     f"step on this device on {cached.made} (measured {format_bytes(cached.measured_peak_bytes)}; "
                     f"{entry_path(directory, key)})")
        return CalibrationStart(key, directory, cached.budget_bytes)

    def ratio(self, target: Target) -> float:
        return min(1.0, self.budget_bytes / target.device_memory_bytes)

    def keep(self, calibrated: Calibrated, lines: list[str]) -> None:
        """Stores the budget that fitted (nothing when none did)."""
        from launcher.lms.calibration_cache import CachedCalibration, now_utc, store

        chosen = calibrated.outcome.chosen
        if chosen is None or self.directory is None:
            return
        entry = CachedCalibration(self.key, chosen.proposal.budget_bytes, chosen.feedback.peak_bytes,
                                  chosen.proposal.predicted_bytes, len(calibrated.outcome.rounds), now_utc())
        try:
            lines.append(f"calibration: the budget that fitted is kept in {store(self.directory, entry)}")
        except OSError as err:
            lines.append(f"calibration: could not keep the budget in {self.directory} ({err}); the next run "
                         f"measures afresh")
