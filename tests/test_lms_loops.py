"""Loop accumulators (lms_core.loops, lms_core.tf.loops): what a forward `While` keeps for its gradient
loop is sized from element shape x trip count, swapped out after the forward loop and back, gated by
a backward op, just before its own gradient loop; numerics and gating on split devices.

The expected accumulators are derived by hand from the gradients: for h' = tanh(h * w) the gradient
loop needs, per step, the tanh output (tanh' = 1 - y^2) and h (d(h * w)/dw = h), while w, read once
outside the loop, is loop-invariant and not accumulated. For a Keras LSTM cell it needs the gates
i, f, g, o, tanh(c), the previous c and h, and the step's input x_t: 8 lists per layer."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import lms_core.tf as lms_tf
from lms_core.config import LMSConfig
from lms_core.graph import BACKWARD, FORWARD, Graph, Op, TensorInfo, TensorList
from lms_core.loops import accumulators, filled_lists, gradient_lists, list_bytes, unseen_bytes
from lms_core.passes.pipeline import analyze
from lms_core.planner import plan_swaps
from lms_core.tf.graphdef import KEEP_ATTR
from lms_core.tf.gating import verify_gating
from benchmarks.architectures import rolled_lstm, training_step
from tests.fixtures import COMPUTE, HOST, assert_same_training, rolled_lstm_and_rewrite

SWAP_ALL = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, swapin_ahead=1, min_tensor_bytes=0)
SWAP_LOOPS = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, swapin_ahead=1, min_tensor_bytes=0,
                       include_types=["While", "StatelessWhile"])  # the loops' outputs only
BATCH, UNITS, STEPS = 2, 3, 4


def tiny_loop_step(device: str | None = None):
    """h <- tanh(h * w), STEPS times, from h = x; loss = sum(h^2); w -= 0.1 * dloss/dw. (step, specs, w).
    The square makes the gradient entering the loop depend on data (2h), so a backward op that is
    not folded to a constant runs before the gradient loop to gate the copies back."""
    with tf.device(device):
        w = tf.Variable(tf.linspace(0.5, 1.5, UNITS), name="w")

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            value = tf.identity(w)  # read once: loop-invariant inside the loop
            _, h = tf.while_loop(lambda t, h: t < STEPS, lambda t, h: (t + 1, tf.tanh(h * value)), (0, x),
                                 maximum_iterations=STEPS)
            loss = tf.reduce_sum(tf.square(h))
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss

    return step, (tf.TensorSpec([BATCH, UNITS]),), w


def test_structural_golden_of_accumulator_swaps_on_a_tiny_loop():
    step, specs, _ = tiny_loop_step()
    rewritten = lms_tf.rewrite(step, *specs, config=SWAP_LOOPS, compute_device="/device:GPU:0", host_device=HOST)
    graph = rewritten.concrete.graph
    (forward,) = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")
                  and not op.name.startswith("gradient_tape")]
    (backward,) = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")
                   and op.name.startswith("gradient_tape")]
    # The two lists the hand derivation expects, by what the body pushes onto them.
    body = graph._get_function(forward.get_attr("body").name).graph  # noqa: SLF001
    pushed = {op.inputs[1].op.type for op in body.get_operations() if op.type == "TensorListPushBack"}
    assert pushed == {"Tanh", "Placeholder"}

    accumulators_read = sorted(f"{forward.name}:{i}" for i, t in enumerate(forward.outputs)
                               if t.dtype == tf.variant and backward in t.consumers())
    assert [s.tensor for s in rewritten.plan.swaps] == accumulators_read and len(accumulators_read) == 2
    nodes = {n.name: n for n in rewritten.graph_def.node}
    for swap in rewritten.plan.swaps:
        # Sized by hand: STEPS elements of [BATCH, UNITS] float32.
        assert swap.nbytes == STEPS * BATCH * UNITS * 4 == 96
        assert swap.tensor_list == {"element_shape": [BATCH, UNITS], "element_dtype": "float32", "length": STEPS}
        (swap_in,) = swap.swap_ins
        assert swap_in.consumers == [backward.name]
        # Gated by the backward op right before the gradient loop: its latest backward input.
        trigger = graph.get_operation_by_name(swap_in.trigger)
        assert trigger in [t.op for t in backward.inputs] and trigger.name.startswith("gradient_tape")
        index = swap.tensor.rpartition(":")[2]
        out, back = nodes[swap.swap_out], nodes[swap_in.name]
        assert (out.op, list(out.input), out.device) == ("Identity", [f"{forward.name}:{index}"], HOST)
        assert (back.op, list(back.input), back.device) == ("Identity", [swap.swap_out, f"^{swap_in.trigger}"], HOST)
        assert all(n.attr[KEEP_ATTR].b and n.attr["T"].type == tf.variant.as_datatype_enum for n in (out, back))
        # The gradient loop reads the swap-in at the accumulator's input slot, through an Identity on
        # the compute device (so the lowered loop keeps the list there); nothing else reads the list.
        on_device = nodes[f"{swap_in.name}/on_device"]
        assert (on_device.op, list(on_device.input), on_device.device) == ("Identity", [swap_in.name], "/device:GPU:0")
        assert on_device.attr[KEEP_ATTR].b
        assert nodes[backward.name].input[[t.name for t in backward.inputs].index(swap.tensor)] == on_device.name
        assert [n.name for n in nodes.values() if f"{forward.name}:{index}" in n.input] == [swap.swap_out]


def test_the_tiny_loop_trains_identically_with_its_accumulators_on_the_host():
    step_a, specs, w_a = tiny_loop_step(COMPUTE)
    x = tf.random.stateless_uniform([BATCH, UNITS], seed=[3, 1])
    with tf.device(COMPUTE):
        expected = [float(step_a(x)) for _ in range(3)]
    step_b, _, w_b = tiny_loop_step(COMPUTE)
    rewritten = lms_tf.rewrite(step_b, *specs, config=SWAP_ALL, compute_device=COMPUTE, host_device=HOST)
    assert sum(s.tensor_list is not None for s in rewritten.plan.swaps) == 2
    np.testing.assert_allclose([float(rewritten(x)) for _ in range(3)], expected, rtol=1e-6)
    np.testing.assert_allclose(w_b.numpy(), w_a.numpy(), rtol=1e-6)
    assert not np.allclose(w_a.numpy(), np.linspace(0.5, 1.5, UNITS))  # it did train
    report = verify_gating(rewritten, x)
    swap_ins = rewritten.plan.swap_in_count
    assert (report.gated, len(report.gates)) == (swap_ins, swap_ins), report.verification().first_failure()


# The Keras LSTM cell's accumulators, per layer (module docstring): 8 float32 lists of STEPS elements.
LSTM = dict(batch=4, steps=8, features=6, units=16)


def lstm_accumulator_bytes(batch, steps, features, units) -> list[int]:
    """By hand: per layer 7 lists of [batch, units] (i, f, g, o, tanh(c), c_prev, h_prev) and one of
    the layer's input x_t ([batch, features] for the first layer, [batch, units] for the second)."""
    element = lambda width: batch * width * 4  # noqa: E731
    return sorted([steps * element(units)] * 7 + [steps * element(features)] + [steps * element(units)] * 8)


