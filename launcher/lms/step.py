"""The one place a rank's traced training step is handed to LMS.

With `lms.enabled: false` the step is returned as it is. Otherwise each rank:
1. works out what it plans for (launcher.lms.target: its link, device profile, device and host memory);
2. plans (auto-tuned or manual) and applies the swaps; with `lms.measure_ops` on GPUs it profiles
   that step and plans again with the measured op times;
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

from launcher.rank.devices import HOST_DEVICE
from launcher.lms.host_memory import host_problems, pinned_limit_problem
from launcher.lms.target import rank_target
from lms_core.config import LMSConfig
from lms_core.units import format_bytes

MAX_SWAPS_LOGGED = 8  # the log names the first swaps; the plan file has them all


def describe(plan: dict, rank: int, seconds: float) -> str:
    peaks = plan["estimated_peak_bytes"]
    settings = plan["settings"]
    return (f"LMS rank {rank}: {plan['swap_count']} tensor(s) swapped, {format_bytes(plan['swapped_bytes'])}/step "
            f"to host; {settings['mode']}: threshold {settings['swapout_threshold']}, ahead {settings['swapin_ahead']}, "
            f"groupby {settings['swapin_groupby']}, sync {settings['sync_mode']}; Grappler peak "
            f"{format_bytes(peaks['baseline'])} -> {format_bytes(peaks['lms'])} of {format_bytes(plan['device_memory_bytes'])} "
            f"(host {format_bytes(plan['estimated_host_bytes'])}); predicted step "
            f"{plan['prediction']['step_time_s'] * 1000:.0f} ms vs {plan['prediction']['unlimited_step_time_s'] * 1000:.0f} "
            f"ms unswapped; rewrite {seconds:.1f} s")


def measure_op_times(rewritten, specs: tuple, device: str, variables: list, steps: int):
    """Per-op times of the (already swapping) step on `device` (the rank's GPU when `prepare_step`
    calls it), from the TensorFlow profiler. The rewritten step is profiled, not the original,
    because the original may not fit: that is why LMS is on. Weights and optimizer state are
    restored afterwards."""
    from lms_core.tf.op_profile import profile_step, sample_inputs

    batch = sample_inputs(specs, f"/device:{device}")
    return profile_step(lambda: float(rewritten(*batch)), rewritten.planning.graph.order, steps=steps,
                        restore=variables)


def all_ranks(flag: bool, ctx) -> bool:
    """True when every rank says True (a collective: every rank must call it)."""
    if ctx.size == 1:
        return flag
    import horovod.tensorflow as hvd

    return all(hvd.allgather_object(flag))


class LMSSetupError(RuntimeError):
    """A rank cannot train with its LMS plan (a swap-in not gated, too little host memory). Raised
    on every rank alike, from the plans all ranks gathered, so no rank is left waiting for another."""


def prepare_step(step: Callable, specs: tuple, lms: LMSConfig, ctx, run_dir: Path,
                 log: Callable[[str], None] | None, local_size: int = 1, variables: list = ()) -> Callable:
    """`variables` (weights and optimizer state) are restored after the steps `lms.measure_ops` profiles.
    Every rank must call this (it gathers the plans); raises LMSSetupError before any training step."""
    if not lms.enabled:
        return step
    import lms_core.tf as lms_tf

    started = time.perf_counter()
    on_gpu = ctx.device.startswith("GPU")
    target, lines = rank_target(lms, ctx.rank, ctx.local_rank, local_size, on_gpu)
    rewrite = functools.partial(lms_tf.rewrite, step, *specs, config=lms, compute_device=f"/device:{ctx.device}",
                                host_device=HOST_DEVICE)
    rewritten = rewrite(target=target)
    # Profiled steps run the step's collectives, so every rank profiles or none does.
    if lms.measure_ops and all_ranks(on_gpu, ctx):
        times = measure_op_times(rewritten, specs, ctx.device, list(variables), lms.profile_steps)
        lines.append(f"lms.measure_ops: {times.describe()}; re-planning with them")
        rewritten = rewrite(target=dataclasses.replace(target, measured_op_seconds=times.seconds))
    elif lms.measure_ops:
        lines.append("lms.measure_ops: not every rank computes on a GPU, and CPU op times say nothing about the "
                     "GPU planned for; kept the cost model")
    lms_tf.estimate_rewrite(rewritten, target.device_memory_bytes)
    gating = verify(rewritten, specs, ctx.device)
    rewritten.plan.verification = gating.to_dict()
    seconds = time.perf_counter() - started
    mine = dict(rewritten.plan.to_dict(), rank=ctx.rank, host=ctx.host, device=ctx.device, log=lines,
                host_available_bytes=_available_host_bytes())
    # The pinned-memory cap is this rank's own environment: only it can check its plan against it.
    mine["pinned_memory_problem"] = pinned_limit_problem(mine, os.environ) if on_gpu else None
    plans = [mine] if ctx.size == 1 else _allgather(mine)
    seconds_by_rank = [seconds] if ctx.size == 1 else _allgather(seconds)
    if ctx.rank == 0:
        write_plans(plans, run_dir)
        if log:
            for plan, rank_seconds in zip(plans, seconds_by_rank):
                log_plan(plan, rank_seconds, log, details=plan is plans[0] or not same_plan(plan, plans[0]))
    problems = plan_problems(plans)
    if problems:
        raise LMSSetupError("; ".join(problems))
    return rewritten


def verify(rewritten, specs: tuple, device: str):
    """Runs the rewritten step once on this rank's devices (weights restored) and checks every
    swap-in against the partition graphs TensorFlow executed. Every rank runs it together: the
    step's allreduce is in it."""
    from lms_core.tf.gating import GatingReport, verify_gating
    from lms_core.tf.op_profile import sample_inputs

    if not rewritten.plan.swaps and not rewritten.plan.control_edges:
        return GatingReport(rewritten.compute_device, rewritten.host_device)
    return verify_gating(rewritten, *sample_inputs(specs, f"/device:{device}"))


