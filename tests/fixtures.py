"""What the tests share: paths, the split CPU devices, and hand-built graphs small enough to
follow by hand. (Keras training steps of the test architectures are in launcher.lms.architectures.)"""
from __future__ import annotations

import sys
from pathlib import Path

from lms_core.graph import Graph, Op, TensorInfo
from lms_core.passes.pipeline import analyze

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
# Two logical CPU devices, as a CPU rank with LMS on has them (conftest.py makes them): the LMS tests
# run the rewritten step with compute on /device:CPU:1 and host /device:CPU:0, so TensorFlow
# partitions it across devices with _Send/_Recv pairs as it would for a GPU.
COMPUTE, HOST = "/device:CPU:1", "/device:CPU:0"


def lms_launch_argv(*args: str) -> list[str]:
    """`lms-launch ...` as a subprocess, through the same interpreter the tests run in."""
    return [sys.executable, "-m", "launcher.cli", *args]


# --- hand-built step graphs ------------------------------------------------------------------------

MIB = 1 << 20


def t(mib: float = 4, shape=(16, 64, 64, 16), dtype="float32") -> TensorInfo:
    return TensorInfo(shape=shape, dtype=dtype, nbytes=None if mib is None else int(mib * MIB))


def tiny_step(extra: list[Op] = (), relu_bytes: float | None = 4) -> Graph:
    ops = [
        Op("x", "Placeholder", outputs=[t(1)]),
        Op("w", "ReadVariableOp", inputs=["w_handle:0"], outputs=[t(0.01)]),
        Op("w_handle", "Placeholder", outputs=[t(None, shape=(), dtype="resource")]),
        Op("conv", "Conv2D", inputs=["x:0", "w:0"], outputs=[t(4)]),
        Op("relu", "Relu", inputs=["conv:0"], outputs=[t(relu_bytes)]),
        Op("pool", "Mean", inputs=["relu:0"], outputs=[t(0.001)]),
        Op("loss", "Identity", inputs=["pool:0"], outputs=[t(0)]),
        Op("ones", "Const", outputs=[t(0)]),
        # The seed meets forward data (as softmax cross-entropy's gradient does), so it is no constant.
        Op("gradient_tape/pool_grad", "Mul", inputs=["ones:0", "pool:0"], outputs=[t(4)]),
        Op("gradient_tape/relu_grad", "ReluGrad", inputs=["gradient_tape/pool_grad:0", "relu:0"], outputs=[t(4)]),
        Op("gradient_tape/shape", "Shape", inputs=["relu:0"], outputs=[t(0)]),
        Op("gradient_tape/conv_filter_grad", "Conv2DBackpropFilter",
           inputs=["x:0", "gradient_tape/shape:0", "gradient_tape/relu_grad:0"], outputs=[t(0.01)]),
        Op("gradient_tape/conv_input_grad", "Conv2DBackpropInput", inputs=["w:0", "gradient_tape/relu_grad:0"],
           outputs=[t(1)]),
        # The learning rate is a variable the forward pass never reads (as in Keras): optimizer state.
        Op("lr_handle", "Placeholder", outputs=[t(None, shape=(), dtype="resource")]),
        Op("sgd/lr", "ReadVariableOp", inputs=["lr_handle:0"], outputs=[t(0, shape=())]),
        Op("sgd/mul", "Mul", inputs=["gradient_tape/conv_filter_grad:0", "sgd/lr:0"], outputs=[t(0.01)]),
        Op("sgd/assign", "AssignSubVariableOp", inputs=["w_handle:0", "sgd/mul:0"]),
        *extra,
    ]
    return Graph(ops, outputs=["loss:0"])


def analyzed(graph: Graph) -> Graph:
    return analyze(graph)


def conv_graph() -> Graph:
    ops = [Op("x", "Placeholder", outputs=[TensorInfo((8, 32, 32, 16), "float32", 8 * 32 * 32 * 16 * 4)]),
           Op("w", "ReadVariableOp", outputs=[TensorInfo((3, 3, 16, 32), "float32", 3 * 3 * 16 * 32 * 4)]),
           Op("conv", "Conv2D", inputs=["x:0", "w:0"], outputs=[TensorInfo((8, 32, 32, 32), "float32", 8 * 32 * 32 * 32 * 4)])]
    return Graph(ops, outputs=["conv:0"])