def test_lstm_accumulators_are_all_swapped_gated_and_the_numerics_hold_on_split_devices():
    expected, model_a, rewritten, model_b, batch = rolled_lstm_and_rewrite(SWAP_ALL, **LSTM)
    graph = rewritten.planning.graph
    lists = [s for s in rewritten.plan.swaps if s.tensor_list is not None]
    assert sorted(s.nbytes for s in lists) == lstm_accumulator_bytes(**LSTM)
    # Each layer's lists come back just before its own gradient loop: gated by that loop's input.
    for swap in lists:
        (swap_in,) = swap.swap_ins
        (loop,) = swap_in.consumers
        assert graph[loop].type in ("While", "StatelessWhile") and graph[loop].category == BACKWARD
        assert swap_in.trigger in {p for p in graph.predecessors(graph[loop])}
        assert loop.startswith(f"gradient_tape/{swap.tensor.rpartition(':')[0]}/")  # that layer's gradient loop
    # The second layer's gradient loop fills a zero list with the gradient of its input (the first
    # layer's outputs): 8 steps of [4, 16]. The first layer's input is data: no gradient, no list.
    # As traced it is made up front; the rewrite leaves it unset for that loop to fill (test_lms_reserved_lists).
    assert [(t.split("/")[0], n) for t, n in gradient_lists(rewritten.planning.traced)] == [("zeros_like:0", 2048)]
    assert [n for _, n in filled_lists(graph)] == [8 * 4 * 16 * 4]
    # The lists left on the device, with the reasons: the weights' (all one buffer) and the int32 ones.
    left = [s for s in rewritten.plan.skipped if "loop accumulator" in s.reason]
    assert len(left) == 4 + 4 and sum("one buffer" in s.reason for s in left) == 4

    assert_same_training([float(rewritten(*batch)) for _ in range(3)], expected, model_b.variables,
                         model_a.variables, rtol=1e-6)
    report = verify_gating(rewritten, *batch)
    swap_ins = rewritten.plan.swap_in_count
    assert (report.gated, len(report.gates)) == (swap_ins, swap_ins), report.verification().first_failure()
    assert {g.swap_in for g in report.gates} >= {s.swap_ins[0].name for s in lists}


