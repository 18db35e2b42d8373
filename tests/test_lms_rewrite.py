"""The TensorFlow rewrite, in the three kinds of TensorFlow's own memory-optimizer tests: a graph with
nothing to swap is unchanged; an exact structural golden on a tiny graph; the same numbers with the
rewrite on and off. Plus: swaps survive Grappler, control flow is left alone, memory goes down."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import lms_core.tf as lms_tf
from lms_core.config import LMSConfig
from lms_core.tf.graphdef import KEEP_ATTR
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
from tensorflow.python.grappler import tf_optimizer
from benchmarks.architectures import ARCHITECTURES, conv_relu_step, training_step
from tests.fixtures import COMPUTE, HOST, assert_same_training

CPU = "/device:CPU:0"
SWAP_ALL = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, swapin_ahead=1, min_tensor_bytes=0)
# One device (compute and host the same: no partitioning) and split devices (compute /device:CPU:1,
# host /device:CPU:0: TensorFlow partitions the step and copies across with _Send/_Recv, as on a GPU).
DEVICE_PAIRS = {"one-device": (CPU, CPU), "split-devices": (COMPUTE, HOST)}
# Instance normalization's input gradient is the small difference of three large terms, summed by one
# AddN, and Grappler's arithmetic optimizer orders an AddN's inputs by name: a swapped term comes back
# under a swap-in's name and is added in another order. On the toy U-Net that reassociation moves the
# loss by 1.1e-6 and the weights by 1.2e-5 of the largest in 3 steps (2026-11-24); with the
# arithmetic optimizer off the two steps are bit-identical (the test after this one).
RTOL = {"unet3d": 1e-4}


@pytest.mark.parametrize("devices", sorted(DEVICE_PAIRS))
@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_loss_and_every_weight_match_with_and_without_the_rewrite(name, devices):
    compute, host = DEVICE_PAIRS[devices]
    model_a, _, step_a, specs, batch = training_step(ARCHITECTURES[name], device=compute)
    with tf.device(compute):
        losses_a = [float(step_a(*batch)) for _ in range(3)]
    model_b, optimizer_b, step_b, _, _ = training_step(ARCHITECTURES[name], device=compute)
    rewritten = lms_tf.rewrite(step_b, *specs, config=SWAP_ALL, compute_device=compute, host_device=host)
    assert rewritten.plan.swaps, "the test must exercise real swaps"
    losses_b = [float(rewritten(*batch)) for _ in range(3)]
    assert_same_training(losses_b, losses_a, model_b.variables, model_a.variables, rtol=RTOL.get(name, 1e-6))
    assert int(optimizer_b.iterations.numpy()) == 3  # the optimizer's own state was updated in place


@contextlib.contextmanager
def arithmetic_kept_as_traced():
    """Grappler's arithmetic optimizer off for the functions first run inside (it reorders sums)."""
    before = tf.config.optimizer.get_experimental_options().get("arithmetic_optimization", True)
    tf.config.optimizer.set_experimental_options({"arithmetic_optimization": False})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options({"arithmetic_optimization": before})


def test_the_unet_with_dropout_trains_bit_identically_with_the_rewrite_when_sums_keep_their_order():
    """Spatial dropout draws its masks from each layer's seed state, a variable: the rewritten step
    reads and advances it as the original does, so under one seed both drop the same channels in
    every step, and with the arithmetic in the traced order every loss and weight is equal."""
    with arithmetic_kept_as_traced():
        model_a, _, step_a, specs, batch = training_step(ARCHITECTURES["unet3d"], device=COMPUTE)
        with tf.device(COMPUTE):
            losses_a = [float(step_a(*batch)) for _ in range(3)]
        model_b, _, step_b, _, _ = training_step(ARCHITECTURES["unet3d"], device=COMPUTE)
        rewritten = lms_tf.rewrite(step_b, *specs, config=SWAP_ALL, compute_device=COMPUTE, host_device=HOST)
        assert any("dropout" in swap.tensor for swap in rewritten.plan.swaps)
        losses_b = [float(rewritten(*batch)) for _ in range(3)]
    assert losses_b == losses_a
    seeds = [v for v in model_a.variables if "seed_generator" in v.path]
    assert len(seeds) == 4 and all(v.numpy()[1] > 0 for v in seeds)  # four dropout layers, advanced each step
    for a, b in zip(model_a.variables, model_b.variables):
        np.testing.assert_array_equal(b.numpy(), a.numpy(), err_msg=a.path)


