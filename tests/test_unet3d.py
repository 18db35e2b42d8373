"""The 3D U-Net of Isensee et al. (2017), as ../shared/DESIGN.md describes it: its parameter count
derived by hand, instance normalization and deep supervision recomputed in NumPy, the soft Dice loss
against its formula, learnable nested synthetic labels, and the structural twin `lms-launch plan`
checks a paper-sized plan on."""
from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from launcher.rank.tasks.unet3d import (
    LEAKY_SLOPE, NORM_EPSILON, NearestUpsampling3D, UNet3DTask, instance_norm, soft_dice_loss, unet3d,
)
from launcher.recipe import load_recipe
from tests.fixtures import RECIPES


def block_params(kernel: int, c_in: int, c_out: int) -> int:
    """One block: the convolution's kernel and bias, then instance norm's gamma and beta."""
    return kernel**3 * c_in * c_out + c_out + 2 * c_out


def params_by_hand(channels: int, labels: int, levels: int, base: int) -> int:
    """The network of DESIGN.md counted layer by layer (written from the description, not the code)."""
    filters = [base * 2**level for level in range(levels)]
    total, c_in = 0, channels
    for f in filters:  # the level's input block, then the context module's two blocks
        total += block_params(3, c_in, f) + 2 * block_params(3, f, f)
        c_in = f
    for level in range(levels - 2, -1, -1):  # upsampled block, block on the concatenation, 1x1x1 block
        f = filters[level]
        total += block_params(3, filters[level + 1], f) + block_params(3, 2 * f, f) + block_params(1, f, f)
    return total + sum(block_params(1, filters[level], labels) for level in range(min(3, levels - 1)))


def test_the_paper_network_has_8269579_parameters_and_a_first_convolution_of_1744():
    # At the paper's sizes (4 channels, 3 labels, 5 levels of 16, 32, 64, 128, 256 filters), with
    # block(k, in, out) = k^3 in out + out (bias) + 2 out (gamma, beta):
    #   encoder  level 0: 1,776 + 2 x 6,960 = 15,696      level 1: 13,920 + 2 x 27,744 = 69,408
    #            level 2: 55,488 + 2 x 110,784 = 277,056  level 3: 221,568 + 2 x 442,752 = 1,107,072
    #            level 4: 885,504 + 2 x 1,770,240 = 4,425,984                       sum 5,895,216
    #   decoder  level 3: 885,120 + 885,120 + 16,768 = 1,787,008   level 2: 221,376 + 221,376 + 4,288 = 447,040
    #            level 1: 55,392 + 55,392 + 1,120 = 111,904        level 0: 13,872 + 13,872 + 304 = 28,048
    #                                                                                   sum 2,374,000
    #   deep supervision (1x1x1, 3 filters) at levels 2, 1, 0: 201 + 105 + 57 = 363
    #   total 5,895,216 + 2,374,000 + 363 = 8,269,579; the first convolution 27 x 4 x 16 + 16 = 1,744.
    assert params_by_hand(channels=4, labels=3, levels=5, base=16) == 8_269_579
    model = unet3d([16, 16, 16, 4])  # the count does not depend on the volume's side
    assert model.count_params() == 8_269_579
    assert model.get_layer("enc0_in_conv").count_params() == 27 * 4 * 16 + 16 == 1_744


@pytest.mark.parametrize("channels, labels, levels, base", [(2, 1, 3, 8), (4, 3, 4, 4), (1, 2, 2, 5)])
def test_the_count_follows_the_description_at_other_sizes(channels, labels, levels, base):
    model = unet3d([2**levels] * 3 + [channels], labels=labels, levels=levels, base_filters=base)
    assert model.count_params() == params_by_hand(channels, labels, levels, base)
    assert model.output_shape == (None, *[2**levels] * 3, labels)


def test_the_layout_strided_convolutions_no_pooling_nearest_upsampling_and_the_papers_rates():
    model = unet3d([32, 32, 32, 4])
    kinds = {type(layer).__name__ for layer in model.layers}
    assert not any("Pooling" in kind or "Transpose" in kind or "BatchNorm" in kind for kind in kinds)
    assert [model.get_layer(f"enc{level}_in_conv").strides for level in range(5)] == [(1, 1, 1)] + [(2, 2, 2)] * 4
    assert [model.get_layer(f"enc{level}_sum").output.shape[1] for level in range(5)] == [32, 16, 8, 4, 2]
    dropouts = [layer for layer in model.layers if isinstance(layer, keras.layers.SpatialDropout3D)]
    assert len(dropouts) == 5 and {layer.rate for layer in dropouts} == {0.3}
    slopes = {layer.negative_slope for layer in model.layers if isinstance(layer, keras.layers.LeakyReLU)}
    assert slopes == {LEAKY_SLOPE} == {0.3}
    assert model.get_layer("dec0_loc2_conv").kernel_size == (1, 1, 1)
    assert model.get_layer("dec0_concat").output.shape[-1] == 32  # skip (16) and upsampled (16)


