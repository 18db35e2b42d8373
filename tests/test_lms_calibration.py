"""Calibration on the device (launcher.lms.calibrate, lms_core.tf.calibrate): a plan's first steps
measured by TensorFlow's own allocator, and the rank planning again where the real peak does not fit.

A GPU rank calibrates; these tests run the same code on the CPU, whose BFC allocator
(`TF_CPU_ALLOCATOR_USE_BFC`, held to `TF_CPU_BFC_MEM_LIMIT_IN_MB`) measures peaks and refuses
allocations as a full GPU does. A CPU rank's two logical devices share that allocator, so no plan
moves its peak: the loop must then plan for lower budgets round after round and end as the driver
says, with the measured peaks real. Each scenario runs in a fresh process, because TensorFlow reads
the allocator's settings once, at start-up.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from lms_core.config import LMSConfig, SettingError
from tests.fixtures import REPO as ROOT

MIB = 1 << 20

SCENARIO = textwrap.dedent('''
    import functools, json, sys
    from launcher.rank.devices import split_cpu
    split_cpu()
    import numpy as np
    import tensorflow as tf
    import lms_core.tf as lms_tf
    from launcher.lms.step import calibrate_on_device
    from launcher.lms.target import rank_target
    from launcher.rank.devices import HOST_DEVICE
    from launcher.rank.training import build_training, make_train_step
    from launcher.recipe import load_recipe

    batch, device_memory, local = sys.argv[1], sys.argv[2], sys.argv[3] == "local"
    recipe = load_recipe("recipes/unet3d-cpu.yaml", [
        "lms.enabled=true", "lms.mode=auto", "model.input_shape=[32,32,32,2]", "model.levels=2",
        "model.base_filters=4", f"train.batch_size={batch}", f"lms.device_memory={device_memory}",
        "lms.calibrate_rounds=3", "lms.calibrate_steps=2"])
    setup = build_training(recipe, 1, "CPU:1")
    target, lines = rank_target(recipe.lms, 0, 0, 1, False)
    rewrite = functools.partial(lms_tf.rewrite_within_estimate, setup.step, *setup.specs,
                                compute_device="/device:CPU:1", host_device=HOST_DEVICE)
    first = rewrite(target=target, config=recipe.lms)
    variables = list(setup.model.variables) + list(setup.optimizer.variables)
    before = [v.numpy().copy() for v in variables]
    local_step = make_train_step(setup.model, setup.optimizer, setup.task, 1) if local else None
    result = {"lines": lines}
    try:
        calibrated = calibrate_on_device(*first, rewrite, recipe.lms, "CPU:1", target, setup.specs, variables,
                                         local_step, lines)
        result.update(rounds=calibrated.to_dicts(), warning=calibrated.warning,
                      kept_first=calibrated.rewritten is first[0])
    except tf.errors.ResourceExhaustedError as err:
        result["error"] = err.message
    result["restored"] = all(np.array_equal(a, v.numpy()) for a, v in zip(before, variables))
    print("RESULT " + json.dumps(result))
''')


def scenario(batch: int, device_memory: str, allocator_mib: int, local: bool = False) -> dict:
    environ = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB=str(allocator_mib),
                   TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", SCENARIO, str(batch), device_memory, "local" if local else "step"],
                          cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300)
    result = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert result is not None, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(result[len("RESULT "):])


def test_a_plan_whose_measured_peak_fits_is_kept_after_one_round_and_the_weights_come_back():
    """160 MiB planned for: the U-Net at batch 2 (about 30 MiB) fits at the first plan."""
    result = scenario(batch=2, device_memory="160MiB", allocator_mib=400)
    (only,) = result["rounds"]
    assert only["fits"] and only["kept"] and result["kept_first"] and result["warning"] is None
    # The allocator's peak is real: at least the step's own inputs, batch 2 x 32^3 x 2 channels + labels.
    inputs = 2 * 32 ** 3 * (2 + 3) * 4
    assert inputs < only["measured_peak_bytes"] < 160 * MIB
    assert only["steps"] == 2 and only["measured_step_s"] > 0
    assert result["restored"]  # the measured steps trained nothing
    assert result["lines"][-1].startswith("calibration round 1: budget 144.00 MiB, predicted peak ")
    assert result["lines"][-1].endswith("; fits")


def test_when_no_plan_moves_the_peak_the_rank_plans_lower_each_round_and_keeps_the_lowest_with_a_warning():
    """Planned for 24 MiB, the step really needs about 30 (no swap moves it on a CPU): three rounds,
    each for less than the last, and the rank keeps the lowest measured peak, saying it may not fit.
    The steps of the local step (the plan applied to a step traced anew) are what is measured."""
    result = scenario(batch=2, device_memory="24MiB", allocator_mib=400, local=True)
    rounds = result["rounds"]
    assert len(rounds) == 3 and not any(r["fits"] for r in rounds)
    budgets = [r["budget_bytes"] for r in rounds]
    assert all(lower < higher for higher, lower in zip(budgets, budgets[1:]))
    assert all(r["measured_peak_bytes"] > 24 * MIB * 0.95 for r in rounds)
    lowest = min(rounds, key=lambda r: r["measured_peak_bytes"])
    assert [r["kept"] for r in rounds].count(True) == 0  # nothing was chosen: the lowest is kept by the warning
    assert "no plan kept its measured peak under 22.80 MiB" in result["warning"]
    assert f"training with the lowest, {lowest['measured_peak_bytes'] / MIB:.2f} MiB" in result["warning"]
    assert result["restored"]


def test_when_every_plan_runs_out_of_memory_the_rank_stops_with_tensorflows_error():
    """The allocator holds 40 MiB; the U-Net at batch 4 needs about 60 whatever is swapped here."""
    result = scenario(batch=4, device_memory="40MiB", allocator_mib=40)
    assert "error" in result and "rounds" not in result
    assert result["error"].startswith("OOM when allocating tensor")
    assert "every one of 3 plan(s) ran out of memory" in result["error"]
    assert result["restored"]
    oom_lines = [line for line in result["lines"] if "out of memory (needed more than" in line]
    assert len(oom_lines) == 3


@pytest.mark.parametrize("field,value,message", [
    ("calibrate_steps", -1, "calibrate_steps: must be >= 0 (0: no calibration), got -1"),
    ("calibrate_rounds", 0, "calibrate_rounds: must be >= 1, got 0"),
])
def test_calibration_settings_are_checked(field, value, message):
    with pytest.raises(SettingError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LMSConfig(**{field: value})


# TensorFlow's error on an H200 held to 16 GiB (2026-11-27, benchmarks/results/gpu-h200-shipped.txt), shortened.
NO_ALGORITHM = """Graph execution error:

