"""3D U-Net segmentation (Cicek et al. 2016) of 4-channel brain-tumour volumes (BraTS-like), the
ISMM 2019 paper's image-resolution benchmark.

Layout: `depth` encoder levels of two 3x3x3 convolutions (+ batch norm) and ReLU, 2x2x2 max-pooling
between levels, filters doubling per level; the decoder mirrors it with 2x2x2 transposed
convolutions, concatenating the encoder's feature map of the same level (the skip connection); a
1x1x1 convolution gives per-voxel logits.
"""
from __future__ import annotations

import keras
import tensorflow as tf
from keras import layers

from launcher.rank.tasks.base import Task, smooth_noise


def unet3d(input_shape: list[int], classes: int, depth: int = 4, base_filters: int = 32,
           batch_norm: bool = True) -> keras.Model:
    def conv_block(x, filters: int, name: str):
        for i in (1, 2):
            x = layers.Conv3D(filters, 3, padding="same", use_bias=not batch_norm, name=f"{name}_conv{i}")(x)
            if batch_norm:
                x = layers.BatchNormalization(name=f"{name}_bn{i}")(x)
            x = layers.ReLU(name=f"{name}_relu{i}")(x)
        return x

    inputs = keras.Input(tuple(input_shape), name="volume")
    x = inputs
    skips = []
    for level in range(depth - 1):
        x = conv_block(x, base_filters * 2**level, f"enc{level}")
        skips.append(x)
        x = layers.MaxPooling3D(2, name=f"enc{level}_pool")(x)
    x = conv_block(x, base_filters * 2 ** (depth - 1), "bottom")
    for level in reversed(range(depth - 1)):
        x = layers.Conv3DTranspose(base_filters * 2**level, 2, strides=2, name=f"dec{level}_up")(x)
        x = layers.Concatenate(name=f"dec{level}_concat")([skips[level], x])
        x = conv_block(x, base_filters * 2**level, f"dec{level}")
    logits = layers.Conv3D(classes, 1, name="logits", dtype="float32")(x)
    return keras.Model(inputs, logits, name="unet3d")


class UNet3DTask(Task):
    record_kind = "volumes"

    def build_model(self) -> keras.Model:
        cfg = self.model_cfg
        return unet3d(cfg.input_shape, cfg.classes, cfg.depth, cfg.base_filters, cfg.batch_norm)

    def smallest_input_shape(self) -> list[int]:
        side = 2 ** (self.model_cfg.depth - 1)  # one voxel at the bottom level
        return [side, side, side, self.model_cfg.input_shape[-1]]

    def loss(self, labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
        """Cross-entropy + (1 - mean soft Dice over classes): cross-entropy gives smooth early
        gradients, Dice keeps small tumour regions from being drowned by the background."""
        logits = tf.cast(outputs, tf.float32)
        cross_entropy = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        probs = tf.nn.softmax(logits)
        onehot = tf.one_hot(labels, depth=self.model_cfg.classes, dtype=tf.float32)
        axes = [0, 1, 2, 3]
        intersection = tf.reduce_sum(probs * onehot, axis=axes)
        total = tf.reduce_sum(probs, axis=axes) + tf.reduce_sum(onehot, axis=axes)
        dice = (2.0 * intersection + 1.0) / (total + 1.0)
        return cross_entropy + (1.0 - tf.reduce_mean(dice))

    def label_spec(self, batch_size: int) -> tf.TensorSpec:
        return tf.TensorSpec([batch_size, *self.model_cfg.input_shape[:3]], tf.int32, name="labels")

    def synthetic_batch(self, batch_size: int, seed: int) -> tuple[tf.Tensor, tf.Tensor]:
        volumes = smooth_noise([batch_size, *self.model_cfg.input_shape], seed)
        # Label each voxel by thresholding its first channel: tumour-like blobs of several classes.
        levels = tf.clip_by_value(volumes[..., 0], 0.0, 1.0 - 1e-6)
        labels = tf.cast(levels * self.model_cfg.classes, tf.int32)
        return volumes, labels

    def voxels_per_sample(self) -> int:
        d, h, w, _ = self.model_cfg.input_shape
        return d * h * w