def test_the_ungated_placement_of_accumulators_fails_the_check():
    _, _, step, specs, batch = training_step(rolled_lstm(**LSTM), device=COMPUTE)
    rewritten = lms_tf.rewrite(step, *specs, config=SWAP_LOOPS, compute_device=COMPUTE, host_device=HOST,
                               placement=lms_tf.Placement.UNGATED_ON_COMPUTE)
    assert len(rewritten.plan.swaps) == 16 and all(s.tensor_list for s in rewritten.plan.swaps)
    report = verify_gating(rewritten, *batch)
    assert (report.gated, len(report.gates)) == (0, 16)


def list_graph() -> Graph:
    """A forward loop with three lists for its gradient loop: 10 steps of [8, 32] float32, 10 of one
    variable's [32, 32] value (one buffer), and 10 int32 scalars."""
    fresh = TensorList((8, 32), "float32", 8 * 32 * 4, 10)
    weights = TensorList((32, 32), "float32", 32 * 32 * 4, 10, aliases="the value of a variable")
    counter = TensorList((), "int32", 4, 10)
    variant = lambda tl: TensorInfo((), "variant", list_bytes(tl), tensor_list=tl)  # noqa: E731
    # And the zero list the gradient loop fills with the gradient of a list the loop read: 10 of [8, 16].
    zeros = TensorList((8, 16), "float32", 8 * 16 * 4, 10)
    ops = [Op("x", "Placeholder", outputs=[TensorInfo((8, 32), "float32", 8 * 32 * 4)]),
           Op("loop", "While", inputs=["x:0"], outputs=[TensorInfo((8, 32), "float32", 1024), variant(fresh),
                                                      variant(weights), variant(counter)]),
           Op("loss", "Sum", inputs=["loop:0"], outputs=[TensorInfo((), "float32", 4)]),
           Op("gradient_tape/seed", "OnesLike", inputs=["loss:0"], outputs=[TensorInfo((), "float32", 4)]),
           Op("zeros_like", "ZerosLike", inputs=["loop:0"], outputs=[variant(zeros)]),
           Op("gradient_tape/loop_grad", "While",
              inputs=["gradient_tape/seed:0", "loop:1", "loop:2", "loop:3", "zeros_like:0"],
              outputs=[TensorInfo((8, 32), "float32", 1024)]),
           Op("w_handle", "Placeholder", outputs=[TensorInfo((), "resource", None)]),
           Op("update", "AssignSubVariableOp", inputs=["w_handle:0", "gradient_tape/loop_grad:0"])]
    return analyze(Graph(ops, outputs=["loss:0"]))


def test_accumulator_sizing_by_hand():
    graph = list_graph()
    assert (graph["loop"].category, graph["gradient_tape/loop_grad"].category) == (FORWARD, BACKWARD)
    found = {a.tensor: a.nbytes for a in accumulators(graph)}
    assert found == {"loop:1": 10 * 8 * 32 * 4, "loop:2": 0, "loop:3": 10 * 4}
    assert gradient_lists(graph) == (("zeros_like:0", 10 * 8 * 16 * 4),)
    none = unseen_bytes(graph, set())
    assert (none.baseline_bytes, none.lms_bytes, none.host_bytes, none.count) == (
        10240 + 40 + 5120, 10240 + 40 + 5120, 0, 3)
    parked = unseen_bytes(graph, {"loop:1"})
    # Parked on the host, it comes back for its gradient loop: the peak figure keeps it once.
    assert (parked.lms_bytes, parked.host_bytes, parked.swapped) == (10240 + 40 + 5120, 10240, 1)
    assert "loop accumulator" in parked.describe()


