"""The task interface: what differs between ResNet-50 and 3D U-Net, and nothing else."""
from __future__ import annotations

import abc
from typing import Iterator

import tensorflow as tf

from launcher.config import Recipe


class Task(abc.ABC):
    """A model, its inputs and its loss. The loop in `launcher.rank.training` drives any task."""

    #: How samples are stored in TFRecord files (see docs/data.md): `images`, `volumes` or `sequences`.
    record_kind: str

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.model_cfg = recipe.model

    @property
    @abc.abstractmethod
    def label_count(self) -> int:
        """What TFRecord labels are checked against: the classes (images, `model.classes`) or the
        binary label maps per voxel (volumes, `model.labels`) or the token ids (sequences,
        `model.vocabulary`)."""

    @abc.abstractmethod
    def build_model(self) -> "tf.keras.Model":
        """The network, randomly initialised (rank 0's weights are broadcast to the others)."""

    @abc.abstractmethod
    def loss(self, labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
        """Scalar float32 loss of one batch; `outputs` are the model's outputs: raw logits, or for a
        sampled softmax the states the loss projects (seq2seq)."""

    def trained_model(self, model: "tf.keras.Model") -> "tf.keras.Model":
        """What a run saves as model.keras: the network that gives the task's logits. The trained model
        itself, unless its loss holds a part of the network (seq2seq's sampled softmax)."""
        return model

    @abc.abstractmethod
    def label_spec(self, batch_size: int) -> tf.TensorSpec:
        """Shape and dtype of one batch of labels."""

    @abc.abstractmethod
    def synthetic_batch(self, batch_size: int, seed: int) -> tuple[tf.Tensor, tf.Tensor]:
        """One learnable random batch (labels depend on the inputs), made on the current device."""

    @abc.abstractmethod
    def smallest_input_shape(self) -> list[int]:
        """The smallest input, same channels, that builds the same network: the same layers and
        the same ops under the same names, only smaller tensors. `lms-launch plan` checks the LMS
        rewrite of a paper-sized step on this twin, which a CPU can run."""

    def input_spec(self, batch_size: int) -> tf.TensorSpec:
        return tf.TensorSpec([batch_size, *self.model_cfg.input_shape], tf.float32, name="inputs")

    def voxels_per_sample(self) -> int | None:
        """For volumetric tasks, voxels in one sample (reported as voxels/s); None for images."""
        return None

    def target_tokens(self, labels: tf.Tensor) -> tf.Tensor | None:
        """For sequence tasks, the real target tokens in a batch's labels, padding left out (reported
        as tokens/s); None otherwise. A tensor: the loop sums it on the device and reads it once per
        interval, when it waits for the device anyway."""
        return None

    def batches(self, batch_size: int, rank: int, size: int, device: str) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
        """Training batches for this rank, forever. TFRecord files are opened here, not at the first
        step, so a bad `data.path` fails before training with the reader's message."""
        data, seed = self.recipe.data, self.recipe.train.seed
        if data.source == "synthetic":
            # Made once, on the device: the loop then measures the model, not an input pipeline.
            with tf.device(device):
                batch = self.synthetic_batch(batch_size, seed + rank)  # every rank sees different samples
            return _forever(batch)
        from launcher.rank.data.tfrecord import read_dataset

        dataset = read_dataset(  # it offsets the shuffle seed by the rank itself
            data.path, kind=self.record_kind, input_shape=self.model_cfg.input_shape,
            classes=self.label_count, batch_size=batch_size, rank=rank, size=size, seed=seed,
            shuffle_buffer=data.shuffle_buffer, prefetch=data.prefetch, image_key=data.image_key,
            label_key=data.label_key, label_offset=data.label_offset,
        )
        return iter(dataset)


def _forever(batch):
    while True:
        yield batch


def smooth_noise(shape: list[int], seed: int, passes: int = 2) -> tf.Tensor:
    """Random values in [0, 1) blurred a little, so labels thresholded from them form blobs a
    convolutional net can learn (pure noise labels would only be memorised)."""
    values = tf.random.stateless_uniform(shape, seed=[seed, 0])
    rank = len(shape)
    pool = tf.nn.avg_pool2d if rank == 4 else tf.nn.avg_pool3d
    for _ in range(passes):
        values = pool(values, ksize=3, strides=1, padding="SAME")
    lo, hi = tf.reduce_min(values), tf.reduce_max(values)
    return (values - lo) / tf.maximum(hi - lo, 1e-6)
