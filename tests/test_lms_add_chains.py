"""The AddN chain, a floor-lowering rewrite (lms_core.add_chains): which AddNs it takes, the exact
graph it makes (IR and GraphDef), that Grappler keeps it, that the simulator and the floor see it,
the same training with it on split devices, and the swap-ins of a plan beside it still gated."""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import layers
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
from tensorflow.python.grappler import tf_optimizer

import lms_core.tf as lms_tf
from benchmarks.architectures import training_step
from launcher.bench.floor import floor_after_rewrites, step_floor
from lms_core.add_chains import plan_add_chains, with_add_chains
from lms_core.config import LMSConfig
from lms_core.graph import Graph, Op
from lms_core.link import LinkRates
from lms_core.plan import Plan
from lms_core.simulator import simulate
from lms_core.tf.graphdef import KEEP_ATTR
from lms_core.tf.gating import verify_gating
from lms_core.working_set import working_set
from tests.fixtures import COMPUTE, HOST, analyzed, assert_same_training, t

CPU = "/device:CPU:0"
MIB = 1 << 20
CHAINS_ONLY = LMSConfig(enabled=True, mode="manual", swapout_threshold=100000, serialize_branches=False,
                        chain_add_n=True)
CHAINS_AND_SWAPS = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, swapin_ahead=1, min_tensor_bytes=0,
                             chain_add_n=True)


def three_term_sum(x):
    """Three terms of x's shape, produced Relu, Sin, Mul (graph order), summed by one AddN whose
    inputs are listed in another order: Mul, Relu, Sin."""
    relu, sin, scaled = tf.nn.relu(x), tf.sin(x), x * 2.0
    return tf.reduce_sum(tf.add_n([scaled, relu, sin]))


def traced_sum():
    spec = tf.TensorSpec([64, 64], tf.float32)
    return lms_tf.trace_step(tf.function(three_term_sum), spec), spec


def test_structural_golden_of_an_add_n_chain():
    traced, _ = traced_sum()
    names = {op.type: op.name for op in traced.graph.ops.values()}
    add_n, relu, sin, mul = names["AddN"], names["Relu"], names["Sin"], names["Mul"]
    (chain,) = plan_add_chains(traced.graph)  # the AddN's 4 tensors are the largest working set (Sin's: 2)
    assert (chain.op, chain.inputs) == (add_n, [f"{relu}:0", f"{sin}:0", f"{mul}:0"])  # as produced
    first = f"lms/addchain_{add_n}_0"
    assert chain.adds == [first]
    assert (chain.nbytes, chain.working_set_bytes, chain.chain_working_set_bytes) == (16384, 4 * 16384, 3 * 16384)

    rewritten = lms_tf.rewrite(tf.function(three_term_sum), tf.TensorSpec([64, 64], tf.float32), config=CHAINS_ONLY,
                               compute_device=CPU, host_device=CPU)
    assert rewritten.plan.add_chains == [chain] and rewritten.plan.swaps == []
    nodes = {n.name: n for n in rewritten.graph_def.node}
    # The AddN's node is the last add: the same name, so the Sum reads it unchanged.
    assert (nodes[first].op, list(nodes[first].input)) == ("AddV2", [relu, sin])
    assert (nodes[add_n].op, list(nodes[add_n].input)) == ("AddV2", [first, mul])
    assert "N" not in nodes[add_n].attr and nodes[add_n].attr["T"].type == tf.float32.as_datatype_enum
    assert nodes[first].attr[KEEP_ATTR].b and nodes[add_n].attr[KEEP_ATTR].b
    original = {n.name for n in rewritten.concrete.graph.as_graph_def().node}
    assert set(nodes) - original == {first}

    # In the IR the planner and simulator read: the same two adds, and no AddN.
    graph = rewritten.planning.graph
    assert [(graph[n].type, graph[n].inputs) for n in (first, add_n)] == [
        ("AddV2", [f"{relu}:0", f"{sin}:0"]), ("AddV2", [f"{first}:0", f"{mul}:0"])]
    assert not any(op.type == "AddN" for op in graph.ops.values())

    x = tf.random.stateless_normal([64, 64], seed=[1, 2])
    np.testing.assert_allclose(float(rewritten(x)), float(three_term_sum(x)), rtol=1e-6)


def test_grappler_keeps_the_chain():
    """Grappler's default optimization, which the step goes through, leaves both adds as they are."""
    rewritten = lms_tf.rewrite(tf.function(three_term_sum), tf.TensorSpec([64, 64], tf.float32), config=CHAINS_ONLY,
                               compute_device=CPU, host_device=CPU)
    (chain,) = rewritten.plan.add_chains
    assert optimized_types(rewritten, chain.adds + [chain.op]) == ["AddV2", "AddV2"]


def optimized_types(rewritten, names: list[str]) -> list[str | None]:
    """The op types of `names` after Grappler's default optimization (None: gone)."""
    metagraph = meta_graph_pb2.MetaGraphDef(graph_def=rewritten.graph_def)
    fetches = [t.name.rpartition(":")[0] for t in rewritten.concrete.graph.outputs]
    metagraph.collection_def["train_op"].node_list.value.extend(fetches)
    optimized = {n.name: n.op for n in tf_optimizer.OptimizeGraph(config_pb2.ConfigProto(), metagraph).node}
    return [optimized.get(name) for name in names]


