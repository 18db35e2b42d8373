"""The one place a rank's traced training step is handed to LMS.

With `lms.enabled: false` the step is returned as it is. Otherwise each rank plans and applies the
swaps for its own compute device, estimates peak memory with and without them (Grappler, on a
virtual GPU the size of this rank's GPU, or of `DEFAULT_VIRTUAL_GPU_BYTES` without one), and rank 0
writes every rank's plan to RUN_DIR/lms/plan-rank<N>.json and logs one line per rank.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from lms_core.config import LMSConfig

DEFAULT_VIRTUAL_GPU_BYTES = 16 << 30  # the papers' 16 GB V100/P100
HOST_DEVICE = "/device:CPU:0"


def gpu_memory_bytes(local_rank: int) -> int | None:
    """Total memory of this rank's GPU from NVML, or None without a GPU or NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(local_rank % pynvml.nvmlDeviceGetCount())
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no GPU, no NVML: fall back to the virtual GPU
        return None


def describe(plan: dict, rank: int, seconds: float) -> str:
    peaks = plan["estimated_peak_bytes"]
    gib = 2**30
    return (f"LMS rank {rank}: {plan['swap_count']} tensor(s) swapped, {plan['swapped_bytes'] / gib:.2f} GiB/step "
            f"to host; threshold {plan['settings']['swapout_threshold']}, ahead {plan['settings']['swapin_ahead']}, "
            f"groupby {plan['settings']['swapin_groupby']}, sync {plan['settings']['sync_mode']}; estimated peak "
            f"{peaks['baseline'] / gib:.2f} -> {peaks['lms'] / gib:.2f} GiB of {plan['device_memory_bytes'] / gib:.0f} GiB "
            f"(host {plan['estimated_host_bytes'] / gib:.2f} GiB); rewrite {seconds:.1f} s")


def prepare_step(step: Callable, specs: tuple, lms: LMSConfig, ctx, run_dir: Path,
                 log: Callable[[str], None] | None) -> Callable:
    if not lms.enabled:
        return step
    import lms_core.tf as lms_tf

    started = time.perf_counter()
    rewritten = lms_tf.rewrite(step, *specs, config=lms, compute_device=f"/device:{ctx.device}",
                               host_device=HOST_DEVICE)
    memory = (gpu_memory_bytes(ctx.local_rank) if ctx.device.startswith("GPU") else None) or DEFAULT_VIRTUAL_GPU_BYTES
    lms_tf.estimate_rewrite(rewritten, memory)
    seconds = time.perf_counter() - started
    mine = dict(rewritten.plan.to_dict(), rank=ctx.rank, host=ctx.host, device=ctx.device)
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
                log(describe(plan, plan["rank"], rank_seconds))
    return rewritten
