"""One training loop for every task: build, broadcast, trace, hand to LMS, train, measure.

Keras 3 variables break `hvd.DistributedGradientTape` and `horovod.tensorflow.keras` (DESIGN.md), so
the step averages gradients with the tensor-level `hvd.grouped_allreduce` and the initial broadcast
assigns `hvd.broadcast(v.value, 0)` to each variable.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from launcher.config import Recipe, TrainConfig
from launcher.metrics import DeviceMemoryMonitor, IntervalRecord, host_rss_bytes
from launcher.tasks.base import Task


@dataclass
class RankContext:
    """Who this process is among the ranks and what it computes on."""

    rank: int
    size: int
    local_rank: int
    host: str
    device: str  # "GPU:0" (the one GPU this rank sees) or "CPU:0"


@dataclass
class TrainingSetup:
    """Everything a rank trains with; built the same way by the worker and by `lms-launch plan`."""

    task: Task
    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    step: Callable
    specs: tuple  # (inputs, labels) TensorSpecs of one batch


def build_training(recipe: Recipe, ranks: int, device: str) -> TrainingSetup:
    """Model, optimizer (with its slots built, so they can be broadcast) and the traced-to-be step."""
    from launcher.tasks import build_task

    keras.utils.set_random_seed(recipe.train.seed)  # the same initial weights on every rank
    keras.mixed_precision.set_global_policy(recipe.train.precision)
    task = build_task(recipe)
    with tf.device(device):
        model = task.build_model()
        optimizer = build_optimizer(recipe.train, ranks)
        optimizer.build(model.trainable_variables)
    step = make_train_step(model, optimizer, task, ranks)
    batch = recipe.train.batch_size
    return TrainingSetup(task, model, optimizer, step, (task.input_spec(batch), task.label_spec(batch)))


def build_optimizer(train: TrainConfig, ranks: int) -> keras.optimizers.Optimizer:
    """SGD with momentum or Adam; linear warm-up then cosine decay; the rate scaled by the ranks."""
    peak_lr = train.learning_rate * (ranks if train.scale_lr_by_ranks else 1)
    decay_steps = max(1, train.steps - train.warmup_steps)
    if train.warmup_steps:
        schedule = keras.optimizers.schedules.CosineDecay(
            0.0, decay_steps, warmup_target=peak_lr, warmup_steps=train.warmup_steps)
    else:
        schedule = keras.optimizers.schedules.CosineDecay(peak_lr, decay_steps)
    if train.optimizer == "sgd":
        optimizer = keras.optimizers.SGD(learning_rate=schedule, momentum=train.momentum)
    else:
        optimizer = keras.optimizers.Adam(learning_rate=schedule)
    if train.precision == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


def make_train_step(model: keras.Model, optimizer: keras.optimizers.Optimizer, task: Task,
                    ranks: int) -> Callable:
    """The training step as a tf.function: forward, backward, allreduce, update. Returns the loss."""
    import horovod.tensorflow as hvd

    scale_loss = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    @tf.function
    def train_step(inputs, labels):
        with tf.GradientTape() as tape:
            outputs = model(inputs, training=True)
            loss = task.loss(labels, outputs)
            objective = optimizer.scale_loss(loss) if scale_loss else loss
        grads = tape.gradient(objective, model.trainable_variables)
        if ranks > 1:
            grads = hvd.grouped_allreduce(grads, op=hvd.Average)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    return train_step


def broadcast_from_rank0(variables: list) -> None:
    """Gives every rank rank 0's values (weights and optimizer state) before the first step."""
    import horovod.tensorflow as hvd

    @tf.function
    def broadcast():
        for i, variable in enumerate(variables):
            variable.assign(hvd.broadcast(variable.value, root_rank=0, name=f"broadcast_{i}"))

    broadcast()


def average_across_ranks(variables: list) -> None:
    """Averages non-trained state (batch-norm moving statistics), which each rank updates from its
    own batches, so the final model is the same everywhere."""
    import horovod.tensorflow as hvd

    if not variables:
        return

    @tf.function
    def average():
        means = hvd.grouped_allreduce([v.value for v in variables], op=hvd.Average)
        for variable, mean in zip(variables, means):
            variable.assign(mean)

    average()


def weights_fingerprint(variables: list) -> str:
    """sha256 of every weight's bytes: equal fingerprints mean bit-identical replicas."""
    digest = hashlib.sha256()
    for variable in variables:
        digest.update(np.ascontiguousarray(keras.ops.convert_to_numpy(variable.value)).tobytes())
    return digest.hexdigest()


def train(step: Callable, batches, recipe: Recipe, ctx: RankContext, task: Task,
          optimizer: keras.optimizers.Optimizer, on_interval: Callable[[list[IntervalRecord]], None]
          ) -> tuple[list[IntervalRecord], float, float]:
    """Runs `train.steps` steps. The first `logging.skip_steps` are not measured; after them, every
    `logging.interval` steps (and at the end) one record is made and handed to `on_interval`, which
    gathers the ranks' records (a collective: every rank calls it the same number of times)."""
    train_cfg, log_cfg = recipe.train, recipe.logging
    batch = train_cfg.batch_size
    voxels = task.voxels_per_sample()
    memory = DeviceMemoryMonitor(ctx.device)
    records: list[IntervalRecord] = []
    initial_loss = final_loss = float("nan")
    interval_start = time.perf_counter()
    interval_steps = 0

    for step_number in range(1, train_cfg.steps + 1):
        inputs, labels = next(batches)
        loss = step(inputs, labels)
        interval_steps += 1
        if step_number == 1:
            initial_loss = float(loss)
        measuring_starts = step_number == log_cfg.skip_steps
        interval_ends = step_number > log_cfg.skip_steps and (
            (step_number - log_cfg.skip_steps) % log_cfg.interval == 0 or step_number == train_cfg.steps)
        if measuring_starts or interval_ends:
            final_loss = float(loss)  # fetching the loss waits for the device: the interval ends here
            now = time.perf_counter()
            if interval_ends:
                elapsed = now - interval_start
                rate = batch * interval_steps / elapsed
                record = IntervalRecord(
                    rank=ctx.rank, host=ctx.host, device=ctx.device, step=step_number,
                    steps=interval_steps, step_time_s=elapsed / interval_steps, samples_per_sec=rate,
                    voxels_per_sec=rate * voxels if voxels else None,
                    peak_memory_bytes=memory.peak_bytes(), host_rss_bytes=host_rss_bytes(),
                    loss=final_loss, learning_rate=float(current_learning_rate(optimizer)),
                )
                records.append(record)
                on_interval([record])
            memory.reset()
            interval_start = time.perf_counter()
            interval_steps = 0
    final_loss = float(loss)
    return records, initial_loss, final_loss


def current_learning_rate(optimizer: keras.optimizers.Optimizer) -> float:
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    lr = inner.learning_rate
    return float(keras.ops.convert_to_numpy(lr))
