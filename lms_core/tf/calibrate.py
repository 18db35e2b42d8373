"""A rewritten step measured on the device it will train on: the feedback of lms_core.driver's loop.

    feedback = measure_step(lambda: float(rewritten(*batch)), "GPU:0", steps=3, restore=variables)
    feedback.peak_bytes, feedback.step_s, feedback.out_of_memory

Each step runs with the allocator's statistics reset before it; the peak is the highest of the
steps after the first (the first also pays for tracing and cuDNN's algorithm search, whose scratch
buffers never come back in training), the step time their median. A step that runs out of memory
(TensorFlow's ResourceExhaustedError, or cuDNN finding no algorithm whose workspace fits:
lms_core.tf.allocations.out_of_memory) ends the measurement: the feedback then carries the message
and, as its peak, a lower bound on what the step needed (the allocator's peak when it gave up plus
the request it refused, at least the device memory). The weights and optimizer state get their values back afterwards,
copied to the host meanwhile so that the copies take no device memory the step could have used.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import tensorflow as tf

from lms_core.driver import Feedback
from lms_core.tf.allocations import failed_request_bytes, out_of_memory

HOST = "/device:CPU:0"


def measure_step(run_step: Callable[[], object], device: str, steps: int, restore: Sequence = (),
                 device_bytes: int = 0) -> Feedback:
    """Runs `run_step` (which must block until the step is done, e.g. read the loss back) `steps`
    times on `device` ("GPU:0") and returns its peak and step time. `device_bytes` is what the
    allocator may hold, the floor of the lower bound reported after an out-of-memory error."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    with tf.device(HOST):
        saved = [tf.identity(tf.convert_to_tensor(v)) for v in restore]
    peaks: list[int] = []
    times: list[float] = []
    try:
        for _ in range(steps):
            tf.config.experimental.reset_memory_stats(stats_device(device))
            started = time.perf_counter()
            try:
                run_step()
            except (tf.errors.ResourceExhaustedError, tf.errors.NotFoundError, tf.errors.InternalError) as err:
                reason = out_of_memory(err)
                if reason is None:
                    raise
                refused = failed_request_bytes(err.message or "") or 0
                reached = _peak(device) + refused
                return Feedback(max(reached, device_bytes), None, reason, len(peaks))
            times.append(time.perf_counter() - started)
            peaks.append(_peak(device))
    finally:
        for variable, value in zip(restore, saved):
            variable.assign(value)
    measured = slice(1, None) if steps > 1 else slice(None)
    return Feedback(max(peaks[measured]), statistics.median(times[measured]), None, len(peaks))


def _peak(device: str) -> int:
    return int(tf.config.experimental.get_memory_info(stats_device(device))["peak"])


def stats_device(device: str) -> str:
    """Where TensorFlow keeps `device`'s allocator statistics: the device itself on a GPU; for a
    logical CPU device (a CPU rank's split compute device), CPU:0, whose allocator they share."""
    return "CPU:0" if device.upper().startswith("CPU") else device


