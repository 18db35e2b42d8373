"""The one place a rank's traced training step is handed to LMS.

With `lms.enabled: false` the step is returned as it is. Otherwise each rank works out what it plans
for (its link, its device profile, its device and host memory), plans (auto-tuned or manual) and
applies the swaps (with `lms.measure_ops` on GPUs: profiles that step, then plans again with the
measured op times), estimates peak memory with and without them (Grappler), and rank 0 writes every
rank's plan to RUN_DIR/lms/plan-rank<N>.json and logs each rank's link and result.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Callable

from lms_core.config import CustomDevice, LMSConfig
from lms_core.costs import PROFILES, DeviceProfile
from lms_core.link import link_named, resolve_link
from lms_core.units import format_bytes, parse_bytes

HOST_DEVICE = "/device:CPU:0"
FALLBACK_PROFILE = "v100"  # the LMS papers' 16 GB GPU: what a CPU-only rank plans for


def gpu_details(local_rank: int) -> tuple[str, int] | None:
    """(name, total memory) of this rank's GPU from NVML, or None without a GPU or NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(local_rank % pynvml.nvmlDeviceGetCount())
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            return name, int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no GPU, no NVML
        return None


def device_profile(lms: LMSConfig, gpu: tuple[str, int] | None) -> tuple[DeviceProfile, int, str]:
    """The cost profile, the device memory to plan for, and a line saying where they came from."""
    if isinstance(lms.device, CustomDevice):
        profile, why = lms.device.profile(), "lms.device: custom profile"
    elif lms.device != "auto":
        profile, why = PROFILES[lms.device], f"lms.device {lms.device}"
    elif gpu is not None:
        key = next((k for k in PROFILES if k.upper() in gpu[0].upper()), FALLBACK_PROFILE)
        profile, why = PROFILES[key], f"NVML: {gpu[0]}"
    else:
        profile, why = PROFILES[FALLBACK_PROFILE], "no GPU: planning for the papers' 16 GB V100"
    if lms.device_memory:
        memory = parse_bytes(lms.device_memory)
    elif gpu is not None:
        memory = gpu[1]
    else:
        memory = profile.memory_bytes
    return profile, memory, why


def rank_target(lms: LMSConfig, rank: int, local_rank: int, local_size: int, on_gpu: bool):
    """What this rank plans for, and the lines that say so."""
    import psutil

    import lms_core.tf as lms_tf

    gpu = gpu_details(local_rank) if on_gpu else None
    if lms.rank_links:
        link = link_named(lms.rank_links[rank % len(lms.rank_links)])
        link_line = f"link (lms.rank_links) {link.describe()}"
    elif lms.measure_link and on_gpu:
        from lms_core.tf.bandwidth import measure_link

        link = measure_link()
        link_line = f"link {link.describe()}"
    else:
        link, link_line = resolve_link(lms.link, lms.link_fallback, local_rank if on_gpu else None)
        if lms.measure_link:
            link_line += " (lms.measure_link needs a GPU to time copies on; this rank has none)"
    profile, memory, device_line = device_profile(lms, gpu)
    host_total = parse_bytes(lms.host_memory) if lms.host_memory else psutil.virtual_memory().total
    host = int(host_total / max(1, local_size))
    target = lms_tf.Target(link=link, device=profile, device_memory_bytes=memory, host_memory_bytes=host)
    return target, [link_line, f"device {profile.describe()} ({device_line}); planning for {format_bytes(memory)}",
                    f"host memory {format_bytes(host)} for this rank ({'lms.host_memory' if lms.host_memory else 'this host'}"
                    f"'s {format_bytes(host_total)} shared by {local_size} rank(s))"]


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
    return profile_step(lambda: float(rewritten(*batch)), rewritten.planned.graph.order, steps=steps,
                        restore=variables)


def all_ranks(flag: bool, ctx) -> bool:
    """True when every rank says True (a collective: every rank must call it)."""
    if ctx.size == 1:
        return flag
    import horovod.tensorflow as hvd

    return all(hvd.allgather_object(flag))


def prepare_step(step: Callable, specs: tuple, lms: LMSConfig, ctx, run_dir: Path,
                 log: Callable[[str], None] | None, local_size: int = 1, variables: list = ()) -> Callable:
    """`variables` (weights and optimizer state) are restored after the steps `lms.measure_ops` profiles."""
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
    seconds = time.perf_counter() - started
    mine = dict(rewritten.plan.to_dict(), rank=ctx.rank, host=ctx.host, device=ctx.device, log=lines)
    if ctx.size > 1:
        import horovod.tensorflow as hvd

        plans = hvd.allgather_object((mine, seconds))
    else:
        plans = [(mine, seconds)]
    if ctx.rank == 0:
        directory = run_dir / "lms"
        directory.mkdir(parents=True, exist_ok=True)
        for plan, rank_seconds in plans:
            (directory / f"plan-rank{plan['rank']}.json").write_text(json.dumps(plan, indent=2))
            if log:
                for line in plan["log"]:
                    log(f"LMS rank {plan['rank']}: {line}")
                if plan["cost_model"]:
                    log(f"LMS rank {plan['rank']}: {plan['cost_model']}")
                if plan["tuning"]:
                    log(f"LMS rank {plan['rank']}: {plan['tuning']}")
                for warning in plan["warnings"]:
                    log(f"LMS rank {plan['rank']}: warning: {warning}")
                log(describe(plan, plan["rank"], rank_seconds))
    return rewritten
