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
import re
import os
import subprocess
import sys
import textwrap
from pathlib import Path

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
    from launcher.lms.calibrate import calibrate_rank
    from launcher.lms.step import verify
    from launcher.lms.target import rank_target
    from launcher.rank.collectives import RankContext
    from launcher.rank.devices import HOST_DEVICE
    from launcher.rank.training import build_training, make_train_step
    from launcher.recipe import load_recipe

    batch, device_memory, local = sys.argv[1], sys.argv[2], sys.argv[3] == "local"
    recipe = load_recipe("recipes/unet3d-cpu.yaml", [
        "lms.enabled=true", "lms.mode=auto", "model.input_shape=[32,32,32,2]", "model.levels=2",
        "model.base_filters=4", f"train.batch_size={batch}", f"lms.device_memory={device_memory}",
        "lms.calibrate_rounds=3", "lms.calibrate_steps=2", "lms.calibration_cache=none", *sys.argv[4:]])
    setup = build_training(recipe, 1, "CPU:1")
    target, lines = rank_target(recipe.lms, 0, 0, 1, False)
    rewrite = functools.partial(lms_tf.rewrite_within_estimate, setup.step, *setup.specs,
                                compute_device="/device:CPU:1", host_device=HOST_DEVICE)
    variables = list(setup.model.variables) + list(setup.optimizer.variables)
    before = [v.numpy().copy() for v in variables]
    local_step = make_train_step(setup.model, setup.optimizer, setup.task, 1) if local else None
    result = {"lines": lines}
    try:
        ctx = RankContext(rank=0, size=1, local_rank=0, local_size=1, host="here", device="CPU:1")
        calibrated = calibrate_rank(setup.step, setup.specs, rewrite, recipe.lms, ctx, target, variables, local_step,
                                    lambda planned: verify(planned, setup.specs, "CPU:1"), lines)
        result.update(rounds=calibrated.to_dicts(), warning=calibrated.warning,
                      cost_model=calibrated.rewritten.report.planned_for.cost_model)
    except tf.errors.ResourceExhaustedError as err:
        result["error"] = err.message
    result["restored"] = all(np.array_equal(a, v.numpy()) for a, v in zip(before, variables))
    print("RESULT " + json.dumps(result))
