"""The one place a rank's traced training step is handed to LMS.

With `lms.enabled: false` the step is returned as it is. Otherwise each rank:
1. works out what it plans for (launcher.lms.target: its link, device profile, device and host memory);
2. plans (auto-tuned or manual) and applies the swaps; on a GPU (lms.calibrate), runs `lms.calibrate_steps` steps
   of the plan and, where the real peak does not fit, plans again for a budget lowered by what the
   models missed, with the measured op times where `lms.measure_ops` asks (launcher.lms.calibrate);
3. estimates peak memory with and without the swaps (Grappler's estimate);
4. runs the rewritten step once and checks, on the partition graphs TensorFlow executed, that every
   swap-in waits for its trigger (`swap-ins gated: N/N`), weights restored afterwards;
5. gathers every rank's plan: rank 0 writes them to RUN_DIR/lms/plan-rank<N>.json and logs them, and
   every rank stops (LMSSetupError) if any swap-in is not gated or a host cannot hold its ranks' plans.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from pathlib import Path
from typing import Callable

from launcher.lms.host_memory import host_problems, pinned_limit_problem
from launcher.lms.rank_plan import RankPlan
from launcher.lms.target import rank_target
from launcher.rank.collectives import RankContext, all_ranks, allgather_object
from launcher.rank.devices import HOST_DEVICE
from lms_core.config import LMSConfig
from lms_core.report import PlanReport, Verification
from lms_core.units import format_bytes

MAX_SWAPS_LOGGED = 8  # the log names the first swaps; the plan file has them all


class LMSSetupError(RuntimeError):
    """A rank cannot train with its LMS plan (a swap-in not gated, too little host memory). Raised
    on every rank alike, from the plans all ranks gathered, so no rank is left waiting for another."""


def prepare_step(step: Callable, specs: tuple, lms: LMSConfig, ctx: RankContext, run_dir: Path,
                 log: Callable[[str], None] | None, variables: list = (), local_step: Callable | None = None) -> Callable:
    """`variables` (weights and optimizer state) are restored after the steps `lms.measure_ops` profiles
    and calibration measures. `local_step`: with several ranks, the same step traced for one rank
    (no allreduce), which calibration measures. Every rank must call this (it gathers the plans);
    raises LMSSetupError before any training step."""
    if not lms.enabled:
        return step
    started = time.perf_counter()
    on_gpu = ctx.device.startswith("GPU")
    target, lines = rank_target(lms, ctx.rank, ctx.local_rank, ctx.local_size, on_gpu)
    rewritten, report, calibration = plan_and_check(step, specs, lms, ctx, target, lines, on_gpu, variables,
                                                    local_step)
    mine = RankPlan(rank=ctx.rank, host=ctx.host, device=ctx.device, report=report, log=tuple(lines),
                    calibration=tuple(calibration.to_dicts()) if calibration else (),
                    host_available_bytes=_available_host_bytes(), seconds=time.perf_counter() - started,
                    # The pinned-memory cap is this rank's own environment: only it can check its plan against it.
                    pinned_memory_problem=pinned_limit_problem(report, ctx.rank, os.environ) if on_gpu else None)
    plans = allgather_object(ctx, mine)
    if ctx.is_root:
        write_plans(plans, run_dir)
        if log:
            for plan in plans:
                log_plan(plan, log, details=plan is plans[0] or not plan.same_plan_as(plans[0]))
    problems = plan_problems(plans)
    if problems:
        raise LMSSetupError("; ".join(problems))
    return rewritten


def plan_and_check(step: Callable, specs: tuple, lms: LMSConfig, ctx: RankContext, target, lines: list[str],
                   on_gpu: bool, variables: list, local_step: Callable | None = None):
    """(the rewritten step, its report with Grappler's estimate, calibration rounds and the gating check)."""
    import lms_core.tf as lms_tf
    from launcher.lms.calibrate import calibrate_rank

    # describe_memory: the plan's device memory as TensorFlow's allocator holds it (the model of
    # lms_core.memory) goes into the rank's plan, next to which the run's measured peak is logged.
    # Planned again where Grappler's estimate, which the log says "fits" by, disagrees with the tuner.
    rewrite = functools.partial(lms_tf.rewrite_within_estimate, step, *specs, compute_device=f"/device:{ctx.device}",
                                host_device=HOST_DEVICE, describe_memory=True)
    # Every rank calibrates or none does: the ranks decide each round together. A CPU rank does not:
    # its two logical devices share one allocator, so its peak says nothing of the plan.
    here = lms.calibrate and calibrates_here(on_gpu, ctx.rank)
    if not (here if ctx.size == 1 else all_ranks(ctx, here)):
        if lms.measure_ops:
            lines.append("lms.measure_ops: op times are measured in calibration's steps on a GPU (lms.calibrate); "
                         "this rank computes on a CPU, so it kept the cost model")
        rewritten, estimate = rewrite(target=target, config=lms)
        report = rewritten.report.with_estimate(estimate)
        return rewritten, report.with_verification(verify(rewritten, specs, ctx.device)), None
    calibration = calibrate_rank(step, specs, rewrite, lms, ctx, target, variables, local_step,
                                 lambda planned: verify(planned, specs, ctx.device), lines)
    rewritten = calibration.rewritten
    report = rewritten.report.with_estimate(calibration.estimate)
    if calibration.warning:
        report = dataclasses.replace(report, warnings=report.warnings + (calibration.warning,))
    checked = calibration.verification or verify(rewritten, specs, ctx.device)
    return rewritten, report.with_verification(checked), calibration


def calibrates_here(on_gpu: bool, rank: int) -> bool:
    """A GPU rank calibrates; a CPU rank only where a test names it (env.LMS_LAUNCH_TEST_CALIBRATION)."""
    from launcher.lms.calibrate import injected_extra_bytes

    return on_gpu or injected_extra_bytes(os.environ, rank) is not None


def verify(rewritten, specs: tuple, device: str) -> Verification:
    """Runs the rewritten step once on this rank's devices (weights restored) and checks every
    swap-in against the partition graphs TensorFlow executed. Every rank runs it together: the
    step's allreduce is in it."""
    from lms_core.tf.gating import GatingReport, verify_gating
    from lms_core.tf.op_profile import sample_inputs

    if not rewritten.plan.swaps and not rewritten.plan.control_edges and not rewritten.plan.recomputes:
        return GatingReport(rewritten.compute_device, rewritten.host_device).verification()
    return verify_gating(rewritten, *sample_inputs(specs, f"/device:{device}")).verification()


def plan_problems(plans: list[RankPlan]) -> list[str]:
    """Why the run must not start with these plans (one entry per problem); [] when it may."""
    problems = []
    for plan in plans:
        check = plan.report.verification
        if check is not None and not check.all_gated:
            problems.append(
                f"rank {plan.rank}: swap-ins gated: {check.gated}/{check.swap_ins} on {check.compute_device}; "
                f"the first that is not, {check.first_failure()}. This is a bug in the rewrite: please report it "
                f"with RUN_DIR/lms/plan-rank{plan.rank}.json; meanwhile set lms.enabled=false or exclude that "
                f"tensor (lms.exclude_scopes)")
        if plan.pinned_memory_problem:
            problems.append(plan.pinned_memory_problem)
    return problems + host_problems(plans)


def write_plans(plans: list[RankPlan], run_dir: Path) -> None:
    directory = run_dir / "lms"
    directory.mkdir(parents=True, exist_ok=True)
    for plan in plans:
        (directory / f"plan-rank{plan.rank}.json").write_text(json.dumps(plan.to_dict(), indent=2))


def log_plan(plan: RankPlan, log: Callable[[str], None], details: bool = True) -> None:
    """The plan's lines for the run's log; with `details` false (a plan like rank 0's), its one-line
    summary and its gating check only."""
    prefix = f"LMS rank {plan.rank}: "
    report: PlanReport = plan.report
    if details:
        for line in plan.log:
            log(prefix + line)
        if report.planned_for is not None:
            log(prefix + report.planned_for.cost_model)
        if report.tuning:
            log(prefix + report.tuning)
        for warning in report.warnings:
            log(f"{prefix}warning: {warning}")
        swaps = report.plan.swaps
        for swap in swaps[:MAX_SWAPS_LOGGED]:
            log(f"{prefix}swap {swap.tensor} ({format_bytes(swap.nbytes)}, level {swap.producer_level}) -> back at "
                f"level {', '.join(str(s.trigger_level) for s in swap.swap_ins)}")
        if len(swaps) > MAX_SWAPS_LOGGED:
            log(f"{prefix}... and {len(swaps) - MAX_SWAPS_LOGGED} more swaps (all in lms/plan-rank{plan.rank}.json)")
        log(plan.describe())
    else:
        log(plan.describe() + " (the same plan as rank 0)")
    if report.verification is not None:
        log(prefix + report.verification.describe())


def _available_host_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)
