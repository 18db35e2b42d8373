"""A small vision transformer (Dosovitskiy et al. 2020, "An Image is Worth 16x16 Words"), trained by
lms-launch through its own builder: `model.builder: tiny_vit:build` in tiny-vit-cpu.yaml, beside
this file. None of lms-launch's built-in models; everything lms-launch needs from it is what `build`
returns (launcher/rank/tasks/builder.py, docs/own-model.md).

The network: a patch embedding (a convolution with the patch as kernel and stride), a learned
position embedding, `depth` pre-norm encoder blocks (multi-head self-attention, then a GELU MLP,
each with a residual), a final layer norm, the mean over the patches, and a linear head that gives
one logit per class.
"""
from __future__ import annotations

import keras
import tensorflow as tf
from keras import layers

from launcher.rank.tasks.builder import BuiltModel, ModelSpec


@keras.saving.register_keras_serializable(package="tiny_vit")
class PositionEmbedding(layers.Layer):
    """Adds a learned vector per patch position to the patch embeddings [B, patches, width]."""

    def build(self, input_shape):
        self.positions = self.add_weight(shape=tuple(input_shape[1:]), initializer=keras.initializers.RandomNormal(
            stddev=0.02), name="positions")

    def call(self, patches):
        return patches + keras.ops.cast(self.positions, patches.dtype)


def encoder_block(x, index: int, width: int, heads: int, mlp: int):
    y = layers.LayerNormalization(epsilon=1e-6, name=f"block{index}_norm1")(x)
    y = layers.MultiHeadAttention(heads, width // heads, name=f"block{index}_attention")(y, y)
    x = layers.Add(name=f"block{index}_add1")([x, y])
    y = layers.LayerNormalization(epsilon=1e-6, name=f"block{index}_norm2")(x)
    y = layers.Dense(mlp, activation="gelu", name=f"block{index}_mlp1")(y)
    y = layers.Dense(width, name=f"block{index}_mlp2")(y)
    return layers.Add(name=f"block{index}_add2")([x, y])


def vision_transformer(input_shape, classes: int, patch_size: int, width: int, depth: int, heads: int,
                       mlp: int) -> keras.Model:
    height, wide, _ = input_shape
    if height % patch_size or wide % patch_size:
        raise ValueError(f"tiny_vit: the image sides {height}x{wide} must be multiples of patch_size {patch_size}")
    if width % heads:
        raise ValueError(f"tiny_vit: width {width} must be a multiple of heads {heads}")
    images = keras.Input(shape=tuple(input_shape), name="images")
    x = layers.Conv2D(width, patch_size, strides=patch_size, name="patch_embedding")(images)
    x = layers.Reshape(((height // patch_size) * (wide // patch_size), width), name="patches")(x)
    x = PositionEmbedding(name="position_embedding")(x)
    for index in range(depth):
        x = encoder_block(x, index, width, heads, mlp)
    x = layers.LayerNormalization(epsilon=1e-6, name="final_norm")(x)
    x = layers.GlobalAveragePooling1D(name="mean_over_patches")(x)
    # Zero-initialised head, as in the ViT paper: every class starts at the same logit (loss ln(classes)).
    logits = layers.Dense(classes, kernel_initializer="zeros", dtype="float32", name="head")(x)
    return keras.Model(images, logits, name="tiny_vit")


def build(spec: ModelSpec, *, classes: int = 10, patch_size: int = 4, width: int = 64, depth: int = 4,
          heads: int = 4, mlp: int = 128) -> BuiltModel:
    """lms-launch's entry point: the options are the recipe's model.options."""
    model = vision_transformer(spec.input_shape, classes, patch_size, width, depth, heads, mlp)

    def loss(labels, logits):
        per_sample = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=tf.cast(logits, tf.float32))
        return tf.reduce_mean(per_sample)

    rows, cols = spec.input_shape[0] // patch_size, spec.input_shape[1] // patch_size

    def synthetic_batch(batch_size: int, seed: int):
        # Learnable on purpose: noise, with the patch at position `label` brightened.
        if classes > rows * cols:
            raise ValueError(f"tiny_vit: {classes} classes need as many patches; {spec.input_shape} has {rows * cols}")
        labels = tf.random.stateless_uniform([batch_size], seed=[seed, 1], maxval=classes, dtype=tf.int32)
        marks = tf.reshape(tf.one_hot(labels, rows * cols), [batch_size, rows, cols, 1])
        marks = tf.repeat(tf.repeat(marks, patch_size, axis=1), patch_size, axis=2)
        noise = tf.random.stateless_uniform([batch_size, *spec.input_shape], seed=[seed, 0])
        return noise + marks, labels

    channels = spec.input_shape[-1]
    return BuiltModel(model=model, loss=loss, label_spec=tf.TensorSpec([], tf.int32),
                      synthetic_batch=synthetic_batch,
                      smallest_input_shape=(2 * patch_size, 2 * patch_size, channels),  # 4 patches: the same ops
                      record_kind="images", label_count=classes)
