"""One training loop for every task: build the model and its step, train, measure.

Keras 3 variables break `hvd.DistributedGradientTape` and `horovod.tensorflow.keras`, so the step
averages gradients with the tensor-level `hvd.grouped_allreduce` (and launcher.rank.collectives
broadcasts the initial weights with `hvd.broadcast`). With one rank the step has no collective and
Horovod is not imported.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import keras
import numpy as np
import tensorflow as tf

from launcher.config import Recipe, TrainConfig
from launcher.rank.collectives import RankContext, barrier
from launcher.rank.metrics import DeviceMemoryMonitor, IntervalRecord, host_rss_bytes
from launcher.rank.tasks.base import Task

if TYPE_CHECKING:
    from launcher.rank.checkpoint import Checkpointer
    from launcher.rank.stop import StopRequest


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
    from launcher.rank.tasks import build_task

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
    """The training step as a tf.function: forward, backward, allreduce (with more than one rank),
    update. Returns the loss."""
    if ranks > 1:
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
            # An embedding's gradient is IndexedSlices, on which Horovod's grouped_allreduce fails
            # under Keras 3 (no dense_shape): reduce it dense, as Horovod's sparse_as_dense option does.
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
            grads = hvd.grouped_allreduce(grads, op=hvd.Average)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    return train_step


def weights_fingerprint(variables: list) -> str:
    """sha256 of every weight's bytes: equal fingerprints mean bit-identical replicas."""
    digest = hashlib.sha256()
    for variable in variables:
        digest.update(np.ascontiguousarray(keras.ops.convert_to_numpy(variable.value)).tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class TrainResult:
    """What the loop hands back: the interval records, losses, and where and why it ended."""

    records: list[IntervalRecord]
    initial_loss: float  # loss of the first step this process ran (after a resume: the step after the checkpoint)
    final_loss: float
    last_step: int
    stopped_by: str = ""  # the signal's name when the ranks were asked to stop early; empty when training finished
    stop_status: int = 0  # the exit status a stopped rank ends with (128 + the signal number)
    last_checkpoint: Path | None = None  # the newest checkpoint this run saved, if any


def train(step: Callable, batches, recipe: Recipe, ctx: RankContext, task: Task,
          optimizer: keras.optimizers.Optimizer, on_interval: Callable[[list[IntervalRecord]], None],
          start_step: int = 0, checkpointer: "Checkpointer | None" = None, stop: "StopRequest | None" = None,
          ) -> TrainResult:
    """Runs steps `start_step + 1` to `train.steps`. The first `logging.skip_steps` this process runs
    are not measured; after them, every `logging.interval` steps (and at the end) one record is made
    and handed to `on_interval`, which gathers the ranks' records (a collective: every rank calls it
    the same number of times). After each step the ranks agree whether to stop (`stop`) and save a
    checkpoint when it is due or they stop (`checkpointer`); both are collectives too."""
    train_cfg = recipe.train
    intervals = _Intervals(recipe, ctx, task, optimizer, on_interval)
    # A resumed rank reads on from where its input was at the checkpoint: the batches of the steps
    # already trained are drawn and dropped (nothing to do for synthetic data, which repeats one batch).
    for _ in range(start_step):
        next(batches)
    for step_number in range(start_step + 1, train_cfg.steps + 1):
        inputs, labels = next(batches)
        loss = step(inputs, labels)
        intervals.after_step(step_number, step_number - start_step, loss, task.target_tokens(labels))
        stopping = stop is not None and stop.agreed()
        if checkpointer is not None and (checkpointer.due(step_number, last_step=step_number == train_cfg.steps)
                                         or (stopping and checkpointer.enabled)):
            checkpointer.save(step_number)
        if stopping:
            stop.close()
            barrier(ctx)  # no rank leaves (and makes horovodrun end the others) while rank 0 still writes
            return TrainResult(intervals.records, intervals.initial_loss, float(loss), step_number, stop.signal_name,
                               stop.exit_status, saved(checkpointer))
    final_loss = float(loss)
    if stop is not None:
        stop.close()
    return TrainResult(intervals.records, intervals.initial_loss, final_loss, train_cfg.steps,
                       last_checkpoint=saved(checkpointer))


class _Intervals:
    """The measured intervals of a rank's training: from the end of the first `logging.skip_steps`
    steps, one record every `logging.interval` steps and at the last, each handed to `on_interval`."""

    def __init__(self, recipe: Recipe, ctx: RankContext, task: Task, optimizer, on_interval: Callable):
        self.recipe, self.ctx, self.optimizer, self.on_interval = recipe, ctx, optimizer, on_interval
        self.voxels = task.voxels_per_sample()
        self.memory = DeviceMemoryMonitor(ctx.device)
        self.records: list[IntervalRecord] = []
        self.initial_loss = float("nan")
        self._restart()

    def _restart(self) -> None:
        self.started = time.perf_counter()
        self.steps = 0
        self.tokens = None  # real target tokens of the interval's steps (sequence tasks), on the device

    def after_step(self, step_number: int, done: int, loss, tokens) -> None:
        """`done`: steps this process has run, this one included."""
        self.steps += 1
        if tokens is not None:
            self.tokens = tokens if self.tokens is None else self.tokens + tokens
        if done == 1:
            self.initial_loss = float(loss)
        log_cfg = self.recipe.logging
        measuring_starts = done == log_cfg.skip_steps
        interval_ends = done > log_cfg.skip_steps and (
            (done - log_cfg.skip_steps) % log_cfg.interval == 0 or step_number == self.recipe.train.steps)
        if not (measuring_starts or interval_ends):
            return
        loss_value = float(loss)  # fetching the loss waits for the device: the interval ends here
        if interval_ends:
            record = self._record(step_number, loss_value, time.perf_counter() - self.started)
            self.records.append(record)
            self.on_interval([record])
        self.memory.reset()
        self._restart()

    def _record(self, step_number: int, loss: float, elapsed: float) -> IntervalRecord:
        ctx, rate = self.ctx, self.recipe.train.batch_size * self.steps / elapsed
        return IntervalRecord(
            rank=ctx.rank, host=ctx.host, device=ctx.device, step=step_number, steps=self.steps,
            step_time_s=elapsed / self.steps, samples_per_sec=rate,
            voxels_per_sec=rate * self.voxels if self.voxels else None,
            peak_memory_bytes=self.memory.peak_bytes(), host_rss_bytes=host_rss_bytes(), loss=loss,
            learning_rate=float(current_learning_rate(self.optimizer)), end_time_s=time.time(),
            tokens_per_sec=None if self.tokens is None else int(self.tokens) / elapsed)


def saved(checkpointer: "Checkpointer | None") -> Path | None:
    return checkpointer.last_saved if checkpointer is not None else None


def current_learning_rate(optimizer: keras.optimizers.Optimizer) -> float:
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    lr = inner.learning_rate
    return float(keras.ops.convert_to_numpy(lr))
