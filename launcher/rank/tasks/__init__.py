"""Models and their inputs behind one small interface, so every model shares one training loop."""
from __future__ import annotations

from launcher.config import Recipe
from launcher.rank.tasks.base import Task


def build_task(recipe: Recipe) -> Task:
    """The task for `model.builder` or `model.name`; imports lazily so only the chosen model's code is
    loaded."""
    if recipe.model.builder is not None:
        from launcher.rank.tasks.builder import BuilderTask
        return BuilderTask(recipe)
    if recipe.model.name == "resnet50":
        from launcher.rank.tasks.resnet50 import ResNet50Task
        return ResNet50Task(recipe)
    if recipe.model.name == "unet3d":
        from launcher.rank.tasks.unet3d import UNet3DTask
        return UNet3DTask(recipe)
    if recipe.model.name == "seq2seq":
        from launcher.rank.tasks.seq2seq import Seq2SeqTask
        return Seq2SeqTask(recipe)
    raise ValueError(f"model.name: no task for {recipe.model.name!r}")  # config validation stops this earlier


__all__ = ["Task", "build_task"]
