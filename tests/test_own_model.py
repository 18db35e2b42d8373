"""Your own model through `model.builder`, and LMS on your own step through `lms_core.api`.

The example (examples/tiny_vit: a vision transformer, none of the built-in models) is built by its
own function, rewritten for a 24 MiB device and checked where it runs: every swap-in gated on the
partitions TensorFlow executed, and loss and every weight equal to the step without LMS. Then it
trains through `lms-launch` with checkpoints, and a broken builder fails with its fault named."""
from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from launcher.recipe import RecipeError, load_recipe
from launcher.rank.tasks.builder import BuilderError
from launcher.rank.training import build_training
from lms_core import api
from tests.fixtures import COMPUTE, HOST, REPO, assert_same_training, lms_launch_argv

MIB = 1 << 20
EXAMPLE = REPO / "examples" / "tiny_vit" / "tiny-vit-cpu.yaml"
STEPS = 3


def example_setup(recipe):
    keras.backend.clear_session()
    return build_training(recipe, ranks=1, device=COMPUTE)


def test_the_example_vit_rewritten_through_the_api_is_gated_and_trains_the_same():
    recipe = load_recipe(EXAMPLE)
    reference = example_setup(recipe)
    batch = reference.task.synthetic_batch(recipe.train.batch_size, seed=7)
    with tf.device(COMPUTE):
        expected = [float(reference.step(*batch)) for _ in range(STEPS)]

    setup = example_setup(recipe)
    target = api.make_target(link="pcie3", device="v100", device_memory=recipe.lms.device_memory,
                             host_memory="1GiB")
    rewritten, estimate = api.rewrite_within_estimate(setup.step, *setup.specs, config=recipe.lms, target=target,
                                                      compute_device=COMPUTE, host_device=HOST)
    gating = api.verify_gating(rewritten, *batch)  # runs one step, which moves these weights
    report = api.plan_report(rewritten, estimate, gating)

    assert estimate.baseline_bytes > target.device_memory_bytes >= estimate.lms_bytes  # LMS makes it fit
    swap_ins = sum(len(swap.swap_ins) for swap in rewritten.plan.swaps)
    assert swap_ins > 0 and gating.gated == swap_ins and not gating.ungated
    assert f"swap-ins gated: {swap_ins}/{swap_ins}" in "\n".join(report.lines())

    setup = example_setup(recipe)  # fresh weights: the gating check ran one step on the others
    again = api.rewrite_with_plan(setup.step, *setup.specs, plan=rewritten.plan, compute_device=COMPUTE,
                                  host_device=HOST)
    losses = [float(again(*batch)) for _ in range(STEPS)]
    assert_same_training(losses, expected, setup.model.variables, reference.model.variables)
    assert losses[-1] < losses[0]


def test_make_target_reads_names_and_sizes_and_names_a_bad_one():
    target = api.make_target(link="pcie4", device="a100", device_memory="16GiB", host_memory=64 << 30)
    assert (target.link.h2d_bytes_per_s, target.device.name, target.device_memory_bytes,
            target.host_memory_bytes) == (24e9, "a100", 16 << 30, 64 << 30)
    assert api.make_target(device="v100").device_memory_bytes == 16 << 30  # the profile's own
    with pytest.raises(api.SettingError, match="device: must be one of v100, a100"):
        api.make_target(device="k80")
    with pytest.raises(api.SettingError, match="link: unknown link 'pcie9'"):
        api.make_target(link="pcie9")


