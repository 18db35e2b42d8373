"""The one place a rank's traced training step is handed to LMS.

With `lms.enabled: false` the step is returned as it is. Otherwise each rank:
1. works out what it plans for (launcher.lms.target: its link, device profile, device and host memory);
2. plans (auto-tuned or manual) and applies the swaps; with `lms.measure_ops` on GPUs it profiles
   that step and plans again with the measured op times;
   on a GPU, runs `lms.calibrate_steps` steps of the plan and, where the real peak does not fit,
   plans again for a budget lowered by what the models missed (launcher.lms.calibrate);
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

    # describe_memory: the plan's device memory as TensorFlow's allocator holds it (the model of
    # lms_core.memory) goes into the rank's plan, next to which the run's measured peak is logged.
    # Planned again where Grappler's estimate, which the log says "fits" by, disagrees with the tuner.
    rewrite = functools.partial(lms_tf.rewrite_within_estimate, step, *specs, compute_device=f"/device:{ctx.device}",
                                host_device=HOST_DEVICE, describe_memory=True)
    rewritten, estimate = rewrite(target=target, config=lms)
    # Profiled steps run the step's collectives, so every rank profiles or none does.
    if lms.measure_ops and all_ranks(ctx, on_gpu):
        times = measure_op_times(rewritten, specs, ctx.device, list(variables), lms.profile_steps)
        lines.append(f"lms.measure_ops: {times.describe()}; re-planning with them")
        target = dataclasses.replace(target, measured_op_seconds=times.seconds)
        rewritten, estimate = rewrite(target=target, config=lms)
    elif lms.measure_ops:
        lines.append("lms.measure_ops: not every rank computes on a GPU, and CPU op times say nothing about the "
                     "GPU planned for; kept the cost model")
    calibration = None
    if lms.calibrate_steps and on_gpu:
        calibration = calibrate_on_device(rewritten, estimate, rewrite, lms, ctx.device, target, specs, variables,
                                          local_step, lines)
        rewritten, estimate = calibration.rewritten, calibration.estimate
    # Not on a CPU rank: its two logical devices share one allocator, so its peak says nothing of the plan.
    report = rewritten.report.with_estimate(estimate)
    if calibration is not None and calibration.warning:
        report = dataclasses.replace(report, warnings=report.warnings + (calibration.warning,))
    return rewritten, report.with_verification(verify(rewritten, specs, ctx.device)), calibration


def calibrate_on_device(rewritten, estimate, rewrite: Callable, lms: LMSConfig, device: str, target, specs: tuple,
                        variables: list, local_step: Callable | None, lines: list[str]):
    """launcher.lms.calibrate on this rank's device: each plan measured on the step itself (one rank)
    or on `local_step`, the same step without its allreduce, with the same plan applied."""
    import lms_core.tf as lms_tf
    from launcher.lms.calibrate import calibrate
    from launcher.rank.devices import allocator_limit_bytes
    from lms_core.tf.op_profile import sample_inputs

    batch = sample_inputs(specs, f"/device:{device}")

    def run_plan(planned) -> Callable[[], object]:
        measured = planned if local_step is None else lms_tf.rewrite_with_plan(
            local_step, *specs, plan=planned.plan, compute_device=planned.compute_device,
            host_device=planned.host_device)
        return lambda: float(measured(*batch))

    device_bytes = allocator_limit_bytes(target.device_memory_bytes)
    return calibrate((rewritten, estimate), rewrite, lms, target, device, device_bytes, run_plan, list(variables),
                     lines.append)


def measure_op_times(rewritten, specs: tuple, device: str, variables: list, steps: int):
    """Per-op times of the (already swapping) step on `device` (the rank's GPU when `prepare_step`
    calls it), from the TensorFlow profiler. The rewritten step is profiled, not the original,
    because the original may not fit: that is why LMS is on. Weights and optimizer state are
    restored afterwards."""
    from lms_core.tf.op_profile import profile_step, sample_inputs

    batch = sample_inputs(specs, f"/device:{device}")
    return profile_step(lambda: float(rewritten(*batch)), rewritten.planning.graph.order, steps=steps,
                        restore=variables)


def verify(rewritten, specs: tuple, device: str) -> Verification:
    """Runs the rewritten step once on this rank's devices (weights restored) and checks every
    swap-in against the partition graphs TensorFlow executed. Every rank runs it together: the
    step's allreduce is in it."""
    from lms_core.tf.gating import GatingReport, verify_gating
    from lms_core.tf.op_profile import sample_inputs

    if not rewritten.plan.swaps and not rewritten.plan.control_edges:
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
