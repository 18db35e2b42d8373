"""ResNet-50 image classification (He et al. 2016), the ISMM 2019 paper's batch-size benchmark."""
from __future__ import annotations

import keras
import tensorflow as tf

from launcher.rank.tasks.base import Task, smooth_noise
from launcher.rank.tasks.fused_batch_norm import with_fused_batch_norm


class ResNet50Task(Task):
    record_kind = "images"

    @property
    def label_count(self) -> int:
        return self.model_cfg.classes

    def build_model(self) -> keras.Model:
        # weights=None builds offline; logits come out (no softmax) so the loss is computed in
        # float32 from logits, which is stable under mixed precision.
        model = keras.applications.ResNet50(
            weights=None, input_shape=tuple(self.model_cfg.input_shape),
            classes=self.model_cfg.classes, classifier_activation=None,
        )
        if self.model_cfg.batch_norm == "fused":
            # TF 1.x Keras's batch norm, which the LMS papers' ResNet-50 trained with.
            model = with_fused_batch_norm(model)
        return model

    def smallest_input_shape(self) -> list[int]:
        return [32, 32, self.model_cfg.input_shape[-1]]  # five stride-2 stages: 32 pixels reach 1x1

    def loss(self, labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
        outputs = tf.cast(outputs, tf.float32)
        per_sample = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=outputs)
        return tf.reduce_mean(per_sample)

    def label_spec(self, batch_size: int) -> tf.TensorSpec:
        return tf.TensorSpec([batch_size], tf.int32, name="labels")

    def synthetic_batch(self, batch_size: int, seed: int) -> tuple[tf.Tensor, tf.Tensor]:
        images = smooth_noise([batch_size, *self.model_cfg.input_shape], seed)
        # The class is the image's mean brightness, binned: a function of the input, so learnable.
        brightness = tf.reduce_mean(images, axis=[1, 2, 3])
        ranks = tf.argsort(tf.argsort(brightness))  # spread samples evenly over the classes
        labels = tf.cast(ranks * self.model_cfg.classes // batch_size, tf.int32)
        return images, labels
