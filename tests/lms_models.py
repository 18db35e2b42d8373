"""Small Keras models and their training steps, for the LMS tests: the paper's two networks at toy
sizes and two more architectures with branches (a DenseNet-style block, a Transformer encoder block)."""
from __future__ import annotations

import keras
import tensorflow as tf
from keras import layers

from launcher.tasks.unet3d import unet3d


def resnet50() -> tuple[keras.Model, tuple]:
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10, classifier_activation=None)
    return model, ((2, 32, 32, 3), (2,))


def small_unet3d() -> tuple[keras.Model, tuple]:
    return unet3d([16, 16, 16, 2], classes=3, depth=3, base_filters=4), ((1, 16, 16, 16, 2), (1, 16, 16, 16))


def dense_block() -> tuple[keras.Model, tuple]:
    """Every layer reads the concatenation of all earlier ones (Huang et al. 2017)."""
    inputs = keras.Input((16, 16, 8))
    features = [layers.Conv2D(8, 3, padding="same")(inputs)]
    for _ in range(4):
        x = layers.Concatenate()(features) if len(features) > 1 else features[0]
        x = layers.BatchNormalization()(x)
        x = layers.ReLU()(x)
        features.append(layers.Conv2D(8, 3, padding="same")(x))
    x = layers.GlobalAveragePooling2D()(layers.Concatenate()(features))
    return keras.Model(inputs, layers.Dense(5)(x)), ((4, 16, 16, 8), (4,))


def transformer_block() -> tuple[keras.Model, tuple]:
    """Self-attention and an MLP, each with a residual branch and layer norm (Vaswani et al. 2017)."""
    inputs = keras.Input((32, 16))
    attention = layers.MultiHeadAttention(num_heads=2, key_dim=8)(inputs, inputs)
    x = layers.LayerNormalization()(inputs + attention)
    mlp = layers.Dense(16)(layers.Dense(64, activation="gelu")(x))
    x = layers.LayerNormalization()(x + mlp)
    return keras.Model(inputs, layers.Dense(5)(layers.GlobalAveragePooling1D()(x))), ((4, 32, 16), (4,))


def resnet50_imagenet(batch: int):
    """ResNet-50 at 224x224 with 1000 classes, as in the papers, for `training_step`."""
    def build() -> tuple[keras.Model, tuple]:
        model = keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=1000,
                                            classifier_activation=None)
        return model, ((batch, 224, 224, 3), (batch,))
    return build


ARCHITECTURES = {"resnet50": resnet50, "unet3d": small_unet3d, "densenet_block": dense_block,
                 "transformer_block": transformer_block}


def training_step(build, seed: int = 0):
    """(model, optimizer, tf.function step, specs, one batch): the same every time for one seed."""
    keras.utils.set_random_seed(seed)
    model, (input_shape, label_shape) = build()
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    optimizer.build(model.trainable_variables)
    classes = model.output_shape[-1]

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    specs = (tf.TensorSpec(input_shape, tf.float32), tf.TensorSpec(label_shape, tf.int32))
    batch = (tf.random.stateless_uniform(input_shape, seed=[seed, 1]),
             tf.random.stateless_uniform(label_shape, seed=[seed, 2], maxval=classes, dtype=tf.int32))
    return model, optimizer, step, specs, batch


def conv_relu_step(input_shape: tuple[int, int, int], batch: int, blocks: int = 1, filters: int = 4, classes: int = 3):
    """`blocks` x (Conv2D -> ReLU), average pooling, a dense classifier, plain SGD: the smallest step
    whose ReLU outputs are long-lived. Returns (tf.function step, input specs)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input(input_shape)
    x = inputs
    for _ in range(blocks):
        x = layers.ReLU()(layers.Conv2D(filters, 3, padding="same")(x))
    model = keras.Model(inputs, layers.Dense(classes)(layers.GlobalAveragePooling2D()(x)))
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=model(x)))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return step, (tf.TensorSpec([batch, *input_shape]), tf.TensorSpec([batch], tf.int32))
