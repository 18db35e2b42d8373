"""GPU code paths: run where TensorFlow sees an NVIDIA GPU, skipped elsewhere (CI has none)."""
from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not tf.config.list_physical_devices("GPU"), reason="no GPU visible to TensorFlow")]


def test_a_rank_is_pinned_to_one_gpu_with_memory_growth():
    from launcher.rank.devices import pin_device

    gpus = tf.config.list_physical_devices("GPU")
    assert pin_device(local_rank=len(gpus) + 1) == "GPU:0"  # wraps around when ranks outnumber GPUs
    visible = tf.config.get_visible_devices("GPU")
    assert len(visible) == 1 and visible[0] == gpus[(len(gpus) + 1) % len(gpus)]
    assert tf.config.experimental.get_memory_growth(visible[0]) is True


def test_a_rank_can_be_held_to_less_of_its_gpu(tmp_path):
    """LMS_LAUNCH_GPU_MEMORY_LIMIT_MB (set by the bench's run judge for --device-memory) makes the GPU
    one logical device of that size: 256 MiB fit under a 1 GiB hold, 2 GiB do not. In a fresh process,
    since devices can be configured only before TensorFlow starts them."""
    import subprocess
    import sys

    script = (
        "import tensorflow as tf\n"
        "from launcher.rank.devices import pin_device\n"
        "assert pin_device(0) == 'GPU:0'\n"
        "with tf.device('GPU:0'):\n"
        "    print('small', float(tf.reduce_sum(tf.ones([64, 1024, 1024]))))\n"
        "    try:\n"
        "        print('large', float(tf.reduce_sum(tf.ones([512, 1024, 1024]))))\n"
        "    except tf.errors.ResourceExhaustedError:\n"
        "        print('large: out of memory')\n")
    env = {**__import__("os").environ, "LMS_LAUNCH_GPU_MEMORY_LIMIT_MB": "1024", "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "small 67108864.0" in done.stdout and "large: out of memory" in done.stdout


def test_gpu_peak_memory_is_measured_and_reset():
    from launcher.rank.metrics import DeviceMemoryMonitor

    monitor = DeviceMemoryMonitor("GPU:0")
    in_use = tf.config.experimental.get_memory_info("GPU:0")["current"]
    monitor.reset()
    with tf.device("GPU:0"):
        block = tf.ones([64, 1024, 1024])  # 256 MiB
        float(tf.reduce_sum(block))
    assert monitor.peak_bytes() >= in_use + 256 * 2**20
    del block
    monitor.reset()
    assert monitor.peak_bytes() < in_use + 256 * 2**20


def test_the_link_of_a_real_gpu_is_read_from_nvml_and_measured():
    from lms_core.nvml import probe_gpu
    from lms_core.tf.bandwidth import measure_link

    gpu = probe_gpu(0)
    assert gpu is not None and gpu.link is not None and gpu.link.h2d_bytes_per_s > 1e9
    measured = measure_link()
    # No copy beats the link's own signalling rate: NVML's table gives PCIe's effective rate, about 3/4 of
    # the raw one, so the raw rate is under 1.5 times the table's. (TensorFlow's eager mirror once made
    # copies to an H100 on PCIe gen5 read 583 GB/s against the table's 48.)
    assert 1e9 < measured.h2d_bytes_per_s < 1.5 * gpu.link.h2d_bytes_per_s
    assert 1e9 < measured.d2h_bytes_per_s < 1.5 * gpu.link.d2h_bytes_per_s


def test_op_times_on_a_gpu_come_from_its_kernels():
    import lms_core.tf as lms_tf
    from lms_core.config import LMSConfig
    from lms_core.tf.op_profile import profile_step, sample_inputs
    from benchmarks.architectures import conv_relu_step

    step, specs = conv_relu_step((64, 64, 3), batch=16, blocks=3, filters=32)
    config = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, min_tensor_bytes=0)
    rewritten = lms_tf.rewrite(step, *specs, config=config, compute_device="/device:GPU:0")
    batch = sample_inputs(specs, "/device:GPU:0")
    times = profile_step(lambda: float(rewritten(*batch)), rewritten.planning.graph.order, steps=2)
    assert times.source.startswith("device")  # CUPTI kernel events, not only host launches
    graph = rewritten.planning.graph
    # Backward convolutions are never fused by Grappler's remapper, so each must have kernel time
    # (a forward Conv2D may run inside a _FusedConv2D named after its BiasAdd or Relu).
    backward = [n for n in graph.order if graph[n].type.startswith("Conv2DBackprop")]
    assert backward and all(times.seconds.get(n, 0) > 0 for n in backward)
