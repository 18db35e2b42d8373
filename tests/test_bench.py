"""`lms-launch bench`: the search is exact and cheap; TensorFlow's own swapping is configured so that
it swaps; both commands write a table, a CSV and a chart whose figures agree with an independent
Grappler estimate; bad input writes nothing; the run judge runs real steps, detects an out-of-memory
and leaves no process behind."""
from __future__ import annotations

import dataclasses

import csv
import json
import math
from pathlib import Path

import keras
import psutil
import re
import pytest
import tensorflow as tf

from launcher.bench import command
from launcher.bench.floor import largest_working_set, variables_bytes
from launcher.bench.search import Probe, SizeGrid, largest_fitting
from launcher.bench.sizes import size_axis
from launcher.bench.steps import StepSource
from launcher.recipe import load_recipe
from lms_core.graph import Graph, Op, TensorInfo
from launcher.bench.papers import figures_for
from tests.fixtures import RECIPES
from benchmarks.architectures import conv_relu_step

MIB = 2**20
GIB = 2**30
TINY_UNET = ["--set", "model.input_shape=[16,16,16,4]", "--set", "model.levels=2", "--set", "model.base_filters=4"]


# --- the search ----------------------------------------------------------------------------------------

def threshold_judge(threshold: int, calls: list[int]):
    """Fits up to `threshold`, the way a memory judge does; records every size it is asked about."""

    def judge(size: int) -> Probe:
        calls.append(size)
        return Probe(size, size <= threshold, size * 1000, 0.0)

    return judge


def test_the_example_in_the_search_docstring_takes_12_probes():
    # From 256 to an answer of 1000, by hand: 256 fits, 512 fits, 1024 does not (gallop); then 9
    # halvings of the 512-wide bracket (512, 1024) down to one: 768, 896, 960, 992, 1008, 1000,
    # 1004, 1002, 1001. 12 in all.
    calls: list[int] = []
    result = largest_fitting(threshold_judge(1000, calls), SizeGrid(1, 1), start=256)
    assert calls == [256, 512, 1024, 768, 896, 960, 992, 1008, 1000, 1004, 1002, 1001]
    assert (result.largest, result.smallest_failing, result.bounded) == (1000, 1001, False)


