"""Measure a rank's host-device copy rates on its GPU (`lms.measure_link: true`)."""
from __future__ import annotations

import time

import tensorflow as tf

from lms_core.link import LinkRates

SIZES = (16 << 20, 64 << 20, 256 << 20)


def measure_link(gpu: str = "/device:GPU:0", host: str = "/device:CPU:0", repeats: int = 5) -> LinkRates:
    """Median rates of H2D and D2H copies of 16, 64 and 256 MiB (the largest size's rates: small
    copies are latency-bound and would understate what activations see)."""
    rates = {}
    for size in SIZES:
        with tf.device(host):
            on_host = tf.ones([size // 4], tf.float32)
        h2d, d2h = [], []
        for _ in range(repeats + 1):  # the first round warms the allocators up
            started = time.perf_counter()
            with tf.device(gpu):
                on_device = tf.identity(on_host)
                float(on_device[0])  # wait for the copy
            h2d.append(size / (time.perf_counter() - started))
            started = time.perf_counter()
            with tf.device(host):
                back = tf.identity(on_device)
                float(back[0])
            d2h.append(size / (time.perf_counter() - started))
        rates[size] = (sorted(h2d[1:])[repeats // 2], sorted(d2h[1:])[repeats // 2])
    h2d_rate, d2h_rate = rates[SIZES[-1]]
    return LinkRates("measured", h2d_rate, d2h_rate, f"measured on {gpu}: copies of {SIZES[-1] >> 20} MiB")