Detected at node lms_step/resnet50_1/conv4_block1_0_conv_1/convolution defined at (most recent call last):
2 root error(s) found.
  (0) NOT_FOUND:  No algorithm worked!  Error messages:
  Profiling failure on CUDNN engine eng1{}: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 16779264 bytes.
  Profiling failure on CUDNN engine eng71{}: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 633340160 bytes.
  Profiling failure on CUDNN engine eng48{k2=2,k6=2,k13=1,k14=0,k22=2}: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 635437072 bytes.
\t [[{{node lms_step/resnet50_1/conv4_block1_0_conv_1/convolution}}]]
0 successful operations.
0 derived errors ignored. [Op:__inference_wrapped_function_20357]"""


def test_cudnn_finding_no_algorithm_for_want_of_workspace_is_running_out_of_memory():
    """Calibration must read this as "the plan did not fit", and the worker give its advice."""
    import tensorflow as tf

    from lms_core.tf.allocations import out_of_memory
    from lms_core.tf.calibrate import measure_step

    error = tf.errors.NotFoundError(None, None, NO_ALGORITHM)
    assert out_of_memory(error) == ("cuDNN found no convolution algorithm for lms_step/resnet50_1/conv4_block1_0_conv_1/"
                                    "convolution whose workspace fits: out of memory while trying to allocate up to "
                                    "635437072 bytes")
    oom = tf.errors.ResourceExhaustedError(None, None, "Graph execution error:\n\nOOM when allocating tensor with "
                                           "shape[1024,256,1,1] and type float on GPU:0\n [[{{node x}}]]")
    assert out_of_memory(oom) == "OOM when allocating tensor with shape[1024,256,1,1] and type float on GPU:0"
    # Not every NotFoundError is memory: a missing algorithm for another reason, or a missing file.
    assert out_of_memory(tf.errors.NotFoundError(None, None, "No algorithm worked!  Error messages:\n eng0: "
                                                 "CUDNN_STATUS_NOT_SUPPORTED")) is None
    assert out_of_memory(tf.errors.NotFoundError(None, None, "data/train-0.tfrecord; No such file")) is None

    def step():
        raise error

    feedback = measure_step(step, "CPU:0", steps=3, device_bytes=16 << 30)
    assert feedback.out_of_memory == out_of_memory(error) and feedback.steps == 0
    assert feedback.peak_bytes == 16 << 30  # at least the device: the refused workspace is no tensor

    def broken():
        raise tf.errors.NotFoundError(None, None, "data/train-0.tfrecord; No such file")

    with pytest.raises(tf.errors.NotFoundError):  # anything else is not taken for memory
        measure_step(broken, "CPU:0", steps=1)
