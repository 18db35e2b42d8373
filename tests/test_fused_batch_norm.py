"""`model.batch_norm: fused`: ResNet-50's batch norm trained with TensorFlow's fused kernel, as TF 1.x
Keras did for the LMS papers, checked against Keras's own layer and the traced step."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from keras import layers

from launcher.rank.tasks import build_task
from launcher.rank.tasks.fused_batch_norm import FusedBatchNormalization
from launcher.recipe import RecipeError, load_recipe
from tests.fixtures import RECIPES


def load_with(recipe: str, *overrides: str):
    return load_recipe(RECIPES / recipe, list(overrides))


def twin_layers(**config):
    """Keras's layer and the fused one, built alike with the same (non-trivial) variables."""
    keras_bn, fused_bn = layers.BatchNormalization(**config), FusedBatchNormalization(**config)
    for layer in (keras_bn, fused_bn):
        layer.build((None, 8, 8, 16))
    rng = np.random.default_rng(0)
    for name in ("gamma", "beta", "moving_mean", "moving_variance"):
        value = rng.uniform(0.5, 1.5, 16).astype("float32")
        getattr(keras_bn, name).assign(value)
        getattr(fused_bn, name).assign(value)
    return keras_bn, fused_bn


def test_training_outputs_and_gradients_match_keras_and_the_graph_has_one_fused_op_each_way():
    keras_bn, fused_bn = twin_layers(epsilon=1.001e-5)
    x = tf.constant(np.random.default_rng(1).normal(2.0, 3.0, (4, 8, 8, 16)).astype("float32"))
    dy = tf.constant(np.random.default_rng(2).normal(0.0, 1.0, (4, 8, 8, 16)).astype("float32"))
    results = []
    for layer in (keras_bn, fused_bn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * dy)
        results.append((y, *tape.gradient(loss, [x, layer.gamma, layer.beta])))
    for want, got in zip(*results):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fused_bn(x, training=True)
        return tape.gradient(y, x)

    types = [op.type for op in step.get_concrete_function(tf.TensorSpec(x.shape)).graph.get_operations()]
    assert types.count("FusedBatchNormV3") == types.count("FusedBatchNormGradV3") == 1
    assert "Mean" not in types and "SquaredDifference" not in types  # Keras's moments are not computed


def test_moving_statistics_follow_keras_with_the_biased_batch_variance():
    """The kernel reports the batch variance with Bessel's correction (n / (n - 1) larger); Keras
    moves its statistics with the biased one, and so does the fused layer. By hand: momentum 0.99,
    the batch's mean and biased variance per channel."""
    keras_bn, fused_bn = twin_layers(momentum=0.99)
    x = np.random.default_rng(3).normal(1.0, 2.0, (4, 8, 8, 16)).astype("float32")
    start_mean, start_variance = fused_bn.moving_mean.numpy(), fused_bn.moving_variance.numpy()
    for layer in (keras_bn, fused_bn):
        layer(tf.constant(x), training=True)
    expected_mean = 0.99 * start_mean + 0.01 * x.mean(axis=(0, 1, 2))
    expected_variance = 0.99 * start_variance + 0.01 * x.var(axis=(0, 1, 2))
    for layer in (keras_bn, fused_bn):
        np.testing.assert_allclose(layer.moving_mean.numpy(), expected_mean, rtol=1e-6)
        np.testing.assert_allclose(layer.moving_variance.numpy(), expected_variance, rtol=1e-5)


def test_inference_and_unsupported_layouts_run_keras_own_computation():
    keras_bn, fused_bn = twin_layers()
    x = tf.random.normal((2, 8, 8, 16), seed=4)
    np.testing.assert_allclose(fused_bn(x, training=False).numpy(), keras_bn(x, training=False).numpy(), rtol=1e-6)
    flat_keras, flat_fused = layers.BatchNormalization(), FusedBatchNormalization()
    v = tf.random.normal((8, 16), seed=5)  # rank 2: no fused kernel for it
    np.testing.assert_allclose(flat_fused(v, training=True).numpy(), flat_keras(v, training=True).numpy(), atol=1e-6)


def test_the_resnet50_task_builds_fused_batch_norm_only_when_asked():
    keras_model = build_task(load_with("resnet50-cpu.yaml", "model.input_shape=[32,32,3]")).build_model()
    fused_model = build_task(load_with("resnet50-cpu.yaml", "model.input_shape=[32,32,3]",
                                       "model.batch_norm=fused")).build_model()
    assert not any(isinstance(layer, FusedBatchNormalization) for layer in keras_model.layers)
    assert sum(isinstance(layer, FusedBatchNormalization) for layer in fused_model.layers) == 53  # every BN of ResNet-50
    assert [w.path for w in fused_model.weights] == [w.path for w in keras_model.weights]


@pytest.mark.parametrize("recipe, override, message", [
    ("resnet50-cpu.yaml", "model.batch_norm=fast", r"model\.batch_norm: must be one of keras, fused; got 'fast'"),
    ("unet3d-cpu.yaml", "model.batch_norm=fused", r"model\.batch_norm: applies to resnet50 only"),
])
def test_a_bad_batch_norm_setting_is_refused_by_name(recipe, override, message):
    with pytest.raises(RecipeError, match=message):
        load_with(recipe, override)


def test_with_every_activation_swapped_the_fused_resnet50_is_gated_and_trains_the_same_on_split_devices():
    """The papers' ResNet-50 (fused batch norm) at 32x32, batch 4: every tensor the distance planner
    can swap, one level ahead, on split devices (compute /device:CPU:1, host /device:CPU:0). The
    fused gradients' inputs are swapped like any other: every swap-in waits for its trigger in what
    TensorFlow executed, and 3 steps match the step without LMS (losses and weights to 1e-6)."""
    import keras

    import lms_core.tf as lms_tf
    from benchmarks.architectures import training_step
    from launcher.rank.tasks.fused_batch_norm import with_fused_batch_norm
    from lms_core.config import LMSConfig
    from lms_core.tf.gating import verify_gating
    from tests.fixtures import COMPUTE, HOST, assert_same_training

    def fused_resnet50():
        model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10,
                                            classifier_activation=None)
        return with_fused_batch_norm(model), ((4, 32, 32, 3), (4,))

    model_a, _, step_a, specs, batch = training_step(fused_resnet50, device=COMPUTE)
    with tf.device(COMPUTE):
        expected = [float(step_a(*batch)) for _ in range(3)]
    model_b, _, step_b, _, _ = training_step(fused_resnet50, device=COMPUTE)
    swap_all = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, swapin_ahead=1, min_tensor_bytes=0)
    rewritten = lms_tf.rewrite(step_b, *specs, config=swap_all, compute_device=COMPUTE, host_device=HOST)
    fused_inputs = {s.tensor for s in rewritten.plan.swaps
                    for swap_in in s.swap_ins for c in swap_in.consumers if c.endswith("FusedBatchNormGradV3")}
    assert len(fused_inputs) >= 53  # each of the 53 gradients reads at least its layer's input from the host
    report = verify_gating(rewritten, *batch)
    assert report.all_gated, report.verification().first_failure()
    assert report.edges_kept == report.edges_checked
    assert_same_training([float(rewritten(*batch)) for _ in range(3)], expected, model_b.variables,
                         model_a.variables, rtol=1e-6)
