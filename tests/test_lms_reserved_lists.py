"""Gradient loops' zero lists left unset until each loop fills its own (lms_core.reserved_lists).

TensorFlow gives a gradient loop the gradient of a list its forward loop read (an RNN's unstacked
input) as `ZerosLike(list)`: the whole list in zeros, made when the forward loop ends and held until
that gradient loop runs. The rewrite makes it a `TensorListReserve` of unset elements, which the loop
fills as it goes. The expectations here are derived by hand from the graph (which list is whose, and
what is on the device while each gradient loop runs) and from TensorFlow itself (the same step
without the rewrite, the partition graphs it executes, its CPU allocator)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

import lms_core.tf as lms_tf
from lms_core.config import LMSConfig
from lms_core.graph import Graph, Op, TensorInfo, TensorList
from lms_core.link import link_named
from lms_core.loops import filled_lists, gradient_lists, list_bytes, unseen_bytes
from lms_core.passes.pipeline import analyze
from lms_core.plan import Plan
from lms_core.reserved_lists import plan_reserved_lists, with_reserved_lists
from lms_core.simulator import simulate
from lms_core.tf.gating import verify_gating
from benchmarks.architectures import rolled_lstm, training_step
from tests.fixtures import COMPUTE, HOST, assert_bit_identical, rolled_lstm_and_rewrite, unit_costs

ROOT = Path(__file__).resolve().parent.parent


def list_info(length: int, shape: tuple[int, ...]) -> TensorInfo:
    tensor_list = TensorList(shape, "float32", int(np.prod(shape)) * 4, length)
    return TensorInfo((), "variant", list_bytes(tensor_list), tensor_list=tensor_list)


UNSIZED = TensorInfo((), "variant", None)
H = TensorInfo((8, 32), "float32", 8 * 32 * 4)


def two_layer_graph() -> Graph:
    """Two recurrent layers of 10 steps, by hand: layer a reads an 8-wide input, layer b reads a's
    [8, 32] output. Each forward loop leaves one accumulator (a: 10 x [8, 32] = 10240 bytes, b:
    10 x [8, 64] = 20480) and passes on the list it read (unsized); each gradient loop gets a zero
    list of that list's gradient (b: 10 x [8, 32] = 10240, a: 10 x [8, 8] = 2560) and fills it.
    The gradient loops run b first, then a."""
    ops = [Op("x", "Placeholder", outputs=[TensorInfo((8, 80), "float32", 8 * 80 * 4)]),
           Op("loop_a", "While", inputs=["x:0"], outputs=[H, list_info(10, (8, 32)), UNSIZED]),
           Op("loop_b", "While", inputs=["loop_a:0"], outputs=[H, list_info(10, (8, 64)), UNSIZED]),
           Op("loss", "Sum", inputs=["loop_b:0"], outputs=[TensorInfo((), "float32", 4)]),
           Op("gradient_tape/seed", "OnesLike", inputs=["loss:0"], outputs=[TensorInfo((), "float32", 4)]),
           Op("zeros_b", "ZerosLike", inputs=["loop_b:2"], outputs=[list_info(10, (8, 32))]),
           Op("zeros_a", "ZerosLike", inputs=["loop_a:2"], outputs=[list_info(10, (8, 8))]),
           Op("gradient_tape/grad_b", "While", inputs=["gradient_tape/seed:0", "loop_b:1", "zeros_b:0"],
              outputs=[H, UNSIZED, UNSIZED]),
           Op("gradient_tape/grad_a", "While", inputs=["gradient_tape/grad_b:0", "loop_a:1", "zeros_a:0"],
              outputs=[H, UNSIZED, UNSIZED]),
           Op("w_handle", "Placeholder", outputs=[TensorInfo((), "resource", None)]),
           Op("update", "AssignSubVariableOp", inputs=["w_handle:0", "gradient_tape/grad_a:0"])]
    return analyze(Graph(ops, outputs=["loss:0"]))


def test_each_zero_list_read_by_one_gradient_loop_is_left_unset_and_filled_by_that_loop():
    graph = two_layer_graph()
    entries = {e.op: (e.source, e.gradient_loop, e.loop_index, e.nbytes) for e in plan_reserved_lists(graph)}
    assert entries == {"zeros_b": ("loop_b:2", "gradient_tape/grad_b", 2, 10240),
                       "zeros_a": ("loop_a:2", "gradient_tape/grad_a", 2, 2560)}

    rewritten = with_reserved_lists(graph, plan_reserved_lists(graph))
    assert rewritten["zeros_b"].type == "TensorListReserve" and rewritten["zeros_b"].inputs == ["loop_b:2"]
    assert rewritten["zeros_b"].outputs[0].nbytes is None  # no element buffer of its own
    assert gradient_lists(rewritten) == ()
    assert filled_lists(rewritten) == (("gradient_tape/grad_b", 10240), ("gradient_tape/grad_a", 2560))
    assert with_reserved_lists(rewritten, plan_reserved_lists(graph)) is rewritten  # applied once only


def test_the_peak_figure_counts_one_gradient_loops_list_at_a_time():
    graph = two_layer_graph()
    rewritten = with_reserved_lists(graph, plan_reserved_lists(graph))
    both = {"loop_a:1", "loop_b:1"}
    # Without the rewrite the two zero lists are there from the forward pass on; the swapped
    # accumulators come back one gradient loop at a time: 10240 + 2560 + max(20480, 10240).
    before = unseen_bytes(graph, both)
    assert (before.baseline_bytes, before.lms_bytes) == (10240 + 20480 + 10240 + 2560, 12800 + 20480)
    # With it, each loop holds its own accumulator and its own list: max(20480 + 10240, 10240 + 2560).
    after = unseen_bytes(rewritten, both)
    assert (after.baseline_bytes, after.lms_bytes, after.host_bytes) == (43520, 30720, 30720)
    assert after.unset_list_bytes == after.gradient_list_bytes == 12800
    # Nothing swapped: both accumulators stay, and the larger list counts once.
    assert unseen_bytes(rewritten, set()).lms_bytes == 10240 + 20480 + 10240


def test_the_simulator_allocates_the_list_when_its_gradient_loop_starts():
    graph = two_layer_graph()
    entries = plan_reserved_lists(graph)
    result = simulate(graph, Plan(settings={}, reserved_lists=entries), unit_costs(graph), link_named("pcie3"),
                      keep_events=True)
    starts = {op: start for op, start, _ in result.executed}
    allocated = {e.buffer: (e.time, e.nbytes) for e in result.memory_events if e.nbytes > 0}
    assert "zeros_b:0" not in allocated and "zeros_a:0" not in allocated
    assert allocated["gradient_tape/grad_b:2"] == (starts["gradient_tape/grad_b"], 10240)
    assert allocated["gradient_tape/grad_a:2"] == (starts["gradient_tape/grad_a"], 2560)
    # Unrewritten, the zero lists are made right after their forward loops, before the loss.
    unrewritten = simulate(graph, Plan(settings={}), unit_costs(graph), link_named("pcie3"), keep_events=True)
    made = {e.buffer: e.time for e in unrewritten.memory_events if e.nbytes > 0}
    loss_at = {op: start for op, start, _ in unrewritten.executed}["loss"]
    assert made["zeros_a:0"] < loss_at


LSTM = dict(batch=4, steps=8, features=6, units=16)
SWAP_ALL = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, swapin_ahead=1, min_tensor_bytes=0)


def test_on_split_devices_training_is_bit_identical_and_the_reserve_is_what_runs():
    expected, model_a, rewritten, model_b, batch = rolled_lstm_and_rewrite(SWAP_ALL, **LSTM)
    # The second layer's loop reads the first layer's outputs: one zero list, 8 steps of [4, 16].
    (entry,) = rewritten.plan.reserved_lists
    assert entry.nbytes == 8 * 4 * 16 * 4 and entry.gradient_loop.endswith("_grad")
    nodes = {node.name: node for node in rewritten.graph_def.node}
    reserve = nodes[entry.op]
    assert reserve.op == "TensorListReserve"
    assert [nodes[name].op for name in reserve.input] == ["TensorListElementShape", "TensorListLength"]
    assert {nodes[name].input[0] for name in reserve.input} == {entry.source.removesuffix(":0")}

    # Exactly: an unset element adds as zero.
    assert_bit_identical([float(rewritten(*batch)) for _ in range(3)], expected, model_b.variables, model_a.variables)
    report = verify_gating(rewritten, *batch)
    assert (report.lists_unset, report.lists_checked) == (1, 1)
    assert report.gated == len(report.gates) == rewritten.plan.swap_in_count
    assert "zero lists left unset until filled: 1/1" in report.verification().describe()


def test_turned_off_the_zero_list_stays():
    _, _, step, specs, _ = training_step(rolled_lstm(**LSTM), device=COMPUTE)
    config = LMSConfig(enabled=True, mode="manual", min_tensor_bytes=0, reserve_gradient_lists=False)
    rewritten = lms_tf.rewrite(step, *specs, config=config, compute_device=COMPUTE, host_device=HOST)
    assert rewritten.plan.reserved_lists == []
    assert [n.op for n in rewritten.graph_def.node if n.name == "zeros_like"] == ["ZerosLike"]


def test_tensorflows_cpu_allocator_holds_each_list_only_while_its_own_loop_runs():
    """The real allocator's peak over a step, in a fresh process with one thread and the loops run one
    iteration at a time (benchmarks/loop_sizing.py), on three stacked LSTM layers of 128 steps of
    [64, 128]: the second and third layers' loops read [64, 128] inputs, so two zero lists of 4 MiB.
    Without the rewrite both are made in the forward pass. With it, the third layer's list fills
    while its gradient loop runs, where the step peaks (every accumulator is still there), and the
    second layer's does not exist yet: the peak drops by one list at least. (Narrow layers keep the
    weight-gradient temporaries, whose order varies from run to run, small beside the lists: the
    allocation trace at the peak differs by the two lists and by up to 3 MiB of [256, 1024] optimizer
    products at 256 units. Three runs here dropped 1.77, 1.82 and 2.07 lists; one of the first run of
    each, on a machine busy with other tests, 0.85. So the medians of three runs each are compared.)"""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "loop_sizing.py"), "--one", "64,128,128", "--layers", "3",
         "--repeats", "3"], capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    one_list = 128 * 64 * 128 * 4
    assert (measured["unset_lists"], measured["gradient_lists"]) == (2, 2 * one_list)
    without = statistics.median(measured["peaks_one_iteration"])
    unset = statistics.median(measured["peaks_unset_lists"])
    assert without - unset >= one_list, (measured["peaks_one_iteration"], measured["peaks_unset_lists"])