def test_nothing_to_swap_or_order_leaves_the_graph_identical():
    _, _, step, specs, batch = training_step(ARCHITECTURES["densenet_block"])
    config = LMSConfig(enabled=True, swapout_threshold=100000, serialize_branches=False)
    rewritten = lms_tf.rewrite(step, *specs, config=config, compute_device=CPU, host_device=CPU)
    assert rewritten.plan.swaps == [] and rewritten.plan.control_edges == []
    assert rewritten.graph_def == rewritten.concrete.graph.as_graph_def()
    assert np.isfinite(float(rewritten(*batch)))


def test_structural_golden_on_a_tiny_graph():
    step, specs = conv_relu_step((8, 8, 2), batch=2)
    config = LMSConfig(enabled=True, swapout_threshold=1, swapin_ahead=1, min_tensor_bytes=0, include_types=["Relu"])
    rewritten = lms_tf.rewrite(step, *specs, config=config, compute_device="/device:GPU:0", host_device=CPU)
    nodes = {n.name: n for n in rewritten.graph_def.node}
    relu = next(n.name for n in nodes.values() if n.op == "Relu")
    relu_grad = next(n.name for n in nodes.values() if n.op == "ReluGrad")
    swap_out, swap_in = f"lms/swapout_{relu}_0", f"lms/swapin_{relu}_0_0"
    assert [s.swap_out for s in rewritten.plan.swaps] == [swap_out]
    (planned_in,) = rewritten.plan.swaps[0].swap_ins
    assert planned_in.name == swap_in and planned_in.consumers == [relu_grad]

    assert planned_in.arrival is None  # sync mode 0: nothing waits for the value to arrive

    # Swap-out and gated swap-in on the host; the swap-in waits for the trigger, so the host's _Send
    # of its value to the GPU does too. The consumer on the GPU reads the swap-in.
    out, back = nodes[swap_out], nodes[swap_in]
    assert (out.op, list(out.input), out.device) == ("Identity", [relu], CPU)
    assert (back.op, list(back.input), back.device) == ("Identity", [swap_out, f"^{planned_in.trigger}"], CPU)
    assert all(n.attr[KEEP_ATTR].b and n.attr["T"].type == tf.float32.as_datatype_enum for n in (out, back))
    assert nodes[planned_in.trigger].attr[KEEP_ATTR].b  # Grappler must not rewrite the trigger away
    assert swap_in in nodes[relu_grad].input and relu not in nodes[relu_grad].input
    # The forward consumer (the pooling) still reads the original; so does the swap-out, and nothing else.
    assert sorted((n.op, n.name == swap_out) for n in nodes.values() if relu in n.input) == [
        ("Identity", True), ("Mean", False)]
    original = {n.name for n in rewritten.concrete.graph.as_graph_def().node}
    assert set(nodes) - original == {swap_out, swap_in}
    assert rewritten.host_ops == {swap_out, swap_in}


def test_structural_golden_of_a_sync_mode_2_arrival():
    """With sync mode 2 the trigger's other backward successors wait until the value is on the GPU:
    for an op there that reads it, a one-element Slice (4 bytes on the device)."""
    step, specs = conv_relu_step((8, 8, 2), batch=2)
    config = LMSConfig(enabled=True, swapout_threshold=1, swapin_ahead=1, min_tensor_bytes=0, include_types=["Relu"],
                       sync_mode=2)
    rewritten = lms_tf.rewrite(step, *specs, config=config, compute_device="/device:GPU:0", host_device=CPU)
    nodes = {n.name: n for n in rewritten.graph_def.node}
    (planned_in,) = rewritten.plan.swaps[0].swap_ins
    assert planned_in.waiters and planned_in.arrival == planned_in.name.replace("lms/swapin_", "lms/arrive_")
    arrival = nodes[planned_in.arrival]
    begin, size = f"{planned_in.arrival}/begin", f"{planned_in.arrival}/size"
    assert (arrival.op, list(arrival.input), arrival.device) == ("Slice", [planned_in.name, begin, size], "/device:GPU:0")
    assert list(tf.make_ndarray(nodes[begin].attr["value"].tensor)) == [0, 0, 0, 0]
    assert list(tf.make_ndarray(nodes[size].attr["value"].tensor)) == [1, 1, 1, 1]
    for waiter in planned_in.waiters:
        assert f"^{planned_in.arrival}" in nodes[waiter].input
    assert grappler_losses(rewritten) == []