def test_the_planner_swaps_the_fresh_list_and_says_why_not_the_others():
    plan = plan_swaps(list_graph(), SWAP_ALL)
    assert [(s.tensor, s.nbytes, s.dtype, s.shape) for s in plan.swaps] == [("loop:1", 10240, "variant", [])]
    reasons = {s.tensor: s.reason for s in plan.skipped}
    assert "one buffer" in reasons["loop:2"] and "int32" in reasons["loop:3"]
    assert plan.swaps[0].swap_ins[0].trigger == "gradient_tape/seed"


def test_a_waiting_plan_reads_an_accumulator_on_the_device_with_tensorlistlength():
    step, specs, _ = tiny_loop_step(COMPUTE)
    config = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, swapin_ahead=1, min_tensor_bytes=0,
                       sync_mode=2)
    rewritten = lms_tf.rewrite(step, *specs, config=config, compute_device=COMPUTE, host_device=HOST)
    nodes = {n.name: n for n in rewritten.graph_def.node}
    arrivals = [s.swap_ins[0].arrival for s in rewritten.plan.swaps if s.tensor_list and s.swap_ins[0].arrival]
    assert arrivals and all(nodes[a].op == "TensorListLength" and nodes[a].device == COMPUTE for a in arrivals)
    x = tf.random.stateless_uniform([BATCH, UNITS], seed=[3, 1])
    assert np.isfinite(float(rewritten(x)))


def test_the_ir_holds_only_the_ops_tensorflow_runs():
    """TensorFlow prunes a function body to what its outputs, control outputs and stateful ops need
    before running it (and Grappler's estimate schedules only that); the IR holds the same ops. Keras
    leaves such dead ops in every RNN (its cell called once outside the loop): the simulator replayed
    them between the ops that run (issue 18)."""
    w = tf.Variable(tf.ones([UNITS]), name="w")

    @tf.function
    def step(x):
        dead = tf.matmul(x, x, transpose_b=True, name="dead")  # read by nothing
        tf.tanh(dead, name="dead_too")
        with tf.GradientTape() as tape:
            value = tf.identity(w)  # read once: loop-invariant inside the loop
            _, h = tf.while_loop(lambda t, h: t < STEPS, lambda t, h: (t + 1, tf.tanh(h * value)), (0, x),
                                 maximum_iterations=STEPS)
            loss = tf.reduce_sum(tf.square(h), name="loss")
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss

    traced = lms_tf.trace_step(step, tf.TensorSpec([BATCH, UNITS]))
    in_function = {op.name for op in traced.concrete.graph.get_operations()}
    assert {"dead", "dead_too"} <= in_function
    assert not {"dead", "dead_too"} & traced.graph.ops.keys()
    # What runs stays: the loop with its two accumulators (tanh(h * w) and h), the update.
    assert len(accumulators(traced.graph)) == 2
    assert any(op.type == "AssignSubVariableOp" for op in traced.graph.ops.values())


def test_no_swap_in_is_triggered_by_a_loop_tensorflow_lowers_away():
    """Walking far back from the first layer's gradient loop reaches the second layer's: a `While`,
    which TensorFlow lowers to v1 control flow before running, so no executed op has its name and a
    swap-in it triggered would not be gated. The walk passes over loops; every swap-in stays gated."""
    _, _, step, specs, batch = training_step(rolled_lstm(**LSTM), device=COMPUTE)
    far_ahead = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, swapin_ahead=4, min_tensor_bytes=0,
                          include_types=["While", "StatelessWhile"])
    rewritten = lms_tf.rewrite(step, *specs, config=far_ahead, compute_device=COMPUTE, host_device=HOST)
    graph = rewritten.planning.graph
    triggers = {s.trigger for swap in rewritten.plan.swaps for s in swap.swap_ins}
    assert len(rewritten.plan.swaps) == 16 and not {graph[t].type for t in triggers} & {"While", "StatelessWhile"}
    report = verify_gating(rewritten, *batch)
    assert (report.gated, len(report.gates)) == (16, 16), report.verification().first_failure()