def sum_of_branches() -> Graph:
    """x -> a, b, c (4 MiB each) -> AddN -> Sum: the AddN's working set (16 MiB) is the largest."""
    ops = [Op("x", "Placeholder", outputs=[t(4)]), Op("a", "Relu", inputs=["x:0"], outputs=[t(4)]),
           Op("b", "Neg", inputs=["x:0"], outputs=[t(4)]), Op("c", "Exp", inputs=["x:0"], outputs=[t(4)]),
           Op("s", "AddN", inputs=["c:0", "a:0", "b:0"], outputs=[t(4)]),
           Op("loss", "Sum", inputs=["s:0"], outputs=[t(0.0001, shape=())])]
    return analyzed(Graph(ops, ["loss:0"]))


def test_the_floor_and_the_simulator_see_the_chain():
    graph = sum_of_branches()
    chains = plan_add_chains(graph)
    assert [c.inputs for c in chains] == [["a:0", "b:0", "c:0"]]
    # By hand: the AddN holds 3 inputs + its output = 16 MiB; each add 2 inputs + output = 12 MiB.
    assert step_floor(graph, 0, 0).working_set_bytes == 16 * MIB
    after = floor_after_rewrites(graph, 0, 0)
    assert (after.working_set_bytes, after.op_type, after.add_chains) == (12 * MIB, "AddV2", 1)
    # The simulator replays a plan's chains as adds, on the traced graph as on the rewritten one.
    costs = {name: 1.0 for name in graph.ops}
    link = LinkRates("test", 1e9, 1e9, "a test link")
    with_chains = simulate(graph, Plan(settings={}, add_chains=chains), costs, link, keep_events=True)
    ran = [name for name, _, _ in with_chains.executed]
    assert "lms/addchain_s_0" in ran and "s" in ran
    rewritten = with_add_chains(graph, chains)
    assert rewritten["s"].type == "AddV2" and with_add_chains(rewritten, chains) is rewritten
    same = simulate(rewritten, Plan(settings={}), costs, link)
    assert same.peak_device_bytes == with_chains.peak_device_bytes


def test_an_aliasing_op_counts_its_tensor_once():
    ops = [Op("x", "Placeholder", outputs=[t(4)]), Op("r", "Reshape", inputs=["x:0"], outputs=[t(4)]),
           Op("y", "Relu", inputs=["r:0"], outputs=[t(4)])]
    graph = Graph(ops, ["y:0"])
    assert working_set(graph, "r") == 4 * MIB  # the Reshape's output is its input's buffer
    assert working_set(graph, "y") == 8 * MIB


def test_an_add_n_below_another_ops_working_set_is_left_alone():
    """A concatenation of two 8 MiB halves (32 MiB with its output) outweighs the AddN (16 MiB)."""
    graph = sum_of_branches()
    ops = list(graph.ops.values()) + [Op("p", "Placeholder", outputs=[t(8)]), Op("q", "Placeholder", outputs=[t(8)]),
                                      Op("cat", "ConcatV2", inputs=["p:0", "q:0"], outputs=[t(16)])]
    assert plan_add_chains(Graph(ops, graph.outputs)) == []


def conv_batch_norm():
    """Conv -> batch norm -> ReLU -> pooling -> dense, batch 4: batch norm's input gradient is an AddN
    of three terms of the convolution's output shape (Keras 3 computes it from the moments), the
    largest working set of the step, as on ResNet-50 at large batches."""
    inputs = keras.Input((16, 16, 3))
    x = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(8, 3, padding="same")(inputs)))
    model = keras.Model(inputs, layers.Dense(3)(layers.GlobalAveragePooling2D()(x)))
    return model, ((4, 16, 16, 3), (4,))


def test_training_is_the_same_with_chains_and_swaps_on_split_devices_and_every_swap_in_is_gated():
    model_a, _, step_a, specs, batch = training_step(conv_batch_norm, device=COMPUTE)
    with tf.device(COMPUTE):
        losses_a = [float(step_a(*batch)) for _ in range(3)]
    model_b, _, step_b, _, _ = training_step(conv_batch_norm, device=COMPUTE)
    rewritten = lms_tf.rewrite(step_b, *specs, config=CHAINS_AND_SWAPS, compute_device=COMPUTE, host_device=HOST)
    assert rewritten.plan.add_chains and rewritten.plan.swaps, "the test must exercise chains and swaps"
    traced = rewritten.planning.traced
    conv_output = 4 * 16 * 16 * 8 * 4
    assert step_floor(traced, 0, 0).working_set_bytes == 4 * conv_output  # three terms and their sum
    assert floor_after_rewrites(traced, 0, 0).working_set_bytes == 3 * conv_output
    for chain in rewritten.plan.add_chains:  # what runs is the chain, not an AddN Grappler folded back
        assert optimized_types(rewritten, chain.adds + [chain.op]) == ["AddV2"] * (len(chain.adds) + 1)
    losses_b = [float(rewritten(*batch)) for _ in range(3)]
    assert_same_training(losses_b, losses_a, model_b.variables, model_a.variables, rtol=1e-6)

    report = verify_gating(rewritten, *batch)
    swap_ins = rewritten.plan.swap_in_count
    assert (report.gated, len(report.gates)) == (swap_ins, swap_ins), report.verification().first_failure()