@pytest.mark.e2e
def test_the_example_trains_with_lms_checkpoints_and_its_model_loads(tmp_path):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    done = subprocess.run(lms_launch_argv(str(EXAMPLE), "--np", "1", "--no-progress", "--run-dir", str(run_dir),
                                          "--set", "train.steps=8", "--set", f"checkpoint.dir={ckpt}",
                                          "--set", "checkpoint.every_steps=4"),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    gated = re.search(r"swap-ins gated: (\d+)/(\d+)", done.stdout)
    assert gated and gated.group(1) == gated.group(2) and int(gated.group(1)) > 0, done.stdout[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model"] == "tiny-vit" and summary["lms_enabled"] and summary["steps"] == 8
    assert summary["ranks"][0]["final_loss"] < summary["ranks"][0]["initial_loss"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000004", "step-00000008"]
    plan = json.loads((run_dir / "lms" / "plan-rank0.json").read_text())
    assert plan["swaps"]
    # The trained model loads where its module is importable (its layers are registered there).
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import tiny_vit  # noqa: F401

        model = keras.saving.load_model(run_dir / "model.keras")
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    assert model(np.zeros([2, 32, 32, 3], np.float32)).shape == (2, 10)


def grappler_fits_at_side(side: int, memory: int) -> bool:
    """An independent judgement: the example's own step with a side x side input, estimated directly."""
    from lms_core.tf.estimate import estimate_peak

    recipe = load_recipe(EXAMPLE, [f"model.input_shape=[{side},{side},3]", "lms.enabled=false"])
    setup = example_setup(recipe)
    concrete = setup.step.get_concrete_function(*setup.specs)
    return estimate_peak(concrete.graph.as_graph_def(), concrete, memory).fits


def test_bench_max_resolution_rebuilds_the_builders_model_on_its_own_grid(tmp_path):
    from launcher.bench import command

    out = tmp_path / "bench"
    assert command.main(["max-resolution", str(EXAMPLE), "--configs", "none", "--step", "4", "--max", "64",
                         "--device-memory", "24MiB", "--no-floor-bound", "--out", str(out)]) == 0
    row = next(r for r in csv.DictReader((out / "results.csv").open()) if r["configuration"] == "none")
    side = int(row["largest_size"])
    assert side % 4 == 0  # the ViT's patches: sides on the grid --step gave
    assert grappler_fits_at_side(side, 24 * MIB) and not grappler_fits_at_side(side + 4, 24 * MIB)


# --- a builder that cannot be used: named before anything starts, or when the rank builds it ------

def write_builder(tmp_path, module: str, code: str, model: str) -> str:
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(code))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(model + "\ntrain: {batch_size: 2, steps: 3}\nlogging: {skip_steps: 1}\n")
    return str(recipe)


DENSE = """
    import keras, tensorflow as tf
    from launcher.rank.tasks.builder import BuiltModel

    def build(spec, *, units=4, wrong_shape=False):
        shape = (spec.input_shape[0] + 1,) if wrong_shape else spec.input_shape
        model = keras.Sequential([keras.Input(shape), keras.layers.Dense(units)])
        return BuiltModel(model=model, loss=lambda y, out: tf.reduce_mean(out), label_spec=tf.TensorSpec([]),
                          synthetic_batch=lambda b, s: (tf.zeros([b, *shape]), tf.zeros([b])))
"""


@pytest.mark.parametrize("module, model, message", [
    ("absent_models", "model: {builder: 'absent_models:build', input_shape: [3]}",
     r"model.builder: no module 'absent_models' in .* \(the recipe's folder\) or the Python path"),
    ("dense_a", "model: {builder: 'dense_a:biuld', input_shape: [3]}",
     r"dense_a \(.*dense_a.py\) has no function 'biuld'; did you mean dense_a:build\?"),
    ("dense_b", "model: {builder: 'dense_b:build', input_shape: [3], options: {unit: 8}}",
     r"unknown key 'model.options.unit'; did you mean 'model.options.units'\? \(dense_b:build takes: units, wrong_shape\)"),
    ("dense_c", "model: {builder: 'dense_c:build', input_shape: [3], classes: 10}",
     r"model.classes: belongs to a built-in network; for model.builder give it to your builder as model.options.classes"),
    ("dense_d", "model: {builder: 'dense_d', input_shape: [3]}", r"model.builder: must be module:function"),
])
def test_a_builder_that_cannot_be_loaded_is_named_when_the_recipe_loads(tmp_path, module, model, message):
    recipe = write_builder(tmp_path, module if module != "absent_models" else "elsewhere", DENSE, model)
    with pytest.raises(RecipeError, match=message):
        load_recipe(recipe)


def test_a_builder_that_breaks_the_contract_is_named_when_the_rank_builds_it(tmp_path):
    recipe = load_recipe(write_builder(tmp_path, "dense_e", DENSE, "model: {builder: 'dense_e:build', "
                                       "input_shape: [3], options: {wrong_shape: true}}"))
    assert recipe.model.builder_dir == str(tmp_path) and recipe.model.name == "dense_e:build"
    with pytest.raises(BuilderError, match=r"model.builder dense_e:build: the model's input is \[4\] per sample, but "
                                           r"model.input_shape is \[3\]; build it from spec.input_shape"):
        build_training(recipe, ranks=1, device="CPU:0")


def test_the_launcher_exits_2_before_starting_anything_when_the_builder_is_missing(tmp_path):
    recipe = write_builder(tmp_path, "dense_f", DENSE, "model: {builder: 'dense_f:build', input_shape: [3], "
                                                        "options: {depth: 2}}")
    done = subprocess.run(lms_launch_argv(recipe, "--run-dir", str(tmp_path / "run")), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "unknown key 'model.options.depth'" in done.stderr and not (tmp_path / "run").exists()


def test_the_own_step_example_rewrites_a_keras_application_gates_it_and_trains():
    """examples/own_step/own_step.py as docs/api.md tells a user to run it: a MobileNetV2 step of
    727 MiB by Grappler's estimate fits the example's 400 MiB device only rewritten; every swap-in and
    every recomputed op ran after its trigger on what TensorFlow executed; and the rewritten step
    trains. Its first loss is that of an untrained 10-class classifier, about ln 10."""
    example = REPO / "examples" / "own_step" / "own_step.py"
    done = subprocess.run([sys.executable, str(example)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"without LMS .* does NOT fit in 400\.00 MiB", out)
    assert re.search(r"with LMS .* fits in 400\.00 MiB", out)
    gated = re.search(r"swap-ins gated: (\d+)/(\d+)", out)
    assert gated and gated.group(1) == gated.group(2) and int(gated.group(1)) > 0
    recomputed = re.search(r"recomputed ops after their trigger: (\d+)/(\d+)", out)
    if recomputed:  # the planner may choose not to recompute; what it clones must be gated
        assert recomputed.group(1) == recomputed.group(2)
    losses = [float(v) for v in re.findall(r"step \d: loss ([0-9.]+)", out)]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert abs(losses[0] - np.log(10)) < 0.2
