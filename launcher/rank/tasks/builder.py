"""Your own model: a recipe's `model.builder: module:function` names a function in your code that
builds it, and this task drives it like the built-in ones (LMS, `plan`, `bench`, checkpoints,
metrics). The contract, in short (docs/own-model.md has it in full, with an example):

    from launcher.rank.tasks.builder import BuiltModel, ModelSpec

    def build(spec: ModelSpec, *, classes: int = 10) -> BuiltModel:   # options: model.options
        model = ...                       # a keras.Model with one input of shape spec.input_shape
        return BuiltModel(model=model, loss=my_loss, label_spec=tf.TensorSpec([], tf.int32),
                          synthetic_batch=my_batch)

- The input shape reaches the builder as `spec.input_shape` (`model.input_shape`, without the batch).
  The model must accept any batch: lms-launch traces it at the recipe's batch, `bench max-batch`
  at others, and `plan` checks its rewrite at batch 2 on `smallest_input_shape`.
- The batch size reaches `synthetic_batch(batch_size, seed)` and the traced step, never the builder.
- `loss(labels, outputs)` returns the batch's scalar loss; `outputs` is what the model returns.
- The builder is called in every rank after the Keras mixed-precision policy is set
  (`train.precision`) and the seed, inside the rank's device scope; importing its module must not
  run TensorFlow ops (the rank picks its devices after the recipe is loaded).

The module is imported when the recipe is loaded (so a missing module, function or option fails
before anything starts, exit 2); what the function returns is checked when a rank builds it.
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import sys
from dataclasses import dataclass
from typing import Callable

import keras
import tensorflow as tf

from launcher.config import ModelConfig, Recipe
from launcher.rank.tasks.base import Task
from launcher.recipe import RecipeError

RECORD_KINDS = ("images", "volumes", "sequences")  # launcher.rank.data.tfrecord's schemas (docs/data.md)


class BuilderError(RecipeError, ValueError):
    """`model.builder` cannot be used; the message names the builder and what to change. A recipe
    error (exit 2) where the commands catch those."""


@dataclass(frozen=True)
class ModelSpec:
    """What lms-launch hands your builder (its first argument)."""

    input_shape: tuple[int, ...]
    """One sample's shape without the batch: the recipe's `model.input_shape` (`bench
    max-resolution` and `plan`'s check call the builder again with other sides)."""

    precision: str
    """`train.precision`: `float32` or `mixed_float16`; Keras's global policy is already set to it."""

    seed: int
    """`train.seed`; Keras's global seed is already set to it, so every rank builds the same weights."""


@dataclass(frozen=True)
class BuiltModel:
    """What your builder returns."""

    model: keras.Model
    """The network, freshly initialised, with one input of shape `ModelSpec.input_shape` (any batch)."""

    loss: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]
    """`loss(labels, outputs)`: the batch's scalar float32 loss; `outputs` is what `model` returns.
    Traced into the training step: TensorFlow ops only."""

    label_spec: tf.TensorSpec
    """One sample's labels, without the batch: e.g. `tf.TensorSpec([], tf.int32)` for a class id."""

    synthetic_batch: Callable[[int, int], tuple[tf.Tensor, tf.Tensor]] | None = None
    """`synthetic_batch(batch_size, seed) -> (inputs, labels)`: one batch made on the current device,
    for `data.source: synthetic` (labels a function of the inputs, so the loss really falls). Each
    rank calls it once, with the recipe's seed plus its rank."""

    smallest_input_shape: tuple[int, ...] | None = None
    """The smallest input that builds the same layers and ops (only smaller tensors): `lms-launch
    plan` checks the rewrite of a step too large for this machine on it. None: `input_shape`."""

    record_kind: str | None = None
    """For `data.source: tfrecord`: how the files store samples, `images`, `volumes` or `sequences`
    (docs/data.md). None: synthetic data only."""

    label_count: int | None = None
    """With `record_kind`: what the files' labels are checked against (classes, label maps, tokens)."""


def split_builder(text: str) -> tuple[str, str]:
    module, _, function = text.partition(":")
    return module, function


def resolve_builder(model: ModelConfig) -> Callable[..., BuiltModel]:
    """The builder function of `model.builder`, imported (from `model.builder_dir` first, then the
    Python path), with `model.options` checked against its parameters. Raises BuilderError."""
    module_name, function_name = split_builder(model.builder)
    if model.builder_dir and model.builder_dir not in sys.path:
        sys.path.insert(0, model.builder_dir)
    where = f"{model.builder_dir} (the recipe's folder) or the Python path" if model.builder_dir else "the Python path"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise BuilderError(f"model.builder: no module {err.name!r} in {where}; put {module_name.replace('.', '/')}"
                               f".py beside the recipe, or add its folder to PYTHONPATH") from None
        raise BuilderError(f"model.builder: importing {module_name!r} failed: {err}") from None
    except Exception as err:  # the user's module raised while it was imported
        raise BuilderError(f"model.builder: importing {module_name!r} ({_file_of(module_name)}) raised "
                           f"{type(err).__name__}: {err}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        functions = [n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")]
        close = difflib.get_close_matches(function_name, functions, n=1)
        hint = f"; did you mean {module_name}:{close[0]}?" if close else f" (its functions: {', '.join(functions) or 'none'})"
        raise BuilderError(f"model.builder: {module_name} ({module.__file__}) has no function {function_name!r}{hint}")
    check_options(model, function)
    return function