def test_swaps_survive_grapplers_default_optimization():
    _, _, step, specs, _ = training_step(ARCHITECTURES["densenet_block"])
    rewritten = lms_tf.rewrite(step, *specs, config=SWAP_ALL, compute_device=CPU, host_device=CPU)
    assert len(rewritten.plan.swaps) > 10
    assert grappler_losses(rewritten) == []
    # Without the keep attribute Grappler folds the swap Identities away: the check can fail.
    for node in rewritten.graph_def.node:
        if node.name.startswith("lms/"):
            del node.attr[KEEP_ATTR]
    assert any(loss.endswith("removed") for loss in grappler_losses(rewritten))


def train_both_ways(forward, steps: int = 3):
    """Two fresh copies of a small conv net whose step computes its logits as `forward(model, x)`:
    one trained as traced, one rewritten with SWAP_ALL, both on split devices. Asserts equal losses
    and weights after `steps` steps and returns the rewritten step."""
    import keras

    def build():
        keras.utils.set_random_seed(0)
        with tf.device(COMPUTE):
            inputs = keras.Input((8, 8, 2))
            x = keras.layers.ReLU()(keras.layers.Conv2D(4, 3, padding="same")(inputs))
            model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(x)))
            optimizer = keras.optimizers.SGD(0.1)
            optimizer.build(model.trainable_variables)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                logits = forward(model, x)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            return loss

        return model, step

    specs = (tf.TensorSpec([2, 8, 8, 2]), tf.TensorSpec([2], tf.int32))
    batch = (tf.random.stateless_uniform([2, 8, 8, 2], seed=[1, 1]), tf.constant([0, 2]))
    model_a, step_a = build()
    with tf.device(COMPUTE):
        expected = [float(step_a(*batch)) for _ in range(steps)]
    model_b, step_b = build()
    rewritten = lms_tf.rewrite(step_b, *specs, config=SWAP_ALL, compute_device=COMPUTE, host_device=HOST)
    assert_same_training([float(rewritten(*batch)) for _ in range(steps)], expected, model_b.variables,
                         model_a.variables)
    return rewritten


def test_control_flow_in_the_step_is_left_alone_and_numerics_hold():
    def forward(model, x):
        logits = model(x)
        # A data-dependent branch and a loop inside the differentiated region.
        logits = tf.cond(tf.reduce_mean(x) > 0.5, lambda: logits * 2.0, lambda: logits)
        return tf.while_loop(lambda i, v: i < 2, lambda i, v: (i + 1, v * 1.5), (0, logits))[1]

    rewritten = train_both_ways(forward)
    reasons = [s.reason for s in rewritten.plan.skipped]
    assert any("control flow" in r for r in reasons), reasons
    assert rewritten.plan.swaps  # the convolution's activations are still swapped around the regions


def test_grappler_estimates_less_gpu_memory_with_swaps():
    step, specs = conv_relu_step((64, 64, 3), batch=32, blocks=4, filters=32, classes=10)
    config = LMSConfig(enabled=True, swapout_threshold=4, swapin_ahead=1, min_tensor_bytes=1 << 20)
    rewritten = lms_tf.rewrite(step, *specs, config=config)
    estimate = lms_tf.estimate_rewrite(rewritten, 1 << 30)
    relu_bytes = 32 * 64 * 64 * 32 * 4  # batch x 64 x 64 x 32 filters, float32
    # Without swaps the backward pass starts with all four ReLU outputs on the device.
    assert estimate.baseline_bytes >= 4 * relu_bytes
    assert estimate.lms_bytes < estimate.baseline_bytes
    # Every swapped tensor here is a forward one (the batch and the ReLU outputs): all are on the host
    # together when the forward pass ends, before any comes back.
    assert all(not s.tensor.startswith("gradient_tape/") for s in rewritten.plan.swaps)
    assert estimate.host_bytes >= rewritten.plan.swapped_bytes


def test_unknown_batch_dimension_is_skipped_with_the_reason_and_numerics_hold():
    model_a, _, step_a, specs, batch = training_step(ARCHITECTURES["densenet_block"])
    expected = [float(step_a(*batch)) for _ in range(2)]
    model_b, _, step_b, _, _ = training_step(ARCHITECTURES["densenet_block"])
    unknown = tuple(tf.TensorSpec([None, *s.shape[1:]], s.dtype) for s in specs)
    rewritten = lms_tf.rewrite(step_b, *unknown, config=SWAP_ALL, compute_device=CPU, host_device=CPU)
    # Activations carry the unknown batch and are skipped; tensors of known size (batch-norm
    # statistics) are still swapped.
    assert any(s.reason.startswith("unknown size (shape [?, 16, 16") for s in rewritten.plan.skipped)
    assert all(None not in s.shape for s in rewritten.plan.swaps)
    np.testing.assert_allclose([float(rewritten(*batch)) for _ in range(2)], expected, rtol=1e-6)