def test_instance_normalization_is_per_sample_and_channel_over_the_volume():
    x = np.random.default_rng(0).normal(3.0, 2.0, size=(2, 3, 4, 5, 6)).astype(np.float32)
    layer = instance_norm("norm")
    layer.build(x.shape)
    gamma, beta = np.linspace(0.5, 2.0, 6, dtype=np.float32), np.linspace(-1.0, 1.0, 6, dtype=np.float32)
    layer.set_weights([gamma, beta])
    assert [w.shape for w in layer.weights] == [(6,), (6,)]  # gamma and beta per channel, nothing else
    mean = x.mean(axis=(1, 2, 3), keepdims=True)
    variance = ((x - mean) ** 2).mean(axis=(1, 2, 3), keepdims=True)
    by_hand = (x - mean) / np.sqrt(variance + NORM_EPSILON) * gamma + beta
    np.testing.assert_allclose(layer(x).numpy(), by_hand, rtol=1e-5, atol=1e-5)
    # One sample's result does not depend on the other samples in the batch (unlike batch norm).
    np.testing.assert_allclose(layer(x[1:]).numpy(), by_hand[1:], rtol=1e-5, atol=1e-5)


def test_deep_supervision_sums_upsampled_level_outputs_into_the_logits():
    model = unet3d([16, 16, 16, 2], labels=3, levels=4, base_filters=4, dropout=0.0)
    probe = keras.Model(model.input, [model.get_layer(f"seg{level}_act").output for level in (2, 1, 0)]
                        + [model.output])
    x = np.random.default_rng(1).normal(size=(1, 16, 16, 16, 2)).astype(np.float32)
    seg2, seg1, seg0, logits = (t.numpy() for t in probe(x, training=False))

    def up(a):  # nearest neighbour: every voxel repeated twice along D, H and W
        return a.repeat(2, axis=1).repeat(2, axis=2).repeat(2, axis=3)

    np.testing.assert_allclose(logits, up(up(seg2) + seg1) + seg0, rtol=1e-6, atol=1e-6)
    assert logits.dtype == np.float32 and logits.shape == (1, 16, 16, 16, 3)