@pytest.mark.parametrize("step", [1, 8, 32])
def test_the_search_is_exact_and_needs_few_probes(step):
    starts = [step, 7 * step, 64 * step, 256 * step]
    for threshold in list(range(step - 1, 300 * step, max(1, step // 2) * 7)) + [5000 * step + 3]:
        for start in starts:
            calls: list[int] = []
            result = largest_fitting(threshold_judge(threshold, calls), SizeGrid(step, step), start=start)
            expected = threshold - threshold % step if threshold >= step else None  # the largest grid size <= it
            assert result.largest == expected, (threshold, start)
            if expected is not None:  # the certificate: the next size up was probed and did not fit
                assert result.smallest_failing == expected + step
            assert len(calls) == len(set(calls)), "no size is probed twice"
            assert all(size % step == 0 and size >= step for size in calls)
            # The bound derived in launcher/bench/search.py: 2 log2(a) + 3 probes for an answer a (in
            # steps) above the start s, and its mirror image below: 2 log2(s) + 3. A linear scan would
            # need |a - s| + 2.
            answer, first = max(1, threshold // step), start // step
            assert len(calls) <= 2 * math.log2(max(answer, first)) + 3, (threshold, start, calls)


def test_a_bound_that_fits_ends_the_search_and_says_so():
    calls: list[int] = []
    result = largest_fitting(threshold_judge(10**9, calls), SizeGrid(4, 4, 100), start=8)
    assert result.largest == 100 and result.bounded and result.smallest_failing is None
    assert calls == [8, 16, 32, 64, 100]


def test_nothing_fits_and_a_start_below_the_minimum():
    calls: list[int] = []
    result = largest_fitting(threshold_judge(3, calls), SizeGrid(4, 8), start=64)
    assert result.largest is None and result.smallest_failing == 8
    assert calls == [64, 32, 16, 8]
    assert largest_fitting(threshold_judge(100, []), SizeGrid(4, 8), start=1).largest == 100


def test_a_good_guess_with_a_small_stride_takes_two_probes():
    calls: list[int] = []
    result = largest_fitting(threshold_judge(1440, calls), SizeGrid(1, 1), start=1440, stride=1)
    assert result.largest == 1440 and calls == [1440, 1441]
    calls.clear()
    result = largest_fitting(threshold_judge(1437, calls), SizeGrid(1, 1), start=1440, stride=1)
    assert result.largest == 1437 and calls == [1440, 1439, 1437, 1438]


def test_a_judge_that_is_not_monotone_still_gets_a_true_certificate():
    fits = {1: True, 2: True, 4: False, 3: True, 8: True}  # 8 "fits" but is never reached past 4
    result = largest_fitting(lambda size: Probe(size, fits.get(size, False), None, 0.0), SizeGrid(1, 1), start=1)
    assert (result.largest, result.smallest_failing) == (3, 4)


# --- sizes, steps and the floor ------------------------------------------------------------------------

def test_sizes_each_model_accepts():
    unet = load_recipe(RECIPES / "unet3d.yaml")
    axis = size_axis("max-resolution", unet)
    assert (axis.step, axis.smallest, axis.start, axis.dims) == (16, 16, 192, 3)  # 5 levels: 2^4
    assert axis.recipe_at(unet, 240).model.input_shape == [240, 240, 240, 4]
    assert axis.label(240) == "240^3" and axis.ratio(240, 192) == pytest.approx(1.953125)  # (240/192)^3
    resnet = load_recipe(RECIPES / "resnet50.yaml")
    axis = size_axis("max-resolution", resnet)
    assert (axis.step, axis.start, axis.dims) == (32, 224, 2)
    batch = size_axis("max-batch", resnet)
    assert (batch.step, batch.start, batch.recipe_at(resnet, 512).train.batch_size) == (1, 256, 512)
    assert batch.ratio(980, 196) == 5.0 and batch.label(980) == "batch 980"


def test_max_batch_builds_the_model_once_and_max_resolution_per_size():
    recipe = load_recipe(RECIPES / "unet3d-cpu.yaml", ["model.input_shape=[8,8,8,4]", "model.levels=2",
                                                       "model.base_filters=2"])
    batches = StepSource(size_axis("max-batch", recipe), recipe)
    specs = [batches.at(size).specs[0].shape.as_list() for size in (1, 3, 5)]
    assert batches.builds == 1 and specs == [[1, 8, 8, 8, 4], [3, 8, 8, 8, 4], [5, 8, 8, 8, 4]]
    sides = StepSource(size_axis("max-resolution", recipe), recipe)
    shapes = [sides.at(size).specs[0].shape.as_list() for size in (4, 6)]
    assert sides.builds == 2 and shapes == [[2, 4, 4, 4, 4], [2, 6, 6, 6, 4]]


def test_the_floor_is_the_largest_working_set_without_the_weights():
    f32 = lambda *shape: TensorInfo(shape, "float32", 4 * math.prod(shape))  # noqa: E731
    graph = Graph([
        Op("x", "Placeholder", outputs=[f32(10, 10)]),  # 400 bytes of batch input: counted
        Op("w", "ReadVariableOp", outputs=[f32(10, 50)]),  # 2000 bytes of weights: not counted here
        Op("h", "MatMul", inputs=["x:0", "w:0"], outputs=[f32(10, 50)]),  # 400 + 2000 out = 2400
        Op("r", "Relu", inputs=["h:0"], outputs=[f32(10, 50)]),  # 2000 in + 2000 out = 4000
        Op("s", "AddN", inputs=["r:0", "r:0"], outputs=[f32(10, 50)]),  # one distinct input: 2000 + 2000
    ], outputs=["s:0"])
    assert largest_working_set(graph) == ("r", 4000)
    layer = keras.layers.Dense(4)
    layer.build((None, 3))
    assert variables_bytes(layer.variables) == (3 * 4 + 4) * 4


# --- TensorFlow's own swapping -------------------------------------------------------------------------

def test_grappler_swapping_swaps_when_its_estimate_exceeds_the_device_and_not_otherwise():
    from lms_core.tf.estimate import estimate_peak
    from lms_core.tf.grappler_swapping import estimate_with_swapping

    # A 6-layer conv net, 64x64 inputs, 32 filters: every ReLU output is kept for the backward pass.
    step, specs = conv_relu_step((64, 64, 3), batch=64, blocks=6, filters=32, classes=10)
    concrete = step.get_concrete_function(*specs)  # `step` keeps the model, whose variables the trace reads
    graph_def = concrete.graph.as_graph_def()
    unswapped = estimate_peak(graph_def, concrete, 200 * MIB)
    # 64 x 64 x 64 x 32 floats: each ReLU output is 32 MiB, and the unswapped step needs more than 200 MiB.
    assert unswapped.device_bytes > 200 * MIB
    estimate, swapping = estimate_with_swapping(graph_def, concrete, 200 * MIB)
    assert swapping.swaps, "Grappler's SWAPPING_HEURISTICS inserted no swap where its estimate is over the device"
    nodes = {node.name: node for node in swapping.graph_def.node}
    relus = {node.name for node in graph_def.node if node.op == "Relu"}
    for swap in swapping.swaps:
        assert swap.tensor in relus  # the long-lived activations
        assert list(nodes[swap.swap_out].input) == [swap.tensor]
        assert nodes[swap.swap_in].input[0] == swap.swap_out and f"^{swap.trigger}" in nodes[swap.swap_in].input
        assert swap.swap_in in nodes[swap.consumer].input and swap.tensor not in nodes[swap.consumer].input
        assert {swap.swap_out, swap.swap_in} <= swapping.host_ops
    assert estimate.device_bytes < unswapped.device_bytes and estimate.host_bytes >= 32 * MIB
    # Where its estimate fits the device (1 GiB), the heuristic does nothing: it only swaps to fit.
    assert estimate_with_swapping(graph_def, concrete, 1 << 30)[1].swaps == []


# --- the command, end to end ---------------------------------------------------------------------------

def bench(tmp_path: Path, *args: str) -> Path:
    out = tmp_path / "out"
    assert command.main([*args, "--out", str(out)]) == 0
    return out


def grappler_fits(recipe_args: list[str], batch: int, memory: int) -> bool:
    """An independent judgement: the worker's own step at `batch`, estimated by Grappler directly."""
    from launcher.rank.training import build_training
    from lms_core.tf.estimate import estimate_peak

    recipe = load_recipe(RECIPES / "unet3d-cpu.yaml", [*recipe_args[1::2], f"train.batch_size={batch}"])
    keras.backend.clear_session()
    setup = build_training(recipe, ranks=1, device="CPU:0")
    concrete = setup.step.get_concrete_function(*setup.specs)
    return estimate_peak(concrete.graph.as_graph_def(), concrete, memory).fits


def read_csv(path: Path) -> dict[str, dict]:
    with path.open() as handle:
        return {row["configuration"] if row["configuration"] != "paper" else row["source"]: row
                for row in csv.DictReader(handle)}


def chart_bars(path: Path) -> list[dict]:
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (1100, 550)
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 20)) > 50  # drawn, not blank
        return json.loads(image.info["Description"])


def test_max_batch_end_to_end_on_a_tiny_unet(tmp_path, capsys):
    # --max 8: lms-launch would reach batch 21 in 9 probes; capped, it shows the same in 3.
    out = bench(tmp_path, "max-batch", str(RECIPES / "unet3d-cpu.yaml"), *TINY_UNET, "--device-memory", "8MiB",
                "--max", "8")
    printed = capsys.readouterr().out
    rows = read_csv(out / "results.csv")
    none, grappler, lms, floor = (rows[key] for key in ("none", "grappler", "lms-launch", "floor"))
    largest = int(none["largest_size"])
    # Exact, by TensorFlow's estimator asked directly: the found batch fits 8 MiB, the next does not.
    assert grappler_fits(TINY_UNET, largest, 8 * MIB) and not grappler_fits(TINY_UNET, largest + 1, 8 * MIB)
    assert int(none["peak_bytes"]) <= 8 * MIB
    for row in (none, grappler, lms):
        size = int(row["largest_size"])
        assert float(row["ratio_to_no_swapping"]) == pytest.approx(size / largest, abs=1e-4)
        assert int(row["floor_bytes"]) <= int(row["peak_bytes"]) <= 8 * MIB  # no estimate is below the floor
        assert row["judge"] == "estimate"
    assert int(lms["largest_size"]) > largest  # this model's step swaps its way past no swapping
    assert int(floor["largest_size"]) >= int(lms["largest_size"])  # no plan passes the floor
    assert float(none["overhead_nvlink2"]) == 0.0 and float(lms["overhead_pcie3"]) >= float(lms["overhead_nvlink2"])
    assert float(lms["samples_per_s"]) > 0 and lms["samples_per_s_kind"] == "predicted"
    assert rows["Le et al., TFLMS, arXiv 1807.02037"]["ratio_to_no_swapping"] == "2.0"
    table = (out / "results.md").read_text()
    assert "judge: estimate: TensorFlow Grappler's peak-memory estimate on a virtual GPU of 8.00 MiB" in table
    assert f"| no swapping | batch {largest} | 1.00x |" in table and "swap-ins gated: " in table
    bars = chart_bars(out / "results.png")
    assert [bar["ratio"] for bar in bars[:4]] == pytest.approx(
        [float(row["ratio_to_no_swapping"]) for row in (none, grappler, lms, floor)], abs=1e-4)  # the CSV rounds
    assert bars[-1] == {"label": "Le et al., TFLMS, arXiv 1807.02037: 2x larger batch size", "ratio": 2.0,
                        "size": None, "source": "paper"}
    probes = list(csv.DictReader((out / "probes.csv").open()))
    assert len([p for p in probes if p["configuration"] == "none"]) == int(none["probes"])
    assert sum(f"[bench]   none " in line for line in printed.splitlines()) == int(none["probes"])  # one line each
    plan = json.loads((out / "plan-lms-launch.json").read_text())
    assert plan["swap_count"] > 0 and plan["verification"]["gated"] == plan["verification"]["swap_ins"]
    assert not list(tmp_path.glob(".out.partial-*"))


def test_max_resolution_end_to_end_on_a_tiny_unet(tmp_path):
    out = bench(tmp_path, "max-resolution", str(RECIPES / "unet3d-cpu.yaml"), *TINY_UNET, "--device-memory", "6MiB",
                "--configs", "none,lms-launch", "--links", "nvlink2", "--max", "24")  # lms-launch reaches 30^3 uncapped
    rows = read_csv(out / "results.csv")
    none, lms = rows["none"], rows["lms-launch"]
    side = int(none["largest_size"])
    assert side % 2 == 0 and none["size"] == f"{side}^3"  # 2 levels: sides in steps of 2
    assert float(lms["ratio_to_no_swapping"]) == pytest.approx((int(lms["largest_size"]) / side) ** 3, abs=1e-3)
    assert int(none["peak_bytes"]) <= 6 * MIB
    report = json.loads((out / "bench.json").read_text())
    probes = {p["size"]: p for p in report["results"][0]["probes"]}
    assert probes[side]["fits"] and not probes[side + 2]["fits"]  # the certificate, one step apart
    assert probes[side + 2]["peak_bytes"] > 6 * MIB
    assert "ISMM 2019" in (out / "results.md").read_text()
    # The chart ends with the published figures that measured the same thing, and only those.
    published = [bar for bar in chart_bars(out / "results.png") if bar["source"] == "paper"]
    same_kind = [f for f in figures_for("unet3d", "max-resolution") if f.kind == "max-resolution"]
    assert [bar["ratio"] for bar in published] == [f.ratio for f in same_kind] and same_kind


@pytest.mark.parametrize("args, message", [
    (["max-width", "unet3d-cpu.yaml"], "argument kind: invalid choice: 'max-width'"),
    (["max-batch", "nope.yaml"], "nope.yaml: no such recipe file"),
    (["max-batch", "unet3d-cpu.yaml", "--set", "train.batchsize=2"], "did you mean 'train.batch_size'"),
    (["max-batch", "unet3d-cpu.yaml", "--configs", "none,tflms"], "--configs 'none,tflms'"),
    (["max-batch", "unet3d-cpu.yaml", "--link", "pcie9"], "--link: unknown link 'pcie9'"),
    (["max-batch", "unet3d-cpu.yaml", "--links", "nvlink2,ethernet"], "--links: unknown link 'ethernet'"),
    (["max-batch", "unet3d-cpu.yaml", "--device", "k80"], "--device: 'k80' is not a device profile"),
    (["max-batch", "unet3d-cpu.yaml", "--device-memory", "lots"], "--device-memory: 'lots' is not a size"),
    (["max-resolution", "unet3d-cpu.yaml", "--step", "6"], "--step 6: must be a positive multiple of 8"),
    (["max-batch", "unet3d-cpu.yaml", "--min", "8", "--max", "4"], "--max 4: must be a multiple of the step 1 and "
                                                                   "at least --min 8"),
    (["max-batch", "unet3d-cpu.yaml", "--judge", "run", "--run-steps", "2"], "--run-steps 2: must be more than"),
    (["max-batch", "unet3d-cpu.yaml", "--set", "lms.memory_ratio=2"], "lms.memory_ratio: must be in (0, 1]"),
])
def test_bad_input_exits_2_names_the_problem_and_writes_nothing(tmp_path, capsys, args, message):
    args = [args[0], str(RECIPES / args[1]) if args[1].endswith(".yaml") and args[1] != "nope.yaml" else args[1],
            *args[2:]]
    assert command.main([*args, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_out_dir_with_files_is_refused(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert command.main(["max-batch", str(RECIPES / "unet3d-cpu.yaml"), "--out", str(tmp_path / "out")]) == 2
    assert "already holds files" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_the_cli_runs_bench(tmp_path, capsys):
    from launcher import cli

    assert cli.main(["bench", "max-batch", str(RECIPES / "unet3d-cpu.yaml"), "--configs", "tflms"]) == 2
    assert "--configs 'tflms'" in capsys.readouterr().err


# --- the run judge, on this machine's CPU ----------------------------------------------------------------

def test_a_probe_command_and_environment(tmp_path):
    from launcher.bench.run_judge import RunSetting, out_of_memory, probe_command, probe_environment

    recipe = load_recipe(RECIPES / "unet3d.yaml")
    setting = RunSetting(recipe_path=RECIPES / "unet3d.yaml", recipe=recipe, overrides=["train.seed=7"],
                         axis=size_axis("max-resolution", recipe), workdir=tmp_path, steps=5, skip_steps=2,
                         timeout_s=60, on_gpu=False, device_memory_bytes=48 * MIB,
                         lms_overrides=["lms.host_memory=512GiB", "lms.link=nvlink2"])
    argv = probe_command(setting, "lms-launch", 240, tmp_path / "p")
    assert argv[1:7] == ["-m", "launcher.bench.probe_worker", "--memory-optimizer", "off", "--",
                         str((RECIPES / "unet3d.yaml").resolve())]
    entries = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
    assert entries == ["train.seed=7", "model.input_shape=[240,240,240,4]", "train.steps=5", "logging.skip_steps=2",
                       "logging.interval=3", "logging.tensorboard=false", "logging.progress=false", "distributed.np=1",
                       "distributed.hosts=null", "distributed.hostfile=null", "checkpoint.dir=null",
                       "lms.enabled=true", "lms.mode=auto", "lms.host_memory=512GiB", "lms.link=nvlink2"]
    assert probe_command(setting, "grappler", 240, tmp_path / "p")[4] == "swapping"
    assert probe_command(setting, "none", 240, tmp_path / "p")[-1] == "lms.enabled=false"
    assert load_recipe(RECIPES / "unet3d.yaml", entries).model.input_shape == [240, 240, 240, 4]
    assert probe_environment(setting)["TF_CPU_BFC_MEM_LIMIT_IN_MB"] == "48"
    # On a GPU the same --device-memory holds the GPU instead (one logical device of that size).
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TF_CPU_BFC_MEM_LIMIT_IN_MB", raising=False)
        on_gpu = probe_environment(dataclasses.replace(setting, on_gpu=True, device_memory_bytes=16 << 30))
    assert on_gpu["LMS_LAUNCH_GPU_MEMORY_LIMIT_MB"] == "16384" and "TF_CPU_BFC_MEM_LIMIT_IN_MB" not in on_gpu
    # TensorFlow's out-of-memory warnings stay visible whatever level the user set, as the judge reads them.
    for user, probe in (("3", "1"), ("2", "1"), ("0", "0"), (None, "1")):
        with pytest.MonkeyPatch.context() as patch:
            if user is None:
                patch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
            else:
                patch.setenv("TF_CPP_MIN_LOG_LEVEL", user)
            assert probe_environment(setting)["TF_CPP_MIN_LOG_LEVEL"] == probe
    crashed = ("W bfc_allocator.cc:497] Allocator (bfc_cpu_allocator_for_gpu) ran out of memory trying to allocate "
               "16B (rounded to 256)requested by op mul_2\nSegmentation fault")
    assert out_of_memory(crashed).startswith("ran out of memory trying to allocate 16B")
    assert out_of_memory("Traceback ...\nValueError: bad shape") is None



def test_the_run_judge_runs_real_steps_detects_out_of_memory_and_leaves_nothing_running(tmp_path):
    # The CPU recipe's U-Net at 32^3, batch 2, peaks near 76 MiB on TensorFlow's CPU allocator, and
    # batch 4 near 144 MiB (measured with the worker, LMS off, 2026-11-24): held to 100 MiB, batch 2
    # trains and batch 4 runs out of memory, as on a full GPU.
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    out = bench(tmp_path, "max-batch", str(RECIPES / "unet3d-cpu.yaml"), "--judge", "run", "--device-memory", "100MiB",
                "--configs", "none,lms-launch", "--step", "2", "--max", "4", "--run-steps", "3", "--no-floor-bound")
    rows = read_csv(out / "results.csv")
    none, lms = rows["none"], rows["lms-launch"]
    assert (none["judge"], none["largest_size"], none["samples_per_s_kind"]) == ("run", "2", "measured")
    assert float(none["samples_per_s"]) > 0 and 0 < int(none["peak_bytes"]) <= 100 * MIB
    assert int(none["floor_bytes"]) < int(none["peak_bytes"])
    report = json.loads((out / "bench.json").read_text())
    probes = {p["size"]: p for p in report["results"][0]["probes"]}
    assert not probes[4]["fits"] and "OOM when allocating tensor" in probes[4]["out_of_memory"]
    assert probes[4]["detail"].startswith("out of memory: OOM when allocating tensor with shape[4,")
    # lms-launch trained on the split CPU devices with its plan checked (it saves no memory on one
    # allocator, so batch 4 may or may not fit; batch 2 must).
    assert lms["largest_size"] in ("2", "4") and float(lms["samples_per_s"]) > 0
    assert "swap-ins gated" in report["results"][1]["probes"][0]["detail"]
    table = (out / "results.md").read_text()
    assert "judge: run: 3 real training steps per probe in a fresh process on this machine's CPU" in table
    assert "Grappler memory optimizer NO_MEM_OPT" in (out / "probes" / "none-2" / "output.log").read_text()
    assert [c.pid for c in psutil.Process().children(recursive=True) if c.pid not in before] == []  # none left


def test_a_probe_sets_grappler_s_memory_optimizer_for_the_functions_it_runs():
    import threading

    from launcher.bench.probe_worker import memory_optimizer_in_force, set_memory_optimizer

    seen = []

    def probe(mode: str) -> None:  # function-call options are per thread: this test's own stay untouched
        set_memory_optimizer(mode)
        seen.append(memory_optimizer_in_force())

    for mode in ("swapping", "off"):
        thread = threading.Thread(target=probe, args=(mode,))
        thread.start()
        thread.join()
    assert seen == ["SWAPPING_HEURISTICS", "NO_MEM_OPT"]
    assert memory_optimizer_in_force() == "DEFAULT_MEM_OPT"


def test_sigterm_during_a_probe_ends_the_probe_too_and_writes_nothing(tmp_path):
    import signal
    import subprocess
    import time

    from tests.fixtures import lms_launch_argv

    out = tmp_path / "out"
    bench_process = subprocess.Popen(
        lms_launch_argv("bench", "max-batch", str(RECIPES / "unet3d-cpu.yaml"), "--judge", "run", "--configs", "none",
                        "--max", "2", "--out", str(out)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    probe = None
    deadline = time.monotonic() + 60
    while probe is None and time.monotonic() < deadline:  # wait until the probe's worker is running
        time.sleep(0.2)
        probe = next((p for p in psutil.Process(bench_process.pid).children(recursive=True)
                      if "launcher.bench.probe_worker" in " ".join(p.cmdline())), None)
    assert probe is not None, "no probe process started"
    bench_process.send_signal(signal.SIGTERM)
    output, _ = bench_process.communicate(timeout=30)
    assert bench_process.returncode == 143, output
    assert "stopped by SIGTERM; nothing was written" in output
    # The probe's group was sent SIGKILL; a grandchild may take a moment to go on a loaded machine.
    _, alive = psutil.wait_procs([probe], timeout=10)
    assert all(p.status() == psutil.STATUS_ZOMBIE for p in alive if psutil.pid_exists(p.pid))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not tf.config.list_physical_devices("GPU"), reason="no GPU visible to TensorFlow")
def test_on_a_gpu_the_auto_judge_runs_each_candidate_and_finds_the_gpu_s_own_limit(tmp_path):
    # The CPU U-Net recipe at a batch far past any GPU's memory (a 32^3 x 16-channel activation is
    # 2 MiB a sample): no swapping must run out of memory on the GPU itself before batch 65536.
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    out = bench(tmp_path, "max-batch", str(RECIPES / "unet3d-cpu.yaml"), "--configs", "none", "--max", "65536",
                "--no-floor-bound")
    rows = read_csv(out / "results.csv")
    assert rows["none"]["judge"] == "run" and rows["none"]["samples_per_s_kind"] == "measured"
    report = json.loads((out / "bench.json").read_text())
    assert report["judge_text"].startswith("run: 5 real training steps per probe in a fresh process on ")
    failed = [p for p in report["results"][0]["probes"] if not p["fits"]]
    assert failed and all("OOM when allocating" in p["out_of_memory"] or "ran out of memory" in p["out_of_memory"]
                          for p in failed)
    assert [c.pid for c in psutil.Process().children(recursive=True) if c.pid not in before] == []  # none left


def test_real_runs_plan_for_this_machine_s_host_memory_unless_told():
    """A probe pins what its plan parks on the host: planned for a 512 GiB host on a 125 GiB machine,
    an H200's probe at batch 1024 asked for 64 GiB of pinned memory at once and was killed
    (benchmarks/results/gpu-h200-bench-max-batch.txt). Estimates keep a host that bounds nothing."""
    from launcher.bench.command import parser, resolve, run_setting

    recipe = str(RECIPES / "unet3d-cpu.yaml")

    def host_memory(*flags: str) -> int:
        argv = ["max-batch", recipe, *flags]
        return resolve(parser().parse_args(argv), argv).host_memory_bytes

    assert host_memory("--judge", "run") == psutil.virtual_memory().total
    assert host_memory("--judge", "estimate") == 512 * GIB
    assert host_memory("--judge", "run", "--host-memory", "64GiB") == 64 * GIB
    argv = ["max-batch", recipe, "--judge", "run"]
    setting = run_setting(resolve(parser().parse_args(argv), argv), Path("/tmp"))
    assert f"lms.host_memory={psutil.virtual_memory().total}" in setting.lms_overrides


def test_a_probe_failing_for_another_reason_keeps_the_probes_logs_the_error_names(tmp_path, capsys):
    """No results, but the log the error points to exists: the probes' folders are moved beside --out."""
    from launcher.bench import command

    out = tmp_path / "out"
    status = command.main(["max-batch", str(RECIPES / "unet3d-cpu.yaml"), "--judge", "run", "--configs", "none",
                           "--max", "2", "--run-steps", "3", "--no-floor-bound", "--out", str(out),
                           "--set", "data.source=tfrecord", "--set", f"data.path={tmp_path / 'no-such-records'}"])
    err = capsys.readouterr().err
    assert status == 1 and not out.exists()
    kept = tmp_path / "out.probes"
    assert f"the probes' logs are kept in {kept}/" in err
    named = re.search(r"its output is in (\S+output\.log)", err).group(1)
    assert named.startswith(str(kept)) and "no-such-records" in Path(named).read_text()
