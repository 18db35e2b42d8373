"""Which device a rank computes on, and where LMS parks what it swaps out.

A GPU rank computes on its GPU (one per local rank) and swaps to the host CPU. A CPU rank with LMS on
is given two logical CPU devices, computes on the second and swaps to the first: TensorFlow then
partitions its step across two devices with `_Send`/`_Recv` pairs exactly as it would for a GPU, so
the gated swap-ins it executes are the ones a GPU rank would (lms_core.tf.gating). The two logical
devices share one allocator, so on a CPU rank swapping moves no memory; it proves the mechanism.
"""
from __future__ import annotations

import os
from typing import Mapping

from launcher import env

HOST_DEVICE = "/device:CPU:0"
SPLIT_COMPUTE_CPU = "CPU:1"  # the compute device of a CPU rank with LMS on


def split_cpu() -> None:
    """Gives TensorFlow two logical CPU devices, CPU:0 (the host) and CPU:1 (the compute device).
    Must run before TensorFlow creates its devices (its first op); a second call is a no-op."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    if len(tf.config.get_logical_device_configuration(cpu) or []) == 2:
        return
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)


def pin_device(local_rank: int, lms_enabled: bool = False) -> str:
    """One GPU per rank (by local rank), with memory growth so ranks sharing a GPU in tests do not
    each reserve it all, or held to LMS_LAUNCH_GPU_MEMORY_LIMIT_MB when that is set (a benchmark
    answering for a smaller GPU). Without a GPU: CPU:0, or the split CPU's compute device when LMS
    is on."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        if lms_enabled:
            split_cpu()
            return SPLIT_COMPUTE_CPU
        return "CPU:0"
    gpu = gpus[local_rank % len(gpus)]
    tf.config.set_visible_devices(gpu, "GPU")
    limit_mb = gpu_memory_limit_mb(os.environ)
    if limit_mb is None:
        tf.config.experimental.set_memory_growth(gpu, True)
    else:
        # One logical device of that size: TensorFlow's GPU allocator then never holds more (memory
        # growth and a limit exclude each other; the limit is what a smaller GPU would give).
        tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=limit_mb)])
    return "GPU:0"


def gpu_memory_limit_mb(environ: Mapping[str, str]) -> int | None:
    """LMS_LAUNCH_GPU_MEMORY_LIMIT_MB as a positive number of MiB, None when unset or empty."""
    text = environ.get(env.LMS_LAUNCH_GPU_MEMORY_LIMIT_MB, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{env.LMS_LAUNCH_GPU_MEMORY_LIMIT_MB}={text!r}: give a positive whole number of MiB "
                         f"(e.g. 16384 for a 16 GiB GPU), or unset it to use the whole GPU")
    return value


def allocator_limit_bytes(planned_for_bytes: int) -> int:
    """What a GPU rank's allocator may hold for a plan made for `planned_for_bytes` of device memory:
    that, or less where LMS_LAUNCH_GPU_MEMORY_LIMIT_MB holds the GPU to less."""
    limit_mb = gpu_memory_limit_mb(os.environ)
    return planned_for_bytes if limit_mb is None else min(planned_for_bytes, limit_mb << 20)