def test_nearest_upsampling_is_keras_s_and_its_gradient_one_pool_of_the_cubes_sums():
    """Outputs equal to Keras's UpSampling3D(2) exactly; the gradient of sum(w * up(x)) is, for each
    input voxel, the sum of w over its 2x2x2 cube (by hand in NumPy), as Keras's own gradient says;
    and TensorFlow computes the upsampling with one op and its gradient with one AvgPool3D and no
    Sum (Keras's gradient is a chain of 12 ops)."""
    rng = np.random.default_rng(5)
    x = tf.constant(rng.normal(size=(2, 3, 4, 5, 6)).astype(np.float32))
    w = tf.constant(rng.normal(size=(2, 6, 8, 10, 6)).astype(np.float32))
    ours, keras_s = NearestUpsampling3D(), keras.layers.UpSampling3D(2)
    np.testing.assert_array_equal(ours(x).numpy(), keras_s(x).numpy())
    assert ours.compute_output_shape((None, 3, None, 5, 6)) == (None, 6, None, 10, 6)

    def gradient(layer):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(w * layer(x))
        return tape.gradient(loss, x).numpy()

    cube_sums = w.numpy().reshape(2, 3, 2, 4, 2, 5, 2, 6).sum(axis=(2, 4, 6))
    np.testing.assert_allclose(gradient(ours), cube_sums, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gradient(keras_s), cube_sums, rtol=1e-6, atol=1e-6)

    @tf.function
    def backward(x, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(w * ours(x))
        return tape.gradient(loss, x)

    ops = [op.type for op in backward.get_concrete_function(x, w).graph.get_operations()]
    assert ops.count("AvgPool3DGrad") == 1 and ops.count("AvgPool3D") == 1
    assert ops.count("Sum") == 1  # the loss's reduce_sum; none in the upsampling's gradient


def test_grappler_sizes_the_upsampled_tensor():
    """The bench's and `plan`'s memory figures are Grappler's: its shape inference must know the
    upsampling's output, or its estimate counts that tensor (the largest of a decoder level) as
    nothing. TensorFlow's Grappler item is asked directly."""
    from tensorflow.core.protobuf import meta_graph_pb2
    from tensorflow.python.grappler import item as grappler_item

    @tf.function
    def step(x):
        return tf.reduce_sum(NearestUpsampling3D()(x))

    concrete = step.get_concrete_function(tf.TensorSpec([1, 3, 4, 5, 6], tf.float32))
    metagraph = meta_graph_pb2.MetaGraphDef(graph_def=concrete.graph.as_graph_def())
    metagraph.collection_def["train_op"].node_list.value.extend([concrete.graph.outputs[0].op.name])
    properties = grappler_item.Item(metagraph).GetOpProperties()
    [upsampling] = [name for name in properties if name.endswith("AvgPool3DGrad")]
    [output] = properties[upsampling]
    assert [dim.size for dim in output.shape.dim] == [1, 6, 8, 10, 6]


def test_the_soft_dice_loss_follows_its_formula():
    rng = np.random.default_rng(2)
    labels = rng.integers(0, 2, size=(2, 3, 4, 5, 3)).astype(np.float32)
    labels[1, ..., 2] = 0  # an empty label map
    logits = rng.normal(size=labels.shape).astype(np.float32)
    p = 1 / (1 + np.exp(-logits.astype(np.float64)))
    smooth = 1e-5
    volume = (1, 2, 3)
    dice = (2 * (labels * p).sum(axis=volume) + smooth) / (labels.sum(axis=volume) + p.sum(axis=volume) + smooth)
    assert dice.shape == (2, 3)  # per sample and label map, then the mean
    assert float(soft_dice_loss(labels, logits)) == pytest.approx(-dice.mean(), rel=1e-5)


def test_the_loss_is_minus_one_for_a_perfect_prediction_and_stable_for_extreme_logits():
    labels = np.zeros((1, 4, 4, 4, 3), np.float32)
    labels[0, :2, ..., 0] = 1
    logits = tf.constant(np.where(labels > 0, 1e4, -1e4).astype(np.float32))  # exp would overflow float32
    with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = soft_dice_loss(labels, logits)
    assert float(loss) == pytest.approx(-1.0, abs=1e-6)  # empty maps predicted empty count as 1 too
    assert np.isfinite(tape.gradient(loss, logits).numpy()).all()


def test_the_loss_falls_when_training_on_synthetic_batches():
    task = UNet3DTask(load_recipe(RECIPES / "unet3d-cpu.yaml", ["model.input_shape=[16,16,16,4]", "model.levels=3"]))
    keras.utils.set_random_seed(0)
    model = task.build_model()
    optimizer = keras.optimizers.Adam(5e-3)
    x, y = task.synthetic_batch(2, seed=3)
    losses = []
    for _ in range(8):
        with tf.GradientTape() as tape:
            loss = task.loss(y, model(x, training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        losses.append(float(loss))
    assert -1 <= min(losses) and max(losses) <= 0 and losses[-1] < losses[0]


def test_synthetic_labels_are_nested_maps_thresholded_from_the_first_channel():
    task = UNet3DTask(load_recipe(RECIPES / "unet3d-cpu.yaml"))
    x, y = task.synthetic_batch(2, seed=5)
    assert y.shape == (2, 32, 32, 32, 3) and y.dtype == tf.float32 and y.shape == task.label_spec(2).shape
    y, signal = y.numpy(), x.numpy()[..., 0]
    np.testing.assert_allclose(y.reshape(-1, 3).mean(axis=0), [1 / 2, 1 / 4, 1 / 8], atol=1e-3)
    assert (y[..., 1] <= y[..., 0]).all() and (y[..., 2] <= y[..., 1]).all()  # enhancing in core in whole
    for k in range(3):  # each map is one threshold of the input's first channel: learnable
        assert signal[y[..., k] == 1].min() >= signal[y[..., k] == 0].max()


def op_names(task_overrides: list[str]) -> set[str]:
    """The op names of the task's traced training step (forward, Dice loss, backward, Adam)."""
    from launcher.rank.training import build_training

    keras.backend.clear_session()  # layer names restart, as for the plan command's twin
    setup = build_training(load_recipe(RECIPES / "unet3d-cpu.yaml", task_overrides), ranks=1, device="/device:CPU:0")
    graph = setup.step.get_concrete_function(*setup.specs).graph
    return {op.name for op in graph.get_operations()}


def test_the_smallest_input_builds_the_same_ops_under_the_same_names():
    recipe_overrides = ["model.levels=3", "model.base_filters=2", "train.batch_size=1"]
    task = UNet3DTask(load_recipe(RECIPES / "unet3d-cpu.yaml", recipe_overrides))
    assert task.smallest_input_shape() == [8, 8, 8, 4]  # two voxels a side at the bottom level
    shape = lambda side: [f"model.input_shape=[{side},{side},{side},4]"]  # noqa: E731
    twin = op_names(recipe_overrides + shape(8))
    assert twin == op_names(recipe_overrides + shape(32))
    # One voxel at the bottom is not a twin: there instance norm broadcasts over nothing, and the
    # gradient of its broadcasting ops has no sums to undo it.
    assert twin - op_names(recipe_overrides + shape(4))


def test_the_trained_model_file_loads_and_holds_the_weights(tmp_path):
    """The upsampling layer is registered with Keras (package lms_launch): a program that imports
    launcher.rank.tasks.unet3d loads the file without passing custom_objects."""
    model = unet3d([8, 8, 8, 2], labels=2, levels=2, base_filters=2)
    x = np.random.default_rng(4).normal(size=(1, 8, 8, 8, 2)).astype(np.float32)
    model(x, training=True)  # advances the dropout layers' seed states
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    np.testing.assert_array_equal(loaded(x, training=False).numpy(), model(x, training=False).numpy())
    for saved, original in zip(loaded.weights, model.weights):
        np.testing.assert_array_equal(saved.numpy(), original.numpy())
    # Each dropout layer's seed state is a variable of the model but not one of its weights, and
    # Keras's model file does not keep it: a fingerprint of model.variables differs after loading.
    seeds = [v for v in model.variables if "seed_generator" in v.path]
    assert len(seeds) == 2 and len(model.variables) == len(model.weights) + 2