''')


def scenario(batch: int, device_memory: str, allocator_mib: int, local: bool = False, *settings: str) -> dict:
    environ = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB=str(allocator_mib),
                   TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", SCENARIO, str(batch), device_memory, "local" if local else "step",
                           *settings],
                          cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300)
    result = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert result is not None, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(result[len("RESULT "):])


def test_a_plan_whose_measured_peak_fits_is_kept_after_one_round_and_the_weights_come_back():
    """160 MiB planned for: the U-Net at batch 2 (about 30 MiB) fits at the first plan."""
    result = scenario(batch=2, device_memory="160MiB", allocator_mib=400)
    (only,) = result["rounds"]
    assert only["fits"] and only["kept"] and result["warning"] is None
    checked, swap_ins = only["gated"].split("/")
    assert checked == swap_ins  # the plan that fits is checked on what TensorFlow executed
    # The allocator's peak is real: at least the step's own inputs, batch 2 x 32^3 x 2 channels + labels.
    inputs = 2 * 32 ** 3 * (2 + 3) * 4
    assert inputs < only["measured_peak_bytes"] < 160 * MIB
    assert only["steps"] == 2 and only["measured_step_s"] > 0
    assert result["restored"]  # the measured steps trained nothing
    assert result["lines"][-1].startswith("calibration round 1: budget 144.00 MiB, predicted peak ")
    assert result["lines"][-1].endswith("; fits")


def test_when_no_plan_moves_the_peak_the_rank_plans_lower_each_round_and_keeps_the_lowest_with_a_warning():
    """Planned for 24 MiB, the step really needs about 30 (no swap moves a CPU's peak): each round
    plans for less than the last, by what the last one's reading says, until the third, or until the
    next budget would be under 5% of the device (the CPU's peak varies with how many ops its threads
    run at once: on a busy machine the readings are higher and the budgets fall faster). The rank
    keeps the lowest measured peak, saying it may not fit. The steps of the local step (the plan
    applied to a step traced anew) are what is measured."""
    # Swaps only: a recompute frees memory on any device, and would move the CPU's peak too.
    result = scenario(2, "24MiB", 400, True, "lms.actions=[swap]")
    rounds = result["rounds"]
    device, limit, margin = 24 * MIB, int(24 * MIB * 0.95), int(24 * MIB * 0.02)

    def next_budget(done: dict) -> int:  # lms_core.driver.miss_based by hand, for a plan that does not fit
        return min(limit - (done["measured_peak_bytes"] - done["predicted_peak_bytes"]) - margin,
                   done["budget_bytes"] - margin)

    assert len(rounds) >= 2 and not any(r["fits"] for r in rounds)
    assert [r["budget_bytes"] for r in rounds[1:]] == [next_budget(r) for r in rounds[:-1]]
    assert len(rounds) == 3 or next_budget(rounds[-1]) < device * 0.05
    assert all(r["measured_peak_bytes"] > 24 * MIB * 0.95 for r in rounds)
    lowest = min(rounds, key=lambda r: r["measured_peak_bytes"])
    assert [r["kept"] for r in rounds] == [r is lowest for r in rounds]  # none fits: the lowest is kept, with a warning
    assert "no plan kept its measured peak under 22.80 MiB" in result["warning"]
    assert f"training with the lowest, {lowest['measured_peak_bytes'] / MIB:.2f} MiB" in result["warning"]
    assert result["restored"]


def test_measured_op_times_make_the_first_plan_again_at_the_same_budget_and_the_faster_is_kept():
    """lms.measure_ops: the first plan fits and its steps are profiled; it is made once more, for
    the same budget, with the measured times; of the two, the faster measured step is kept."""
    result = scenario(2, "160MiB", 400, False, "lms.measure_ops=true", "lms.profile_steps=1")
    first, again = result["rounds"]
    assert first["budget_bytes"] == again["budget_bytes"] == int(160 * MIB * 0.9)
    assert first["fits"] and again["fits"] and first["next_budget_bytes"] == first["budget_bytes"]
    assert [first["kept"], again["kept"]].count(True) == 1
    kept, other = (first, again) if first["kept"] else (again, first)
    # lms_core.driver.better: measured steps within 1% are alike, and then the lower peak wins.
    assert kept["measured_step_s"] < other["measured_step_s"] * 0.99 or (
        abs(kept["measured_step_s"] - other["measured_step_s"]) <= 0.01 * min(kept["measured_step_s"],
                                                                             other["measured_step_s"])
        and kept["measured_peak_bytes"] <= other["measured_peak_bytes"])
    assert any(line.startswith("lms.measure_ops: ") and "the plans after the first are made with them" in line
               for line in result["lines"])
    assert result["cost_model"].startswith("costs: roofline") == (kept is first)


@pytest.mark.parametrize("field,value,message", [
    ("calibrate_steps", 0, "calibrate_steps: must be >= 1 (lms.calibrate=false turns calibration off), got 0"),
    ("calibrate_rounds", 0, "calibrate_rounds: must be >= 1, got 0"),
])
def test_calibration_settings_are_checked(field, value, message):
    with pytest.raises(SettingError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LMSConfig(**{field: value})
    with pytest.raises(SettingError, match="measure_ops: op times are measured in calibration's steps"):
        LMSConfig(measure_ops=True, calibrate=False)


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


# --- whole runs: `lms-launch`, its ranks and their calibration, on the CPU ------------------------
# The CPU recipe's U-Net plans for a 48 MiB device (Grappler: 68.29 MiB without LMS). With
# env.LMS_LAUNCH_TEST_CALIBRATION a CPU rank calibrates as a GPU rank does, reading its peak as the
# plan's predicted peak plus the bytes given: what a GPU holds beyond the model.
EXTRA = 6 * MIB
SHORT = ["--set", "train.steps=6", "--set", "logging.interval=2"]


def launch(run_dir, *args: str, environ: dict | None = None) -> subprocess.CompletedProcess:
    """The CPU recipe, short, with its calibration cache in the run's own folder unless told."""
    from tests.fixtures import RECIPES, lms_launch_argv

    argv = lms_launch_argv(str(RECIPES / "unet3d-cpu.yaml"), "--run-dir", str(run_dir), "--no-progress", *SHORT,
                           "--set", f"lms.calibration_cache={run_dir.parent / 'cache'}", *args)
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env={**os.environ, **(environ or {})})


def rounds_of(run_dir, rank: int = 0) -> list[dict]:
    return json.loads((run_dir / "lms" / f"plan-rank{rank}.json").read_text())["calibration"]


def expected_next_budget(done: dict, device: int, extra: int) -> int:
    """lms_core.driver.miss_based by hand: the fit limit (95% of the device) less the miss (here the
    injected extra) and a margin of 2% of the device, and never more than the budget less the margin."""
    margin = int(device * 0.02)
    return min(int(device * 0.95) - extra - margin, done["budget_bytes"] - margin)


def test_two_ranks_judge_each_round_by_the_worst_reading_and_end_with_the_same_plan(tmp_path):
    """Rank 1 reads 6 MiB over its plan, rank 0 nothing: both plan again in the same round (one
    collective per decision, no rank waits for another), and end with the same plan."""
    run_dir = tmp_path / "run"
    done = launch(run_dir, "--np", "2", environ={"LMS_LAUNCH_TEST_CALIBRATION": f"0:0,1:{EXTRA}"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    zero, one = rounds_of(run_dir, 0), rounds_of(run_dir, 1)
    assert [r["budget_bytes"] for r in zero] == [r["budget_bytes"] for r in one] and len(zero) >= 2
    assert not zero[0]["fits"]  # rank 0's own reading fitted; rank 1's did not
    assert zero[0]["measured_peak_bytes"] == one[0]["predicted_peak_bytes"] + EXTRA
    plans = [json.loads((run_dir / "lms" / f"plan-rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["tensor"] for s in plans[0]["swaps"]] == [s["tensor"] for s in plans[1]["swaps"]]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["weights_in_sync"] is True


def test_when_every_plan_runs_out_of_memory_the_run_ends_with_the_largest_batch_that_would_fit(tmp_path):
    """TensorFlow's CPU allocator held to 100 MiB; the U-Net at batch 4 needs about 144 whatever the
    plan here. Every round runs out of memory; the rank stops with the out-of-memory status and says
    the smallest peak seen and the batch that would fit by the bytes per sample it measured."""
    run_dir = tmp_path / "run"
    done = launch(run_dir, "--np", "1", "--set", "train.batch_size=4", "--set", "lms.device_memory=100MiB",
                  "--set", "lms.calibrate_rounds=2",
                  environ={"LMS_LAUNCH_TEST_CALIBRATION": "0:0", "TF_CPU_ALLOCATOR_USE_BFC": "true",
                           "TF_CPU_BFC_MEM_LIMIT_IN_MB": "100"})
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "rank 0 ran out of memory on CPU:1" in output
    message = re.search(r"every one of 2 plan\(s\) ran out of memory, the last planned for [0-9.]+ MiB; the smallest "
                        r"needed more than ([0-9.]+) MiB, and by the ([0-9.]+) MiB per sample of that peak, batch "
                        r"(\d+) would fit at most", output)
    assert message is not None, output[-3000:]
    smallest, per_sample, batch = float(message.group(1)), float(message.group(2)), int(message.group(3))
    assert smallest >= 100 and per_sample == pytest.approx(smallest / 4, abs=0.01)
    assert batch == int(100 * 0.95 / (smallest / 4)) and batch < 4


def test_a_reading_over_the_limit_plans_again_for_the_budget_worked_out_by_hand_and_the_next_run_starts_there(
        tmp_path):
    """Run 1 reads 6 MiB over the model: round 2's budget is worked out by hand, the plan that fits
    is checked on what TensorFlow executed and kept in the cache, and the calibration steps trained
    nothing (the loss is that of a run without calibration). Run 2, the same step on the same
    device, starts from the kept budget and fits at once. A cache file that cannot be read is named,
    the step measured afresh, and the file written anew."""
    device, cache = 48 * MIB, tmp_path / "cache"
    injected = {"LMS_LAUNCH_TEST_CALIBRATION": f"0:{EXTRA}"}
    first = launch(tmp_path / "first", "--np", "1", environ=injected)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    fresh = rounds_of(tmp_path / "first")
    one = fresh[0]
    assert one["budget_bytes"] == int(device * 0.9)
    assert one["measured_peak_bytes"] == one["predicted_peak_bytes"] + EXTRA  # the injected reading
    assert not one["fits"] and one["measured_peak_bytes"] > device * 0.95
    assert fresh[1]["budget_bytes"] == expected_next_budget(one, device, EXTRA)
    assert fresh[-1]["fits"] and fresh[-1]["kept"]
    swap_ins, gated = fresh[-1]["gated"].split("/")
    assert swap_ins == gated and int(gated) > 0  # the kept plan's swap-ins checked on what TensorFlow ran
    lines = [line for line in first.stdout.splitlines() if "calibration round" in line]
    assert lines[0].startswith("LMS rank 0: calibration round 1: budget 43.20 MiB, predicted peak ")
    assert lines[0].endswith(f"next budget {fresh[1]['budget_bytes'] / MIB:.2f} MiB") and len(lines) == len(fresh)
    (entry,) = cache.glob("*.json")
    kept = json.loads(entry.read_text())
    assert kept["budget_bytes"] == fresh[-1]["budget_bytes"] and kept["rounds"] == len(fresh)
    assert kept["key"]["batch"] == 2 and kept["key"]["device_bytes"] == device
    assert f"calibration: the budget that fitted is kept in {entry}" in first.stdout

    plain = launch(tmp_path / "plain", "--np", "1", "--set", "lms.calibrate=false")
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    loss = [json.loads((tmp_path / run / "summary.json").read_text())["ranks"][0]["final_loss"]
            for run in ("first", "plain")]
    assert loss[0] == pytest.approx(loss[1], rel=1e-6)

    again = launch(tmp_path / "again", "--np", "1", environ=injected)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    (only,) = rounds_of(tmp_path / "again")
    assert only["budget_bytes"] == kept["budget_bytes"] and only["fits"]
    assert (f"calibration: starting from {kept['budget_bytes'] / MIB:.2f} MiB, the budget that fitted this step on "
            f"this device on {kept['made']}") in again.stdout

    entry.write_text("{ not json")
    afresh = launch(tmp_path / "afresh", "--np", "1", environ=injected)
    assert afresh.returncode == 0, afresh.stdout[-3000:] + afresh.stderr[-3000:]
    assert f"calibration cache {entry} is unusable" in afresh.stdout
    assert [r["budget_bytes"] for r in rounds_of(tmp_path / "afresh")] == [r["budget_bytes"] for r in fresh]
    assert json.loads(entry.read_text())["budget_bytes"] == kept["budget_bytes"]  # written whole again


def test_any_change_of_the_key_misses_and_a_file_holding_another_key_is_refused(tmp_path):
    import dataclasses

    from launcher.lms.calibration_cache import CacheKey, CachedCalibration, cache_dir, entry_path, load, store

    key = CacheKey("ab" * 32, "h100", 16 << 30, "pcie5: H2D 48 GB/s", 15461882265, 256)
    entry = CachedCalibration(key, 13 << 30, 15 << 30, 13 << 30, 2, "2026-11-27T14:00:00Z")
    assert store(tmp_path, entry) == entry_path(tmp_path, key)
    assert load(tmp_path, key) == (entry, None)
    for field, other in (("graph", "cd" * 32), ("device", "h200"), ("device_bytes", 80 << 30),
                         ("link", "pcie4: H2D 24 GB/s"), ("budget_bytes", 14 << 30), ("batch", 512)):
        assert load(tmp_path, dataclasses.replace(key, **{field: other})) == (None, None), field
    stranger = dataclasses.replace(key, batch=512)
    entry_path(tmp_path, stranger).write_text(entry_path(tmp_path, key).read_text())  # the wrong key inside
    found, problem = load(tmp_path, stranger)
    assert found is None and problem.endswith("holds another step's entry: measuring afresh")
    assert load(None, key) == (None, None)  # lms.calibration_cache: none
    assert cache_dir("none", {}) is None
    assert cache_dir(None, {"XDG_CACHE_HOME": "/x"}) == Path("/x/lms-launch/calibration")
    assert cache_dir(None, {"HOME": "/home/u"}) == Path("/home/u/.cache/lms-launch/calibration")


def test_the_fingerprint_is_the_step_not_the_order_of_its_control_inputs():
    from lms_core.graph import Graph, Op
    from tests.fixtures import t

    def step(controls: list[str], shape=(16, 64, 64, 16)) -> Graph:
        return Graph([Op("x", "Placeholder", outputs=[t(shape=shape)]), Op("a", "NoOp"), Op("b", "NoOp"),
                      Op("y", "Relu", inputs=["x:0"], control_inputs=controls, outputs=[t(shape=shape)])], ["y:0"])

    assert step(["a", "b"]).fingerprint() == step(["b", "a"]).fingerprint()
    assert step(["a", "b"]).fingerprint() != step(["a"]).fingerprint()
    assert step(["a"]).fingerprint() != step(["a"], shape=(32, 64, 64, 16)).fingerprint()  # another batch


def test_plan_with_a_calibration_plans_for_the_budget_that_fitted_and_shows_the_gpus_correction(tmp_path, capsys):
    """A cache entry says: at a budget of 2 MiB the GPU measured 2.5 MiB for a plan the simulator put
    at 1.9 MiB. `plan --calibration` plans for 2 MiB and adds the 0.6 MiB to its own simulated peak."""
    from launcher.lms import plan_command
    from tests.fixtures import RECIPES

    entry = {"format": "lms-launch-calibration", "format_version": 1,
             "key": {"graph": "-", "device": "v100", "device_bytes": 4 * MIB, "link": "-", "budget_bytes": 0,
                     "batch": 1},
             "budget_bytes": 2 * MIB, "measured_peak_bytes": int(2.5 * MIB), "predicted_peak_bytes": int(1.9 * MIB),
             "rounds": 2, "made": "2026-11-27T15:00:00Z"}
    calibration = tmp_path / "entry.json"
    calibration.write_text(json.dumps(entry))
    tiny = ["--set", "model.input_shape=[16,16,16,4]", "--set", "model.levels=2", "--set", "model.base_filters=4",
            "--set", "train.batch_size=1", "--set", "lms.min_tensor_bytes=0"]
    status = plan_command.main([str(RECIPES / "unet3d-cpu.yaml"), *tiny, "--device-memory", "4MiB",
                                "--calibration", str(calibration), "--out", str(tmp_path / "plan")])
    out = capsys.readouterr().out
    assert status == 0, out
    assert f"planning for 2.00 MiB, the budget that fitted on the GPU ({calibration}, made 2026-11-27T15:00:00Z)" in out
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    simulated = plan["prediction"]["peak_device_bytes"]
    assert simulated <= 2 * MIB  # planned for the calibrated budget, not 4 MiB x 0.9
    assert (f"it measured 2.50 MiB for a plan the simulator put at 1.90 MiB: 614.40 KiB (+32%) the models do not "
            f"count; this plan's simulated peak with it: {(simulated + int(2.5 * MIB) - int(1.9 * MIB)) / MIB:.2f} MiB"
            in out)
    calibration.write_text(json.dumps({"calibration": []}))  # a plan file of a CPU run: nothing calibrated
    assert plan_command.main([str(RECIPES / "unet3d-cpu.yaml"), "--calibration", str(calibration),
                              "--out", str(tmp_path / "other")]) == 2
    error = capsys.readouterr().err
    assert "neither a calibration cache entry nor a plan-rank<N>.json with a calibrated round" in error
    assert not (tmp_path / "other").exists()