def plan_problems(plans: list[dict]) -> list[str]:
    """Why the run must not start with these plans (one entry per problem); [] when it may."""
    problems = []
    for plan in plans:
        check = plan["verification"]
        if check["ungated"]:
            first = check["ungated"][0]
            problems.append(
                f"rank {plan['rank']}: swap-ins gated: {check['gated']}/{check['swap_ins']} on "
                f"{check['devices']['compute']}; the first that is not, {first}: {check['reasons'][first]}. "
                f"This is a bug in the rewrite: please report it with RUN_DIR/lms/plan-rank{plan['rank']}.json; "
                f"meanwhile set lms.enabled=false or exclude that tensor (lms.exclude_scopes)")
        if plan.get("pinned_memory_problem"):
            problems.append(plan["pinned_memory_problem"])
    return problems + host_problems(plans)


def write_plans(plans: list[dict], run_dir: Path) -> None:
    directory = run_dir / "lms"
    directory.mkdir(parents=True, exist_ok=True)
    for plan in plans:
        (directory / f"plan-rank{plan['rank']}.json").write_text(json.dumps(plan, indent=2))


def same_plan(plan: dict, other: dict) -> bool:
    """The same target, settings and swaps (ranks of one recipe on like hardware plan alike)."""
    keys = ("link", "device_profile", "settings", "swaps", "device_memory_bytes")
    return all(plan[key] == other[key] for key in keys)


def log_plan(plan: dict, seconds: float, log: Callable[[str], None], details: bool = True) -> None:
    """The plan's lines for the run's log; with `details` false (a plan like rank 0's), its one-line
    summary and its gating check only."""
    rank = plan["rank"]
    check = plan["verification"]
    gated = (f"LMS rank {rank}: swap-ins gated: {check['gated']}/{check['swap_ins']} (checked on the partition graphs "
             f"TensorFlow executed, {check['devices']['compute']} with host {check['devices']['host']})")
    edges = check.get("control_edges", {})
    if edges.get("checked"):
        gated += f"; backward branches ordered: {edges['kept']}/{edges['checked']} control edges honoured"
    if not details:
        log(describe(plan, rank, seconds) + " (the same plan as rank 0)")
        log(gated)
        return
    for line in plan["log"]:
        log(f"LMS rank {rank}: {line}")
    if plan["cost_model"]:
        log(f"LMS rank {rank}: {plan['cost_model']}")
    if plan["tuning"]:
        log(f"LMS rank {rank}: {plan['tuning']}")
    for warning in plan["warnings"]:
        log(f"LMS rank {rank}: warning: {warning}")
    for swap in plan["swaps"][:MAX_SWAPS_LOGGED]:
        log(f"LMS rank {rank}: swap {swap['tensor']} ({format_bytes(swap['nbytes'])}, level {swap['producer_level']}) "
            f"-> back at level {', '.join(str(s['trigger_level']) for s in swap['swap_ins'])}")
    if len(plan["swaps"]) > MAX_SWAPS_LOGGED:
        log(f"LMS rank {rank}: ... and {len(plan['swaps']) - MAX_SWAPS_LOGGED} more swaps (all in lms/plan-rank{rank}.json)")
    log(describe(plan, rank, seconds))
    log(gated)


def _allgather(value):
    import horovod.tensorflow as hvd

    return hvd.allgather_object(value)


def _available_host_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)