def test_a_transpose_pair_grappler_folds_is_no_trigger():
    """Stacked Keras RNNs: the gradient of one layer's batch-to-time Transpose feeds the next layer's
    time-to-batch one; Grappler's arithmetic optimizer removes the pair (seen at batch 544 of
    recipes/seq2seq.yaml: 16 swap-ins gated by one of them waited for nothing). Neither is a trigger."""
    from lms_core.planner import latest_backward_inputs, transpose_pairs

    def op(name, type_, *inputs):
        return Op(name, type_, inputs=list(inputs), outputs=[TensorInfo((2, 3), "float32", 24)])

    graph = Graph([op("x", "Placeholder"), op("grad", "Tanh", "x:0"), op("to_time", "Transpose", "grad:0"),
                   op("to_batch", "Transpose", "to_time:0"), op("alone", "Transpose", "grad:0"),
                   op("loop_input", "TensorListFromTensor", "to_batch:0", "alone:0")], outputs=["loop_input:0"])
    for node in graph.ops.values():
        node.category, node.region = (BACKWARD if node.name != "x" else FORWARD), None
    for level, name in enumerate(["x", "grad", "to_time", "alone", "to_batch", "loop_input"]):
        graph[name].level = level
    assert transpose_pairs(graph) == {"to_time", "to_batch"}
    # The walk back from the loop's input steps to the lone Transpose, not to the pair's last one.
    assert latest_backward_inputs(graph)["loop_input"] == "alone"


def test_a_push_placed_on_the_host_moves_the_whole_list_across_every_iteration():
    """Why a list is swapped whole, after its loop, and not one element per iteration (Meng et al.'s
    per-step swapping; TF 1's `while_loop(swap_memory=True)`). Placing the forward body's
    TensorListPushBack on the host does not park the elements there: the loop variable that carries
    the list stays on the loop's device (TensorFlow lowers the While with its Enter/Merge/Switch/
    NextIteration on the While's device), so the executed partitions send the list itself, a
    variant, to the host and back on every iteration. On a GPU such a copy moves every element the
    list holds (TensorList's device copy), so per-step swapping needs the loop lowered with the
    list's own chain on the host, which the rewrite does not do (docs/lms.md, "Recurrent loops")."""
    from lms_core.tf.gating import executed_partitions
    from lms_core.tf.reimport import RewrittenStep

    step, specs, _ = tiny_loop_step(COMPUTE)
    x = tf.reshape(tf.range(BATCH * UNITS, dtype=tf.float32) / 10, [BATCH, UNITS])
    concrete = step.get_concrete_function(*specs)
    graph_def = concrete.graph.as_graph_def()
    renamed = {}
    for function in graph_def.library.function:
        pushes = [node for node in function.node_def if node.op == "TensorListPushBack"]
        for node in pushes:
            node.device = HOST
        if pushes:  # a function changed under its old name would clash with the traced one
            renamed[function.signature.name] = function.signature.name + "_pushes_on_host"
            function.signature.name = renamed[function.signature.name]
    for node in [*graph_def.node, *(n for f in graph_def.library.function for n in f.node_def)]:
        for value in node.attr.values():
            if value.HasField("func") and value.func.name in renamed:
                value.func.name = renamed[value.func.name]
    assert renamed  # the forward body pushes

    moved = RewrittenStep(concrete, graph_def, planning=None, compute_device=COMPUTE, host_device=HOST)
    sends = [node for partition in executed_partitions(moved, x) for node in partition.node if node.op == "_Send"]
    variants_to_host = [n for n in sends if n.attr["T"].type == tf.variant.as_datatype_enum
                        and n.attr["recv_device"].s.decode().endswith("CPU:0")]
    variants_back = [n for n in sends if n.attr["T"].type == tf.variant.as_datatype_enum
                     and n.attr["recv_device"].s.decode().endswith("CPU:1")
                     and "TensorListPushBack" in n.attr["tensor_name"].s.decode()]
    assert variants_to_host and variants_back  # inside the loop: once per iteration each way
