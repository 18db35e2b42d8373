"""Gradient loops' zeros made just before their loop (lms_core.deferred_zeros).

A gradient loop starts a weight's gradient sum, and the gradient of a loop output nothing read, at
zero: a `Fill` of constants (or of a variable's shape), which every scheduler of ready ops makes when
the step starts. A control edge from the loop's trigger makes it when the loop is about to run. The
expectations are derived by hand from the graph, and from TensorFlow itself (the same step without
the edges, the partition graphs it executes)."""
from __future__ import annotations


import lms_core.tf as lms_tf
from lms_core.config import LMSConfig
from lms_core.deferred_zeros import plan_deferred_zeros
from lms_core.graph import Graph, Op, TensorInfo
from lms_core.link import link_named
from lms_core.passes.pipeline import analyze
from lms_core.plan import ControlEdge, Plan
from lms_core.serialize import with_control_edges
from lms_core.simulator import simulate
from lms_core.tf.gating import verify_gating
from benchmarks.architectures import rolled_lstm, training_step
from tests.fixtures import COMPUTE, HOST, assert_bit_identical, rolled_lstm_and_rewrite, unit_costs

MIB = 1 << 20
H = TensorInfo((8, 32), "float32", 8 * 32 * 4)
ZEROS = TensorInfo((64, 1024, 4), "float32", MIB)
SHAPE = TensorInfo((3,), "int32", 12)
SCALAR = TensorInfo((), "float32", 4)
VARIANT = TensorInfo((), "variant", None)


def loop_graph() -> Graph:
    """A forward loop and its gradient loop, by hand. The gradient loop reads the gradient entering
    it (`grad_h`, made from the loss), the forward loop's accumulator, and three zeros: `zeros`
    (a Fill of constants: the gradient of a loop output nothing read), `w_zeros` (a Fill of the
    weight's shape: the weight gradient's running sum), and `x_zeros`, whose shape is read from the
    forward tensor `x` (not a constant: deferring it would keep nothing alive, but it is no zero the
    step makes at its start either). `shared_zeros` is read by the gradient loop and by an op after it."""
    ops = [Op("x", "Placeholder", outputs=[H]),
           Op("w", "VarHandleOp", outputs=[TensorInfo((), "resource", None)]),
           Op("loop", "While", inputs=["x:0", "w:0"], outputs=[H, VARIANT, VARIANT]),
           Op("loss", "Sum", inputs=["loop:0"], outputs=[SCALAR]),
           Op("gradient_tape/grad_h", "OnesLike", inputs=["loss:0"], outputs=[H]),
           Op("shape", "Const", outputs=[SHAPE]),
           Op("zero", "Const", outputs=[SCALAR]),
           Op("zeros", "Fill", inputs=["shape:0", "zero:0"], outputs=[ZEROS]),
           Op("gradient_tape/w_shape", "VariableShape", inputs=["w:0"], outputs=[SHAPE]),
           Op("gradient_tape/w_zeros", "Fill", inputs=["gradient_tape/w_shape:0", "zero:0"], outputs=[ZEROS]),
           Op("x_shape", "Shape", inputs=["x:0"], outputs=[SHAPE]),
           Op("x_zeros", "Fill", inputs=["x_shape:0", "zero:0"], outputs=[ZEROS]),
           Op("shared_zeros", "Fill", inputs=["shape:0", "zero:0"], outputs=[ZEROS]),
           Op("gradient_tape/loop_grad", "StatelessWhile",
              inputs=["gradient_tape/grad_h:0", "loop:1", "zeros:0", "gradient_tape/w_zeros:0", "x_zeros:0",
                      "shared_zeros:0"],
              outputs=[H, VARIANT, ZEROS, ZEROS, ZEROS, ZEROS]),
           Op("gradient_tape/after", "AddV2", inputs=["gradient_tape/loop_grad:3", "shared_zeros:0"], outputs=[ZEROS]),
           Op("update", "AssignSubVariableOp", inputs=["w:0", "gradient_tape/after:0"])]
    return analyze(Graph(ops, outputs=["loss:0"]))


def test_the_zeros_of_constants_and_of_a_weights_shape_wait_for_the_loops_trigger():
    graph = loop_graph()
    # The trigger is the gradient loop's latest backward input: the gradient entering it (not
    # `w_zeros`, though it is a backward input of a higher level: it is deferred itself).
    assert plan_deferred_zeros(graph) == [ControlEdge("gradient_tape/grad_h", "zeros"),
                                          ControlEdge("gradient_tape/grad_h", "gradient_tape/w_zeros")]
    assert plan_deferred_zeros(graph, min_bytes=MIB + 1) == []  # smaller than asked: left alone


def test_the_simulator_makes_a_deferred_zero_when_its_loop_is_about_to_run():
    graph = loop_graph()
    edges = plan_deferred_zeros(graph)
    costs = unit_costs(graph)

    def allocated_at(g: Graph) -> tuple[dict[str, float], dict[str, float]]:
        result = simulate(g, Plan(settings={}), costs, link_named("pcie3"), keep_events=True)
        return ({e.buffer: e.time for e in result.memory_events if e.nbytes > 0},
                {op: end for op, _, end in result.executed})

    before, ends = allocated_at(graph)
    for zeros in ("zeros:0", "gradient_tape/w_zeros:0"):  # they wait for nothing the step computes
        assert before[zeros] < ends["gradient_tape/grad_h"]
    after, ends = allocated_at(with_control_edges(graph, edges))
    for zeros in ("zeros:0", "gradient_tape/w_zeros:0"):  # made once the gradient entering the loop is
        assert after[zeros] >= ends["gradient_tape/grad_h"]


LSTM = dict(batch=4, steps=8, features=6, units=16)
SWAP_ALL = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, swapin_ahead=1, min_tensor_bytes=0)


def test_on_split_devices_the_lstms_weight_gradient_sums_wait_and_training_is_bit_identical():
    """Per Keras LSTM layer the gradient loop sums the gradients of three weights (kernel,
    recurrent kernel, bias), each from zeros of the weight's shape: 6 zeros for two layers."""
    expected, model_a, rewritten, model_b, batch = rolled_lstm_and_rewrite(SWAP_ALL, **LSTM)
    edges = rewritten.plan.deferred_zeros
    graph = rewritten.planning.traced
    weights = {tuple(v.shape) for v in model_b.trainable_variables}
    assert len(edges) == 6
    assert {graph[e.after].outputs[0].shape for e in edges} <= weights  # each zero is shaped as a weight
    nodes = {node.name: node for node in rewritten.graph_def.node}
    assert all(f"^{e.before}" in nodes[e.after].input for e in edges)

    # The same zeros, made later.
    assert_bit_identical([float(rewritten(*batch)) for _ in range(3)], expected, model_b.variables, model_a.variables)
    report = verify_gating(rewritten, *batch)
    assert (report.zeros_deferred, report.zeros_checked) == (6, 6), report.zeros_early
    assert "gradient loop zeros made just before their loop: 6/6" in report.verification().describe()


def test_turned_off_no_zero_waits():
    _, _, step, specs, _ = training_step(rolled_lstm(**LSTM), device=COMPUTE)
    config = LMSConfig(enabled=True, mode="manual", min_tensor_bytes=0, defer_gradient_zeros=False)
    rewritten = lms_tf.rewrite(step, *specs, config=config, compute_device=COMPUTE, host_device=HOST)
    assert rewritten.plan.deferred_zeros == []
