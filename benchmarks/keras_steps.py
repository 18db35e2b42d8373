"""The training step the benchmarks time: a Keras ResNet at ImageNet size with SGD and momentum."""
from __future__ import annotations


def resnet_step(name: str, batch: int):
    """`ResNet50`, `ResNet101` or `ResNet152` -> (tf.function step, input specs)."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, name)(weights=None, input_shape=(224, 224, 3), classes=1000,
                                              classifier_activation=None)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return step, (tf.TensorSpec([batch, 224, 224, 3]), tf.TensorSpec([batch], tf.int32))