def check_options(model: ModelConfig, function: Callable) -> None:
    """`model.options` must bind to the builder's keyword parameters after its ModelSpec."""
    signature = inspect.signature(function)
    try:
        signature.bind(None, **model.options)
    except TypeError as err:
        names = [p.name for p in list(signature.parameters.values())[1:]
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = [k for k in model.options if k not in names]
        if unknown and not any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values()):
            close = difflib.get_close_matches(unknown[0], names, n=1)
            hint = f"; did you mean 'model.options.{close[0]}'?" if close else ""
            raise BuilderError(f"unknown key 'model.options.{unknown[0]}'{hint} ({model.builder} takes: "
                               f"{', '.join(names) or 'no options'})") from None
        raise BuilderError(f"model.options do not fit {model.builder}{signature}: {err}; its first parameter "
                           f"takes the ModelSpec, the others come from model.options") from None


def _file_of(module_name: str) -> str:
    module = sys.modules.get(module_name)
    return getattr(module, "__file__", None) or "its file"


class BuilderTask(Task):
    """The task of a recipe with `model.builder`: what the builder returns, behind the Task interface.
    The builder runs when the model is built (inside the rank's device scope), once per task."""

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        self.function = resolve_builder(recipe.model)
        self._built: BuiltModel | None = None

    @property
    def built(self) -> BuiltModel:
        if self._built is None:
            raise RuntimeError("BuilderTask: build_model() comes first")  # build_training's order keeps this
        return self._built

    @property
    def record_kind(self) -> str:  # read by Task.batches, after the model is built
        return self.built.record_kind or ""

    @property
    def label_count(self) -> int:
        return self.built.label_count or 0

    def build_model(self) -> keras.Model:
        recipe = self.recipe
        spec = ModelSpec(tuple(recipe.model.input_shape), recipe.train.precision, recipe.train.seed)
        self._built = check_built(self.function(spec, **recipe.model.options), recipe, spec)
        return self._built.model

    def loss(self, labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
        return self.built.loss(labels, outputs)

    def input_spec(self, batch_size: int) -> tf.TensorSpec:
        dtype = tf.as_dtype(self.built.model.inputs[0].dtype)
        return tf.TensorSpec([batch_size, *self.model_cfg.input_shape], dtype, name="inputs")

    def label_spec(self, batch_size: int) -> tf.TensorSpec:
        spec = self.built.label_spec
        return tf.TensorSpec([batch_size, *spec.shape], spec.dtype, name="labels")

    def synthetic_batch(self, batch_size: int, seed: int) -> tuple[tf.Tensor, tf.Tensor]:
        inputs, labels = self.built.synthetic_batch(batch_size, seed)
        for what, tensor, spec in (("inputs", inputs, self.input_spec(batch_size)),
                                   ("labels", labels, self.label_spec(batch_size))):
            if not spec.is_compatible_with(tensor):
                raise BuilderError(f"model.builder {self.model_cfg.builder}: synthetic_batch({batch_size}, {seed}) "
                                   f"gave {what} {tensor.dtype.name}{list(tensor.shape)}; the step takes "
                                   f"{spec.dtype.name}{spec.shape.as_list()}")
        return inputs, labels

    def smallest_input_shape(self) -> list[int]:
        if self._built is None:  # asked before any build (plan's twin): a throwaway build on the host
            with tf.device("/device:CPU:0"):
                self.build_model()
        return list(self.built.smallest_input_shape or self.model_cfg.input_shape)


def check_built(built, recipe: Recipe, spec: ModelSpec) -> BuiltModel:
    """What the builder returned, checked against the contract; raises BuilderError naming the breach."""
    name = recipe.model.builder

    def breach(what: str) -> BuilderError:
        return BuilderError(f"model.builder {name}: {what} (the contract: launcher/rank/tasks/builder.py, "
                            f"docs/own-model.md)")

    if not isinstance(built, BuiltModel):
        raise breach(f"returned {type(built).__name__}; it must return a launcher.rank.tasks.builder.BuiltModel")
    if not isinstance(built.model, keras.Model):
        raise breach(f"BuiltModel.model is a {type(built.model).__name__}, not a keras.Model")
    inputs = built.model.inputs if built.model.built else None
    if not inputs or len(inputs) != 1:
        raise breach("BuiltModel.model must have exactly one input (keras.Input(shape=spec.input_shape)); got "
                     + ("none built" if not inputs else f"{len(inputs)}"))
    shape = tuple(inputs[0].shape[1:])
    if shape != spec.input_shape:
        raise breach(f"the model's input is {list(shape)} per sample, but model.input_shape is "
                     f"{list(spec.input_shape)}; build it from spec.input_shape")
    if not callable(built.loss):
        raise breach("BuiltModel.loss must be a function loss(labels, outputs)")
    if not isinstance(built.label_spec, tf.TensorSpec):
        raise breach(f"BuiltModel.label_spec must be a tf.TensorSpec of one sample's labels; got {built.label_spec!r}")
    source = recipe.data.source
    if source == "synthetic" and built.synthetic_batch is None:
        raise breach("data.source is synthetic but BuiltModel.synthetic_batch is None; give one, or use "
                     "data.source: tfrecord with BuiltModel.record_kind")
    if source == "tfrecord" and built.record_kind not in RECORD_KINDS:
        raise breach(f"data.source is tfrecord, so BuiltModel.record_kind must be one of {', '.join(RECORD_KINDS)}; "
                     f"got {built.record_kind!r}")
    return built
