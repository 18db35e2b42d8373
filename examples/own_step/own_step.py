"""LMS on your own tf.function training step, through lms_core.api: no recipe, no ranks, no launcher.

    python examples/own_step/own_step.py

Rewrites a Keras MobileNetV2 step (batch 64 at 96x96) for a 400 MiB device on a PCIe gen4 link,
checks on the partitions TensorFlow executed that every swap-in waits for its trigger, prints the
plan report, and trains three steps with the rewritten step. docs/api.md explains each call.
"""
import tensorflow as tf

if tf.config.list_physical_devices("GPU"):
    COMPUTE, HOST = "/device:GPU:0", "/device:CPU:0"
else:
    # Without a GPU: two logical CPU devices, set before TensorFlow starts, so that the step is split
    # between a compute device (CPU:1) and a host (CPU:0) exactly as between a GPU and its host.
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    COMPUTE, HOST = "/device:CPU:1", "/device:CPU:0"

import keras
from lms_core import api

with tf.device(COMPUTE):
    model = keras.applications.MobileNetV2(weights=None, input_shape=(96, 96, 3), classes=10)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    optimizer.build(model.trainable_variables)

@tf.function
def train_step(images, labels):
    with tf.GradientTape() as tape:
        logits = model(images, training=True)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
    optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return loss

specs = (tf.TensorSpec([64, 96, 96, 3], tf.float32), tf.TensorSpec([64], tf.int32))
target = api.make_target(link="pcie4", device="a100", device_memory="400MiB", host_memory="8GiB")
config = api.LMSConfig(enabled=True, mode="auto")
rewritten, estimate = api.rewrite_within_estimate(train_step, *specs, config=config, target=target,
                                                  compute_device=COMPUTE, host_device=HOST)
with tf.device(COMPUTE):
    images = tf.random.uniform([64, 96, 96, 3])
    labels = tf.random.uniform([64], maxval=10, dtype=tf.int32)
gating = api.verify_gating(rewritten, images, labels)
print("\n".join(api.plan_report(rewritten, estimate, gating).lines()))
for step in range(3):  # the rewritten step updates the same variables as train_step would
    print(f"step {step}: loss {float(rewritten(images, labels)):.4f}")
