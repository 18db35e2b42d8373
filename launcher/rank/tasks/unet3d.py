"""The 3D U-Net the LMS papers trained (TFLMS, ISMM 2019): Isensee et al. 2017, the BraTS 2017
network, segmenting 4-channel brain MRI volumes into three tumour label maps; ISMM's
image-resolution benchmark.

Every convolution is a *block*: Conv3D ('same', with bias) -> instance normalization (per sample
and channel over the volume, gamma and beta per channel) -> LeakyReLU(0.3).

- Encoder, `levels` levels with base_filters x 2^l filters (16 ... 256 in the paper): level l's
  input block is 3x3x3 (stride 2 below level 0: strided convolutions, no pooling); its context
  module is block -> SpatialDropout3D(dropout) -> block; the level's output is their sum (residual).
- Decoder, levels `levels`-2 down to 0: nearest-neighbour upsampling by 2 (`NearestUpsampling3D`,
  below: Keras's UpSampling3D with a leaner gradient) -> 3x3x3 block ->
  concatenate(the encoder's output at this level, the upsampled) -> 3x3x3 block -> 1x1x1 block.
- Deep supervision: at decoder levels 2, 1 and 0 (those there are) a 1x1x1 block with `labels`
  filters; o = up(seg2); o = up(o + seg1); o = o + seg0: the model's output, one logit per label.

The model returns those logits (float32); the loss applies the sigmoid (one independent binary map
per label: they overlap, so no softmax), and anyone using the trained model applies it too:
`keras.ops.sigmoid(model(x)) > 0.5`. At the paper's sizes (4 channels, 3 labels, 5 levels, 16 base
filters) it has 8,269,579 parameters (tests/test_unet3d.py derives the count layer by layer).

Spatial dropout draws its masks from each dropout layer's seed state, a variable of the model but
not one of its weights: ranks start from rank 0's broadcast state, so all drop the same channels in
a step; checkpoints keep the state (a resumed run draws the masks it would have drawn), the
`model.keras` file does not.
"""
from __future__ import annotations

import keras
import tensorflow as tf
from keras import layers

from launcher.rank.tasks.base import Task, smooth_noise

LEAKY_SLOPE = 0.3  # LeakyReLU's slope below zero, as in the paper (and old Keras's default alpha)
NORM_EPSILON = 1e-3  # added to the variance in instance normalization (Keras's default)
DICE_SMOOTHING = 1e-5  # keeps the Dice of an empty label map and an empty prediction at 1, not 0/0
SUPERVISED_LEVELS = 3  # deep supervision at decoder levels 2, 1 and 0


def instance_norm(name: str) -> layers.Layer:
    """Instance normalization: group normalization with one group per channel normalises each
    sample's channel over D, H and W, with a learned gamma and beta per channel (checked against a
    hand computation in tests/test_unet3d.py). Keras's own layer; it computes the statistics in
    float32 under mixed precision."""
    return layers.GroupNormalization(groups=-1, epsilon=NORM_EPSILON, name=name)


CUBE = [1, 2, 2, 2, 1]  # a 2x2x2 window and stride over D, H and W (NDHWC)


def upsample_nearest(x: tf.Tensor) -> tf.Tensor:
    """Nearest-neighbour upsampling by 2 of x [B, D, H, W, C], as one op whose gradient is one op.

    The op is the gradient of a 2x2x2 average pool, which spreads each value over its cube divided
    by 8: given 8x, every voxel of the cube gets x exactly (scaling by a power of two is exact).
    TensorFlow's gradient of it is the average pool itself, so the gradient of the upsampling is
    that pool times 8: each input voxel gets the sum of its cube's 8 output gradients.

    Why not Keras's UpSampling3D: it repeats along one axis at a time, and TensorFlow's gradient of
    that is 12 ops (per axis a reshape, a reshape, a sum, a reshape), all near-instant, so Grappler's
    memory estimate and lms-launch's simulator hold every intermediate of the chain at once: at 320^3
    the incoming gradient (3.91 GiB), its reshape (3.91 GiB) and the rest of the chain (7.8 GiB)
    beside the convolution gradients around it made a peak of 15.7 GiB that no swap could move
    (2026-11-25). Here the forward pass allocates the output and an eighth of it, the backward pass
    an eighth twice (the pool, then the scaling)."""
    if x.shape.is_fully_defined():
        # A constant: Grappler's shape inference cannot evaluate a computed shape, and its memory
        # estimate would size the output as nothing (measured: every dimension unknown).
        shape = tf.constant([size * factor for size, factor in zip(x.shape.as_list(), CUBE)], tf.int32)
    else:  # Keras's symbolic build, batch unknown
        shape = tf.shape(x, out_type=tf.int32) * tf.constant(CUBE, tf.int32)
    return tf.raw_ops.AvgPool3DGrad(orig_input_shape=shape, grad=x * tf.constant(8, x.dtype), ksize=CUBE,
                                    strides=CUBE, padding="VALID", data_format="NDHWC")


@keras.saving.register_keras_serializable(package="lms_launch")
class NearestUpsampling3D(layers.Layer):
    """Keras's `UpSampling3D(2)` (channels last) as `upsample_nearest` computes it: the same outputs
    exactly, gradients equal up to the order of an 8-term float sum."""

    def call(self, inputs):
        return upsample_nearest(inputs)

    def compute_output_shape(self, input_shape):
        b, d, h, w, c = input_shape
        return (b, *(None if size is None else 2 * size for size in (d, h, w)), c)


