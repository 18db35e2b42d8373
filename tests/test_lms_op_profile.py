"""Measured op times (`lms.measure_ops`): the TensorFlow profiler's trace, matched to the graph's ops,
and merged into the cost model. The profiler runs for real here, on the CPU; on a GPU the same code
reads the device plane's kernels (shown below on a hand-built trace of that shape)."""
from __future__ import annotations

import numpy as np
import pytest

from lms_core.costs import PROFILES, calibrated_costs, step_costs
from lms_core.graph import Graph, Op, TensorInfo
from tests.fixtures import conv_graph

tf = pytest.importorskip("tensorflow")


def test_profiling_a_rewritten_step_times_its_convolutions_and_leaves_the_weights_alone():
    import lms_core.tf as lms_tf
    from lms_core.config import LMSConfig
    from lms_core.tf.op_profile import profile_step, sample_inputs
    from benchmarks.architectures import small_unet3d, training_step

    model, optimizer, step, specs, _ = training_step(small_unet3d)
    config = LMSConfig(enabled=True, mode="manual", swapout_threshold=2, min_tensor_bytes=0)
    rewritten = lms_tf.rewrite(step, *specs, config=config, compute_device="/device:CPU:0")
    assert rewritten.plan.swaps
    graph = rewritten.planning.graph
    variables = list(model.variables) + list(optimizer.variables)
    before = [np.array(v.numpy()) for v in variables]
    batch = sample_inputs(specs, "/device:CPU:0")
    assert batch[1].dtype == tf.int32 and not np.any(batch[1].numpy())  # labels: class 0 everywhere

    times = profile_step(lambda: float(rewritten(*batch)), graph.order, steps=2, restore=variables)

    assert times.steps == 2 and times.source == "host"  # a CPU has no device plane
    assert set(times.seconds) <= set(graph.order)  # names matched through the re-import's scope
    convolutions = [n for n in graph.order if graph[n].type.startswith("Conv3D")]
    # Grappler's remapper fuses a convolution with the BiasAdd after it into one kernel, which runs
    # under the BiasAdd's name: the profile times the two there (the U-Net's convolutions have biases).
    fused_into = {n: s for n in convolutions for s in graph.successors(n) if graph[s].type == "BiasAdd"}
    timed = [n for n in convolutions if times.seconds.get(n, 0) > 0 or times.seconds.get(fused_into.get(n), 0) > 0]
    assert len(timed) >= 0.9 * len(convolutions)  # forward and both backward convolutions
    assert all(t > 0 for t in times.seconds.values())
    after = [v.numpy() for v in variables]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))  # three steps ran, nothing changed


def xspace_with_a_gpu_kernel():
    """A trace shaped like a GPU run: the host plane times the launch of `conv` (named `name:Type`),
    the GPU plane times its kernel, annotated with the op under the re-import's scope."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    host = space.planes.add(name="/host:CPU")
    host.event_metadata[1].name = "lms_step/conv:Conv2D"
    host.event_metadata[2].name = "ExecutorState::Process"
    line = host.lines.add(name="tf_Compute")
    line.events.add(metadata_id=1, duration_ps=7_000_000)  # 7 us to launch
    line.events.add(metadata_id=2, duration_ps=99_000_000)
    gpu = space.planes.add(name="/device:GPU:0")
    gpu.event_metadata[1].name = "volta_scudnn_128x64_relu_interior_nn_v1"
    gpu.stat_metadata[5].name = "kernel_annotation"
    gpu.stat_metadata[6].name = "lms_step/conv:Conv2D#id=12#"  # interned string, referenced by id
    stream = gpu.lines.add(name="Stream #7")
    for duration_us in (300, 100):  # two kernels of one op, over two steps
        kernel = stream.events.add(metadata_id=1, duration_ps=duration_us * 1_000_000)
        kernel.stats.add(metadata_id=5, ref_value=6)
    return space


def test_gpu_kernel_time_wins_over_the_host_launch_time():
    from lms_core.tf.op_profile import op_times_from_xspace

    times = op_times_from_xspace(xspace_with_a_gpu_kernel(), ["conv", "x", "w"], steps=2)
    assert times.seconds == {"conv": pytest.approx(200e-6)}  # (300 + 100) us of kernels over 2 steps
    assert times.source == "device+host"
    assert "1 op(s) timed over 2 profiled step(s)" in times.describe()


def test_measured_times_replace_the_model_and_scale_what_was_not_measured():
    relu = Op("relu", "Relu", inputs=["conv:0"], outputs=[TensorInfo((8, 32, 32, 32), "float32", 8 * 32 * 32 * 32 * 4)])
    g = Graph([*conv_graph().ops.values(), relu], outputs=["relu:0"])  # x, w -> conv -> relu
    modelled = step_costs(g, PROFILES["v100"])
    costs, calibration = calibrated_costs(g, PROFILES["v100"], {"conv": modelled["conv"] * 3})
    assert costs["conv"] == pytest.approx(modelled["conv"] * 3)  # measured: taken as it is
    assert costs["relu"] == pytest.approx(modelled["relu"] * 3)  # not measured: scaled like the rest
    assert costs["x"] == 0 and costs["w"] == 0  # placeholders and reads cost nothing either way
    assert (calibration.measured_ops, calibration.modelled_ops, calibration.scale) == (1, 3, pytest.approx(3.0))
    assert "1 op(s) measured, 3 from the roofline model scaled x3.00" in calibration.describe()


def test_a_plan_made_with_measured_op_times_says_so_and_simulates_with_them():
    """What a GPU rank's calibration does with `lms.measure_ops: true` (launcher.lms.calibrate), run
    here on the CPU: plan with the cost model, profile the swapping step, plan again with the
    measured times."""
    import dataclasses

    import lms_core.tf as lms_tf
    from lms_core.config import LMSConfig
    from lms_core.link import NAMED_LINKS
    from lms_core.tf.op_profile import profile_step, sample_inputs
    from benchmarks.architectures import small_unet3d, training_step

    model, optimizer, step, specs, _ = training_step(small_unet3d)
    config = LMSConfig(enabled=True, min_tensor_bytes=0)  # mode auto: tuned for the target
    target = lms_tf.Target(link=NAMED_LINKS["pcie3"], device=PROFILES["v100"], device_memory_bytes=3 << 20,
                           host_memory_bytes=1 << 30)
    first = lms_tf.rewrite(step, *specs, config=config, compute_device="/device:CPU:0", target=target)
    assert first.report.planned_for.cost_model == "costs: roofline model of v100"
    batch = sample_inputs(specs, "/device:CPU:0")
    times = profile_step(lambda: float(first(*batch)), first.planning.graph.order, steps=1,
                         restore=list(model.variables) + list(optimizer.variables))
    again = lms_tf.rewrite(step, *specs, config=config, compute_device="/device:CPU:0",
                           target=dataclasses.replace(target, measured_op_seconds=times.seconds))
    assert again.report.planned_for.cost_model.startswith(f"costs: {len(times.seconds)} op(s) measured")
    assert again.planning.costs != first.planning.costs  # the simulation ran on the measured times
    assert again.report.prediction.step_time_s != first.report.prediction.step_time_s
