"""Measure a rank's host-device copy rates on its GPU (`lms.measure_link: true`).

A copy of n bytes takes about latency + n / rate. Copies of three sizes are timed (the median of a
few repeats each, after a warm-up round), and a straight line through (bytes, seconds) gives both:
its slope is 1 / rate, the rate large activations see, and its intercept the fixed cost of a copy,
which small copies are dominated by and which a single small copy would fold into a lower rate.

The copies are made as the rewrite's swaps make them: inside a `tf.function`, by an Identity placed
on the other device, so that TensorFlow's executor copies through its rendezvous (into pinned host
memory, for a copy to the host). Eager copies would measure something else: TensorFlow keeps the
device copy of an eager host tensor (a mirror) and hands it back on the next copy, so repeated eager
copies to the GPU cost nothing. On an H100 (2026-11-27, benchmarks/results/gpu-link.txt) the eager
version read H2D 583 GB/s from a PCIe gen5 x16 link. Each copy is read back where it landed. The
version of that day read the host copy with an eager slice, which TensorFlow places on the GPU when
there is one: most likely the whole tensor went back to the GPU inside the D2H timing (it read
11.8 GB/s) and left a mirror there that the H2D copy then returned at once (it read 1075 GB/s).
"""
from __future__ import annotations

import statistics
import time

import tensorflow as tf

from lms_core.link import LinkRates

SIZES = (16 << 20, 64 << 20, 256 << 20)


def measure_link(gpu: str = "/device:GPU:0", host: str = "/device:CPU:0", repeats: int = 5) -> LinkRates:
    """The H2D and D2H rates of the line fitted through copies of 16, 64 and 256 MiB."""

    @tf.function
    def to_host(on_device):
        with tf.device(host):
            return tf.identity(on_device)

    @tf.function
    def to_device(on_host):
        with tf.device(gpu):
            return tf.identity(on_host)

    h2d, d2h = {}, {}
    for size in SIZES:
        with tf.device(gpu):
            on_device = tf.ones([size // 4], tf.float32)
        ups, downs = [], []
        for _ in range(repeats + 1):  # the first round traces the functions and warms the allocators up
            started = time.perf_counter()
            on_host = to_host(on_device)
            with tf.device(host):  # read where it is: an eager slice placed on the GPU would copy it back first
                float(on_host[0])  # a read of the copy: waits for it
            downs.append(time.perf_counter() - started)
            started = time.perf_counter()
            back = to_device(on_host)
            with tf.device(gpu):
                float(back[0])  # a read of the copy: waits for it
            ups.append(time.perf_counter() - started)
        h2d[size], d2h[size] = statistics.median(ups[1:]), statistics.median(downs[1:])
    (h2d_rate, h2d_latency), (d2h_rate, d2h_latency) = fit_copy_times(h2d), fit_copy_times(d2h)
    return LinkRates("measured", h2d_rate, d2h_rate,
                     f"measured on {gpu}: copies of {', '.join(str(s >> 20) for s in SIZES)} MiB, latency "
                     f"{h2d_latency * 1e6:.0f} us H2D / {d2h_latency * 1e6:.0f} us D2H")


def fit_copy_times(seconds_by_bytes: dict[int, float]) -> tuple[float, float]:
    """(bytes per second, seconds of fixed cost) of the least-squares line through the timings."""
    sizes = list(seconds_by_bytes)
    slope, intercept = statistics.linear_regression(sizes, [seconds_by_bytes[s] for s in sizes])
    if slope <= 0:  # timings too noisy to tell a rate from them: take the largest copy's
        largest = max(sizes)
        return largest / seconds_by_bytes[largest], 0.0
    return 1.0 / slope, max(0.0, intercept)