@pytest.mark.parametrize("key, kwargs", [("compute_device", {"compute_device": "/device:XPU:0"}),
                                         ("host_device", {"host_device": "warp-drive"})])
def test_an_unknown_device_names_the_setting(key, kwargs):
    from lms_core.config import SettingError

    _, _, step, specs, _ = training_step(ARCHITECTURES["densenet_block"])
    with pytest.raises(SettingError) as err:
        lms_tf.rewrite(step, *specs, config=SWAP_ALL, **kwargs)
    assert err.value.key == key


def test_ops_tensorflow_cannot_see_into_are_rewritten_around():
    """`tf.py_function` (EagerPyFunc, shape unknown, its gradient another py_function) in the
    forward and the backward pass: swaps happen around it and the numbers do not change."""
    def forward(model, x):
        scaled = tf.ensure_shape(tf.py_function(lambda a: a * 2.0, [x], tf.float32), x.shape)
        logits = tf.py_function(lambda a: a * 0.5, [model(scaled)], tf.float32)  # differentiated through
        return tf.reshape(logits, [2, 3])

    rewritten = train_both_ways(forward)
    py_funcs = [n for n in rewritten.graph_def.node if n.op == "EagerPyFunc"]
    assert len(py_funcs) >= 3  # two in the forward pass, at least one gradient
    assert any(s.producer_type == "Relu" for s in rewritten.plan.swaps)


# --- what Grappler's default optimization keeps of a rewrite -----------------------------------------
# Grappler runs before every function call; a swap-out or swap-in Identity looks like a no-op to it,
# which `_grappler_do_not_remove` prevents. This runs Grappler offline on the rewritten graph.

def grappler_losses(rewritten) -> list[str]:
    """Swap ops, trigger control inputs and rerouted consumer inputs of `rewritten` (a
    lms_core.tf.rewrite result) that Grappler's default optimization removed; [] when all survive.
    A consumer Grappler fused away is no loss; a consumer that reads the original tensor again is."""
    concrete = rewritten.concrete
    metagraph = meta_graph_pb2.MetaGraphDef(graph_def=rewritten.graph_def)
    fetches = [t.name.rpartition(":")[0] for t in concrete.graph.outputs]
    fetches += sorted(op.name for op in concrete.graph.control_outputs)
    metagraph.collection_def["train_op"].node_list.value.extend(fetches)
    optimized = {n.name: n for n in tf_optimizer.OptimizeGraph(config_pb2.ConfigProto(), metagraph).node}
    lost = []
    for swap in rewritten.plan.swaps:
        if swap.swap_out not in optimized:
            lost.append(f"{swap.swap_out}: removed")
        for swap_in in swap.swap_ins:
            gate = optimized.get(swap_in.name)
            if gate is None:
                lost.append(f"{swap_in.name}: removed")
            else:
                if not gate.input or gate.input[0] != swap.swap_out:
                    lost.append(f"{swap_in.name}: no longer reads {swap.swap_out}")
                if f"^{swap_in.trigger}" not in gate.input:
                    lost.append(f"{swap_in.name}: lost its control input from {swap_in.trigger}")
            if swap_in.arrival:
                arrival = optimized.get(swap_in.arrival)
                if arrival is None:
                    lost.append(f"{swap_in.arrival}: removed")
                elif not arrival.input or arrival.input[0] != swap_in.name:
                    lost.append(f"{swap_in.arrival}: no longer reads {swap_in.name}")
            for consumer in swap_in.consumers:
                if consumer in optimized and swap_in.name not in optimized[consumer].input:
                    lost.append(f"{consumer}: no longer reads {swap_in.name}")
    lost += [f"{edge.after}: no longer waits for {edge.before}" for edge in rewritten.plan.control_edges
             if edge.after in optimized and edge.before in optimized
             and not _waits_for(optimized, edge.after, edge.before)]
    return lost


def _waits_for(nodes: dict, after: str, before: str) -> bool:
    """Whether `after` runs after `before` in `nodes` (a control or data path), which is what the edge
    ensures: Grappler may drop a control edge that another path already implies."""
    seen, stack = {after}, [after]
    while stack:
        for reference in nodes[stack.pop()].input:
            source = reference.lstrip("^").split(":")[0]
            if source == before:
                return True
            if source in nodes and source not in seen:
                seen.add(source)
                stack.append(source)
    return False
