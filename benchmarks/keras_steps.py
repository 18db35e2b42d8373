"""The training steps the benchmarks time: a Keras ResNet at ImageNet size and the paper's 3D U-Net,
both with SGD and momentum."""
from __future__ import annotations


def resnet_step(name: str, batch: int):
    """`ResNet50`, `ResNet101` or `ResNet152` -> (tf.function step, input specs)."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, name)(weights=None, input_shape=(224, 224, 3), classes=1000,
                                              classifier_activation=None)
    return sgd_step(model), (tf.TensorSpec([batch, 224, 224, 3]), tf.TensorSpec([batch], tf.int32))


def unet3d_step(size: int):
    """The paper recipe's 3D U-Net (Isensee et al. 2017: 4 channels, 3 labels, 5 levels from 16
    filters, 8.27 M parameters) at size^3, batch 1 -> (tf.function step, input specs). Its loss is
    `sgd_step`'s cross-entropy on one class per voxel, not the recipe's soft Dice with Adam."""
    import keras
    import tensorflow as tf

    from launcher.rank.tasks.unet3d import unet3d

    keras.utils.set_random_seed(0)
    model = unet3d([size, size, size, 4], labels=3, levels=5, base_filters=16)
    return sgd_step(model), (tf.TensorSpec([1, size, size, size, 4]), tf.TensorSpec([1, size, size, size], tf.int32))


def sgd_step(model):
    """Forward, cross-entropy on integer labels, backward, SGD with momentum: one tf.function."""
    import keras
    import tensorflow as tf

    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return step
