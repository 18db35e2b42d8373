"""Host memory for LMS: TensorFlow's cap on pinned host memory, and whether a host can hold what the
plans of its ranks park there.

On a GPU, every swap-out lands in pinned (page-locked) host memory, from an allocator TensorFlow caps at
`TF_GPU_HOST_MEM_LIMIT_IN_MB` (64 GiB by default). TensorFlow reads that variable once, when it
creates the allocator, which happens while the model is built: before any plan exists. So a GPU rank
with LMS on sets it before TensorFlow starts, to the host memory its plan is allowed to use (this
rank's share of `lms.host_memory`, else of the host's RAM, times `lms.host_memory_ratio`: the
auto-tuner keeps the plan under it) with headroom; once planned, a plan that needs more than the cap
(a manual plan, or a cap the user set) stops the run before training, as does a host whose ranks'
plans together need more memory than it has available.
"""
from __future__ import annotations

import math
from typing import Mapping, MutableMapping

from launcher import env as ev
from launcher.lms.rank_plan import RankPlan
from lms_core.config import LMSConfig
from lms_core.report import PlanReport
from lms_core.units import format_bytes

MIB = 1 << 20
HEADROOM = 1.25  # allocator rounding and fragmentation in TensorFlow's pinned-memory BFC allocator
HEADROOM_BYTES = 1 << 30  # and room for the step's own small host copies (the loss, metrics)


def pinned_limit_mb(host_bytes: int) -> int:
    """The `TF_GPU_HOST_MEM_LIMIT_IN_MB` value for a rank that parks up to `host_bytes` on the host."""
    return math.ceil((host_bytes * HEADROOM + HEADROOM_BYTES) / MIB)


def set_pinned_limit(environ: MutableMapping[str, str], lms: LMSConfig, host_share_bytes: int) -> str:
    """Before TensorFlow starts, on a GPU rank with LMS on: caps pinned host memory at what this rank's
    plan may use (`host_share_bytes` x `lms.host_memory_ratio`), unless the user set the cap. Returns
    the line for the rank's log."""
    if ev.TF_GPU_HOST_MEM_LIMIT_IN_MB in environ:
        return f"pinned host memory: {ev.TF_GPU_HOST_MEM_LIMIT_IN_MB}={environ[ev.TF_GPU_HOST_MEM_LIMIT_IN_MB]} (yours)"
    budget = int(host_share_bytes * lms.host_memory_ratio)
    environ[ev.TF_GPU_HOST_MEM_LIMIT_IN_MB] = str(pinned_limit_mb(budget))
    return (f"pinned host memory: {ev.TF_GPU_HOST_MEM_LIMIT_IN_MB}={environ[ev.TF_GPU_HOST_MEM_LIMIT_IN_MB]} "
            f"(the plan's host budget {format_bytes(budget)}, with headroom)")


def cap_pinned_host_memory(environ: MutableMapping[str, str], lms: LMSConfig) -> str | None:
    """Before TensorFlow starts, on a rank with LMS on: on a GPU, `set_pinned_limit` for this rank's
    share of the host's memory; the line for the log, or None without a GPU (nothing is pinned)."""
    from launcher.launch.threads import local_rank_from_env, local_size_from_env
    from launcher.lms.target import host_memory
    from lms_core.nvml import probe_gpu

    if probe_gpu(local_rank_from_env(environ)) is None:
        return None
    return set_pinned_limit(environ, lms, host_memory(lms, local_size_from_env(environ))[1])


def planned_host_bytes(report: PlanReport) -> int:
    """What a plan parks in host memory at its peak: Grappler's estimate where it was made, else the
    simulator's prediction."""
    if report.estimate is not None and report.estimate.host_bytes:
        return report.estimate.host_bytes
    return report.prediction.peak_host_bytes if report.prediction is not None else 0


def pinned_limit_problem(report: PlanReport, rank: int, environ: Mapping[str, str]) -> str | None:
    """On a GPU rank: why its plan cannot run under the pinned-memory cap in force, or None."""
    text = environ.get(ev.TF_GPU_HOST_MEM_LIMIT_IN_MB)
    if text is None or not text.strip().isdigit():
        return None
    needed = planned_host_bytes(report)
    if pinned_limit_mb(needed) <= int(text):
        return None
    return (f"rank {rank}'s LMS plan parks {format_bytes(needed)} in pinned host memory, but "
            f"{ev.TF_GPU_HOST_MEM_LIMIT_IN_MB}={text} caps it at {format_bytes(int(text) * MIB)}; set "
            f"{ev.TF_GPU_HOST_MEM_LIMIT_IN_MB}={pinned_limit_mb(needed)} or more, or swap less (lms.mode: auto "
            f"with lms.host_memory, or a larger lms.swapout_threshold)")


def host_problems(plans: list[RankPlan]) -> list[str]:
    """For each host whose ranks' plans together park more than the host has available, the reason.
    Every rank's plan carries what its host had free when it planned, after building its model."""
    problems = []
    for host in sorted({plan.host for plan in plans}):
        mine = [plan for plan in plans if plan.host == host]
        needed = sum(planned_host_bytes(plan.report) for plan in mine)
        available = min(plan.host_available_bytes for plan in mine)
        if needed > available:
            ranks = ", ".join(str(plan.rank) for plan in mine)
            problems.append(
                f"host {host}: the LMS plans of rank(s) {ranks} park {format_bytes(needed)} in host memory, but "
                f"{host} has {format_bytes(available)} available; lower train.batch_size, run fewer ranks per host, "
                f"or set lms.host_memory to what the host can give (the auto-tuner then swaps less)")
    return problems
