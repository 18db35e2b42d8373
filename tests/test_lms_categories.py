"""Op categories on real Keras 3 training steps: ResNet-50, a 3D U-Net, a DenseNet block, a
Transformer block, and a step that allreduces its gradients with Horovod.

Checked against facts that hold whatever the model is called: gradient kernels are backward, every
variable write is an update, the phases only read earlier phases, and stripping TensorFlow's
`gradient_tape/` scope from every name changes the category of no op that does data work.
"""
from __future__ import annotations

import pytest
import tensorflow as tf

import lms_core.tf as lms_tf
from lms_core.config import LMSConfig
from lms_core.graph import BACKWARD, FORWARD, OTHER, UPDATE, Graph, Op, split_tensor
from lms_core.passes.categorize import is_collective, is_variable_write
from lms_core.planner import constant_ops
from benchmarks.architectures import ARCHITECTURES, training_step

CONFIG = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, min_tensor_bytes=0)
PHASE = {OTHER: 0, FORWARD: 1, BACKWARD: 2, UPDATE: 3}


def horovod_step():
    """The DenseNet block's step with `hvd.grouped_allreduce` between the gradients and the optimizer."""
    hvd = pytest.importorskip("horovod.tensorflow")
    hvd.init()
    model, optimizer, _, specs, _ = training_step(ARCHITECTURES["densenet_block"])

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        grads = hvd.grouped_allreduce(tape.gradient(loss, model.trainable_variables))
        optimizer.apply(grads, model.trainable_variables)
        return loss

    return step, specs


@pytest.fixture(scope="module", params=[*sorted(ARCHITECTURES), "horovod"])
def analyzed(request) -> Graph:
    if request.param == "horovod":
        step, specs = horovod_step()
    else:
        _, _, step, specs, _ = training_step(ARCHITECTURES[request.param])
    _, graph, _ = lms_tf.plan_step(step, *specs, config=CONFIG)
    return graph


def test_gradient_kernels_are_backward_and_forward_kernels_forward(analyzed):
    g = analyzed
    by_type: dict[str, set[str]] = {}
    for op in g.ops.values():
        by_type.setdefault(op.type, set()).add(op.category)
    gradient_kernels = [t for t in by_type if t.endswith(("Grad", "GradV2", "GradV3")) or "BackpropFilter" in t]
    assert gradient_kernels, "every architecture here has gradient kernels"
    # The U-Net upsamples with an average pool's gradient kernel, in its forward pass on purpose
    # (launcher.rank.tasks.unet3d.upsample_nearest); that op's own gradient is an AvgPool3D. The
    # category follows the gradient tape's scope, not the kernel's name.
    if "AvgPool3DGrad" in by_type:
        assert by_type.pop("AvgPool3DGrad") == {FORWARD} and by_type["AvgPool3D"] == {BACKWARD}
        gradient_kernels.remove("AvgPool3DGrad")
    for op_type in gradient_kernels:
        assert by_type[op_type] == {BACKWARD}, op_type
    for op_type in ("Conv2D", "Conv3D", "DepthwiseConv2dNative", "FusedBatchNormV3", "Relu", "Softmax", "MaxPool",
                    "MaxPool3D"):
        # Conv3D also computes the input gradient of a transposed convolution, so only "some are forward".
        assert op_type not in by_type or FORWARD in by_type[op_type], op_type
    filters = sum(op.type.startswith(("Conv", "DepthwiseConv")) and "Backprop" not in op.type
                  and op.category == FORWARD for op in g.ops.values())
    filter_grads = sum("BackpropFilter" in op.type for op in g.ops.values())
    # One filter gradient per convolution, depthwise ones included (a transposed convolution's is a
    # BackpropFilter too).
    assert filters == filter_grads or filters + sum(
        op.type.startswith("Conv") and "BackpropInput" in op.type and op.category == FORWARD
        for op in g.ops.values()) == filter_grads


def test_writes_and_collectives_are_updates_and_nothing_after_a_collective_is_backward(analyzed):
    g = analyzed
    writes = [op for op in g.ops.values() if is_variable_write(op.type)]
    assert writes and {op.category for op in writes} == {UPDATE}
    collectives = [op for op in g.ops.values() if is_collective(op.type)]
    assert {op.category for op in collectives} <= {UPDATE}
    for op in collectives:
        for succ in g.successors(op.name):
            assert g[succ].category == UPDATE, succ


def test_each_phase_reads_only_earlier_phases(analyzed):
    g = analyzed
    for op in g.ops.values():
        for tensor in op.inputs:
            producer = g[split_tensor(tensor)[0]]
            if op.category != OTHER and producer.category != OTHER:
                assert PHASE[producer.category] <= PHASE[op.category], (producer.name, op.name)
    # Backward begins right after the forward pass: no gap (it would stretch every distance), no
    # overlap. The step's output op is the one forward op that waits for the updates, so it is last.
    waits = {n for n in g.order if any(g[p].category in (BACKWARD, UPDATE) for p in g.predecessors(g[n]))}
    for name in g.order:
        waits |= {name} if any(p in waits for p in g.predecessors(g[name])) else set()
    last_forward = max(op.level for n, op in g.ops.items() if op.category == FORWARD and n not in waits)
    assert min(op.level for op in g.ops.values() if op.category == BACKWARD) == last_forward + 1
    assert {n for n in waits if g[n].category == FORWARD} <= {split_tensor(t)[0] for t in g.outputs}


def test_names_are_a_hint_only(analyzed):
    """With `gradient_tape/` stripped from every name, only ops computed from constants alone (shape
    arithmetic, the gradient seed) or whose results reach no update (a gradient nobody reads) may
    change category."""
    g = analyzed
    rename = lambda s: s.replace("gradient_tape/", "gt_")  # noqa: E731
    bare = lms_tf.analyze(Graph([Op(rename(o.name), o.type, o.device, [rename(i) for i in o.inputs],
                                    [rename(c) for c in o.control_inputs], o.outputs) for o in g.ops.values()],
                                outputs=[rename(t) for t in g.outputs]))
    constant = constant_ops(g)
    sinks = {n for n, op in g.ops.items() if is_variable_write(op.type) or is_collective(op.type)}
    reaches_update = set(sinks)
    for name in reversed(g.order):
        if any(s in reaches_update for s in g.successors(name)):
            reaches_update.add(name)
    changed = [n for n, op in g.ops.items() if bare[rename(n)].category != op.category]
    unexplained = [n for n in changed if n not in constant and n in reaches_update]
    assert unexplained == []
