"""Batch normalization trained with TensorFlow's fused kernel, as the LMS papers' ResNet-50 ran it.

Keras 3 computes batch norm in training as moments and element-wise ops, and TensorFlow's gradient of
that is a chain of full-size element-wise ops whose three terms meet in an `AddN`: on ResNet-50 at a
large batch, several stem-sized temporaries live at once in every batch norm's gradient, which no swap
can move. TF 1.x Keras, which the LMS papers trained with, used the fused kernel wherever it could
(`BatchNormalization(fused=None)`): one `FusedBatchNormV3` forward and one `FusedBatchNormGradV3`
backward, holding the input, the output gradient and the input gradient. `model.batch_norm: fused`
(resnet50) builds the network with this layer in place of every `BatchNormalization`.

The same normalization: outputs and gradients agree with Keras's layer to float rounding
(tests/test_fused_batch_norm.py). The moving statistics are updated as Keras updates them, with the
batch's biased variance (the kernel reports the unbiased one, `n / (n - 1)` larger, for
TF 1.x's updates). Outside training, or where the fused kernel does not apply (a mask, an axis other
than the last, inputs not of rank 4 or 5), Keras's own computation runs.
"""
from __future__ import annotations

import keras
import tensorflow as tf
from keras import layers

FUSED_RANKS = {4: "NHWC", 5: "NDHWC"}  # the channels-last layouts FusedBatchNormV3 takes


@keras.saving.register_keras_serializable(package="lms_launch")
class FusedBatchNormalization(layers.BatchNormalization):
    """Keras's `BatchNormalization`, with the same variables and configuration, trained with
    `FusedBatchNormV3`."""

    def call(self, inputs, training=None, mask=None):
        rank = len(inputs.shape)
        if not (training and self.trainable) or mask is not None or rank not in FUSED_RANKS \
                or self.axis not in (-1, rank - 1) or self.renorm or self.synchronized:
            return super().call(inputs, training=training, mask=mask)
        x = tf.cast(inputs, tf.float32)  # as Keras: half-precision inputs are normalized in float32
        channels = x.shape[-1]
        scale = self.gamma if self.scale else tf.ones([channels])
        offset = self.beta if self.center else tf.zeros([channels])
        outputs, mean, unbiased_variance = tf.compat.v1.nn.fused_batch_norm(
            x, scale, offset, epsilon=self.epsilon, is_training=True, data_format=FUSED_RANKS[rank])
        count = tf.cast(tf.size(x, out_type=tf.int64) // channels, tf.float32)  # over 2^31 at large batches
        variance = unbiased_variance * (count - 1.0) / count
        self.moving_mean.assign(self.moving_mean * self.momentum + mean * (1.0 - self.momentum))
        self.moving_variance.assign(self.moving_variance * self.momentum + variance * (1.0 - self.momentum))
        return tf.cast(outputs, self.compute_dtype)


def with_fused_batch_norm(model: keras.Model) -> keras.Model:
    """A copy of `model` (freshly initialised, as built) with every `BatchNormalization` layer
    replaced by a `FusedBatchNormalization` of the same configuration: same names, same variables,
    same graph otherwise."""

    def clone(layer):
        if type(layer) is layers.BatchNormalization:
            return FusedBatchNormalization.from_config(layer.get_config())
        return layer.__class__.from_config(layer.get_config())

    return keras.models.clone_model(model, clone_function=clone)