def unet3d(input_shape: list[int], labels: int = 3, levels: int = 5, base_filters: int = 16,
           dropout: float = 0.3) -> keras.Model:
    """The network at any size: `input_shape` [D, H, W, C] with D, H and W multiples of
    2^(levels-1). Layers are named by level (`enc2_ctx1_conv`, `dec0_loc2_norm`, `seg1_act`, ...)."""
    def block(x, filters: int, name: str, kernel: int = 3, strides: int = 1):
        x = layers.Conv3D(filters, kernel, strides=strides, padding="same", name=f"{name}_conv")(x)
        x = instance_norm(f"{name}_norm")(x)
        return layers.LeakyReLU(negative_slope=LEAKY_SLOPE, name=f"{name}_act")(x)

    filters = [base_filters * 2**level for level in range(levels)]
    inputs = keras.Input(tuple(input_shape), name="volume")
    x = inputs
    skips = []
    for level, width in enumerate(filters):
        entry = block(x, width, f"enc{level}_in", strides=1 if level == 0 else 2)
        context = block(entry, width, f"enc{level}_ctx1")
        context = layers.SpatialDropout3D(dropout, name=f"enc{level}_dropout")(context)
        context = block(context, width, f"enc{level}_ctx2")
        x = layers.Add(name=f"enc{level}_sum")([entry, context])
        skips.append(x)

    segmentations = {}
    for level in reversed(range(levels - 1)):
        up = NearestUpsampling3D(name=f"dec{level}_up")(x)
        up = block(up, filters[level], f"dec{level}_upconv")
        x = layers.Concatenate(name=f"dec{level}_concat")([skips[level], up])
        x = block(x, filters[level], f"dec{level}_loc1")
        x = block(x, filters[level], f"dec{level}_loc2", kernel=1)
        if level < SUPERVISED_LEVELS:
            segmentations[level] = block(x, labels, f"seg{level}", kernel=1)

    deepest = max(segmentations)
    out = segmentations[deepest]
    for level in range(deepest, 0, -1):  # o = up(seg2); o = up(o + seg1); o = o + seg0
        out = NearestUpsampling3D(name=f"seg{level}_up")(out)
        # The last sum is the output: float32 logits under mixed precision too.
        last = dict(name="logits", dtype="float32") if level == 1 else dict(name=f"seg{level - 1}_sum")
        out = layers.Add(**last)([out, segmentations[level - 1]])
    if deepest == 0:  # two levels: seg0 alone, still named and typed as the output
        out = layers.Activation("linear", name="logits", dtype="float32")(out)
    return keras.Model(inputs, out, name="unet3d")


def soft_dice_loss(labels: tf.Tensor, logits: tf.Tensor, smoothing: float = DICE_SMOOTHING) -> tf.Tensor:
    """Minus the mean soft Dice over batch and label: for each sample and label map,
    (2 sum(y p) + s) / (sum(y) + sum(p) + s) with p = sigmoid(logits), summed over the volume.
    The sigmoid is taken of float32 logits, so it saturates instead of overflowing."""
    probs = tf.sigmoid(tf.cast(logits, tf.float32))
    labels = tf.cast(labels, tf.float32)
    volume = [1, 2, 3]
    overlap = tf.reduce_sum(labels * probs, axis=volume)
    total = tf.reduce_sum(labels, axis=volume) + tf.reduce_sum(probs, axis=volume)
    return -tf.reduce_mean((2.0 * overlap + smoothing) / (total + smoothing))


def nested_masks(signal: tf.Tensor, labels: int) -> tf.Tensor:
    """[..., labels] float32 binary maps from `signal` [...]: map k marks the voxels whose signal
    lies in the top 2^-(k+1) of the batch's (a half, a quarter, an eighth, ...), so each map lies
    inside the one before, as BraTS's enhancing tumour lies inside the tumour core, inside the whole
    tumour."""
    ordered = tf.sort(tf.reshape(signal, [-1]))
    count = int(ordered.shape[0])
    cuts = tf.gather(ordered, [min(count - 1, int(count * (1 - 0.5 ** (k + 1)))) for k in range(labels)])
    return tf.cast(signal[..., None] >= cuts, tf.float32)


class UNet3DTask(Task):
    record_kind = "volumes"

    @property
    def label_count(self) -> int:
        return self.model_cfg.labels

    def build_model(self) -> keras.Model:
        cfg = self.model_cfg
        return unet3d(cfg.input_shape, cfg.labels, cfg.levels, cfg.base_filters, cfg.dropout)

    def smallest_input_shape(self) -> list[int]:
        # Two voxels a side at the bottom level, not one: over a single voxel instance norm's
        # statistics broadcast over nothing, and the gradient then lacks the sums that undo the
        # broadcast (TensorFlow leaves them out when the shapes are equal), so names would differ.
        side = 2 ** self.model_cfg.levels
        return [side, side, side, self.model_cfg.input_shape[-1]]

    def loss(self, labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
        return soft_dice_loss(labels, outputs)

    def label_spec(self, batch_size: int) -> tf.TensorSpec:
        # float32, as the loss multiplies them with probabilities: uint8 here would add a float32 copy.
        return tf.TensorSpec([batch_size, *self.model_cfg.input_shape[:3], self.model_cfg.labels], tf.float32,
                             name="labels")

    def synthetic_batch(self, batch_size: int, seed: int) -> tuple[tf.Tensor, tf.Tensor]:
        volumes = smooth_noise([batch_size, *self.model_cfg.input_shape], seed)
        # Tumour-like nested blobs, thresholded from the (smooth) first channel: learnable.
        return volumes, nested_masks(volumes[..., 0], self.model_cfg.labels)

    def voxels_per_sample(self) -> int:
        d, h, w, _ = self.model_cfg.input_shape
        return d * h * w
