"""Small Keras models and their training steps, shared by the LMS tests and the
benchmarks: the paper's two networks at toy sizes and four more architectures: branches (a
DenseNet-style block, a Transformer encoder block), depthwise convolutions (MobileNetV2's inverted
residuals) and recurrence (an unrolled LSTM)."""
from __future__ import annotations

import keras
import tensorflow as tf
from keras import layers

from launcher.rank.tasks.unet3d import unet3d


def resnet50() -> tuple[keras.Model, tuple]:
    """Batch 4 with three classes in it: at batch 2 (one class) the first step drives the logits so
    far that the float32 loss is exactly 0 from the second step on, and later steps test nothing."""
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10, classifier_activation=None)
    return model, ((4, 32, 32, 3), (4,))


def small_unet3d() -> tuple[keras.Model, tuple]:
    """The paper's 3D U-Net (Isensee et al. 2017) with 4 levels from 4 filters at 16^3: instance
    norm, spatial dropout (its masks come from each layer's seed state, a variable, so two builds
    with one seed draw the same masks, swapped or not), strided convolutions, nearest upsampling
    and deep supervision summed over three levels. Labels here are one class per voxel for the
    generic cross-entropy step; the task's own loss is tested in tests/test_unet3d.py."""
    return unet3d([16, 16, 16, 2], labels=3, levels=4, base_filters=4), ((1, 16, 16, 16, 2), (1, 16, 16, 16))


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


def mobilenet_v2_blocks() -> tuple[keras.Model, tuple]:
    """A stem and three inverted residual blocks (Sandler et al. 2018): 1x1 expansion, 3x3 depthwise
    convolution, 1x1 projection, batch norm and ReLU6, with a residual where the shape allows."""
    def block(x, expand: int, filters: int, stride: int):
        y = layers.ReLU(6.0)(layers.BatchNormalization()(layers.Conv2D(expand * x.shape[-1], 1, use_bias=False)(x)))
        y = layers.DepthwiseConv2D(3, strides=stride, padding="same", use_bias=False)(y)
        y = layers.ReLU(6.0)(layers.BatchNormalization()(y))
        y = layers.BatchNormalization()(layers.Conv2D(filters, 1, use_bias=False)(y))
        return layers.Add()([x, y]) if stride == 1 and x.shape[-1] == filters else y

    inputs = keras.Input((32, 32, 3))
    x = layers.ReLU(6.0)(layers.BatchNormalization()(layers.Conv2D(8, 3, strides=2, padding="same")(inputs)))
    x = block(x, expand=4, filters=8, stride=1)
    x = block(x, expand=4, filters=16, stride=2)
    x = block(x, expand=4, filters=16, stride=1)
    return keras.Model(inputs, layers.Dense(5)(layers.GlobalAveragePooling2D()(x))), ((4, 32, 32, 3), (4,))


def lstm() -> tuple[keras.Model, tuple]:
    """Two stacked LSTM layers over 8 time steps, unrolled (Keras `unroll=True`), so the recurrence
    is plain ops whose per-step activations live until the backward pass reaches them: the
    sequence-model case of Meng et al. (2017). A rolled LSTM is a While loop: see `rolled_lstm`."""
    inputs = keras.Input((8, 6))
    x = layers.LSTM(16, return_sequences=True, unroll=True)(inputs)
    x = layers.LSTM(16, unroll=True)(x)
    return keras.Model(inputs, layers.Dense(5)(x)), ((4, 8, 6), (4,))


def rolled_lstm(batch: int = 4, steps: int = 8, features: int = 6, units: int = 16, classes: int = 5,
                layers_count: int = 2):
    """Held out from ARCHITECTURES (the generic tests run those): `layers_count` (two) stacked Keras
    LSTM layers left rolled, so each is a `While` loop whose per-step activations reach the backward pass as
    TensorList accumulators (lms_core.loops), as a Seq2Seq model's do (Meng et al. 2017). Keras runs
    an LSTM through cuDNN on a GPU when it can; traced on a CPU it is this loop."""
    def build() -> tuple[keras.Model, tuple]:
        x = inputs = keras.Input((steps, features))
        for _ in range(layers_count - 1):
            x = layers.LSTM(units, return_sequences=True)(x)
        x = layers.LSTM(units)(x)
        return keras.Model(inputs, layers.Dense(classes)(x)), ((batch, steps, features), (batch,))
    return build


def resnet50_imagenet(batch: int):
    """ResNet-50 at 224x224 with 1000 classes, as in the papers, for `training_step`."""
    def build() -> tuple[keras.Model, tuple]:
        model = keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=1000,
                                            classifier_activation=None)
        return model, ((batch, 224, 224, 3), (batch,))
    return build


ARCHITECTURES = {"resnet50": resnet50, "unet3d": small_unet3d, "densenet_block": dense_block,
                 "transformer_block": transformer_block, "mobilenet_v2": mobilenet_v2_blocks, "lstm": lstm}


def training_step(build, seed: int = 0, device: str | None = None):
    """(model, optimizer, tf.function step, specs, one batch): the same every time for one seed.
    The weights and optimizer state live on `device` (default: TensorFlow's)."""
    keras.utils.set_random_seed(seed)
    with tf.device(device):
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
    with tf.device(device):
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