def unit_costs(graph: Graph) -> dict[str, float]:
    return {name: 1.0 for name in graph.order}  # one second per op: easy to follow by hand


def chain_step(activations: str = "abc", mib: dict[str, float] | None = None) -> Graph:
    """x -> a -> b -> c -> loss, each activation 4 MiB, and the backward chain reading them in
    reverse: without swaps a, b and c all sit on the device when the forward pass ends. One op per
    letter of `activations` (default a, b, c); `mib` sizes some of them otherwise (each gradient is
    the size of its activation)."""
    def act(name: str) -> TensorInfo:
        size = (mib or {}).get(name, 4)
        shape = (4, 256, 256, 4) if size == 4 else (int(size * MIB) // 4,)
        return TensorInfo(shape, "float32", int(size * MIB))
    ops = [Op("x", "Placeholder", outputs=[TensorInfo((4,), "float32", 16)])]
    previous = "x:0"
    for name in activations:
        ops.append(Op(name, "Relu", inputs=[previous], outputs=[act(name)]))
        previous = f"{name}:0"
    ops += [Op("loss", "Sum", inputs=[previous], outputs=[TensorInfo((), "float32", 4)]),
            Op("ones", "Const", outputs=[TensorInfo((), "float32", 4)]),
            Op("gradient_tape/seed", "Mul", inputs=["ones:0", "loss:0"], outputs=[act(activations[-1])])]
    gradient = "gradient_tape/seed:0"
    for name in reversed(activations):
        ops.append(Op(f"gradient_tape/grad_{name}", "ReluGrad", inputs=[gradient, f"{name}:0"], outputs=[act(name)]))
        gradient = f"gradient_tape/grad_{name}:0"
    return analyzed(Graph(ops, outputs=["loss:0"]))


def assert_same_training(losses, expected_losses, variables, expected_variables, rtol: float = 1e-6) -> None:
    """Losses to `rtol`, and every weight to `rtol` of itself plus `rtol` of the model's largest
    weight: a weight whose true gradient is zero holds rounding noise that any reordering of the
    arithmetic moves, so it is judged on the model's scale, not its own (TF's assertAllClose idea)."""
    import numpy as np

    np.testing.assert_allclose(losses, expected_losses, rtol=rtol)
    values = [np.asarray(v.numpy()) for v in variables]
    expected = [np.asarray(v.numpy()) for v in expected_variables]
    scale = max(float(np.max(np.abs(e))) for e in expected if e.size and e.dtype.kind == "f")
    for variable, value, want in zip(expected_variables, values, expected):
        np.testing.assert_allclose(value, want, rtol=rtol, atol=rtol * scale, err_msg=variable.path)


def rolled_lstm_and_rewrite(config, train_steps: int = 3, **lstm):
    """The rolled LSTM's training step (benchmarks.architectures.rolled_lstm) built twice on COMPUTE:
    the first trained `train_steps` steps as traced, the second rewritten with `config` for COMPUTE and
    HOST and not yet run. Returns (losses of the first, its model, the rewritten step, its model,
    the batch)."""
    import tensorflow as tf

    import lms_core.tf as lms_tf
    from benchmarks.architectures import rolled_lstm, training_step

    original_model, _, original, specs, batch = training_step(rolled_lstm(**lstm), device=COMPUTE)
    with tf.device(COMPUTE):
        losses = [float(original(*batch)) for _ in range(train_steps)]
    model, _, step, _, _ = training_step(rolled_lstm(**lstm), device=COMPUTE)
    rewritten = lms_tf.rewrite(step, *specs, config=config, compute_device=COMPUTE, host_device=HOST)
    return losses, original_model, rewritten, model, batch


def assert_bit_identical(losses, expected_losses, variables, expected_variables) -> None:
    """The same losses and every weight the same, bit for bit: for rewrites that change when a value
    exists, not how it is computed."""
    import numpy as np

    assert losses == expected_losses
    for variable, expected in zip(variables, expected_variables):
        np.testing.assert_array_equal(variable.numpy(), expected.numpy(), err_msg=expected.path)
