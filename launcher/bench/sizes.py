"""What a size is for each `lms-launch bench` command, and which sizes a model accepts.

- `max-batch`: the per-rank batch, any positive integer (`--step` coarsens the grid).
- `max-resolution`: the side of a square (ResNet-50) or cubic (3D U-Net) input, channels and batch as
  in the recipe; for a `model.builder`, every side of its input but the last (channels), on a grid
  of 1 unless `--step` gives the model's own. The U-Net's sides must be multiples of 2^(levels-1) (16 for the paper's 5 levels),
  or its stride-2 levels cannot halve them exactly and the decoder cannot meet the encoder's skips
  (launcher/config.py checks the same): that is its step, and its smallest side (one voxel at the
  bottom level). ResNet-50 halves its input five times: multiples of 32 keep every stage
  whole (224 = 7 x 32), and 32 is the smallest input Keras builds it for.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from launcher.config import Recipe

KINDS = ("max-batch", "max-resolution")
RESNET_STRIDE = 32  # five stride-2 stages


@dataclass(frozen=True)
class SizeAxis:
    """One command's notion of size for one recipe."""

    kind: str  # "max-batch" or "max-resolution"
    model: str  # recipe model.name
    step: int  # the grid step a model accepts (1 for batches)
    smallest: int  # the smallest size the model accepts
    start: int  # the recipe's own size: where the search starts by default
    dims: int  # how many dimensions scale with the size: 1 for a batch, 2 or 3 for a side
    unit: str  # "batch", "side"

    def recipe_at(self, recipe: Recipe, size: int) -> Recipe:
        """`recipe` with this size: the batch, or every spatial side."""
        if self.kind == "max-batch":
            return dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, batch_size=size))
        channels = recipe.model.input_shape[-1]
        shape = [size] * (len(recipe.model.input_shape) - 1) + [channels]
        return dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, input_shape=shape))

    def overrides(self, recipe: Recipe, size: int) -> list[str]:
        """The same as `recipe_at`, as `--set` entries for a worker process."""
        if self.kind == "max-batch":
            return [f"train.batch_size={size}"]
        shape = self.recipe_at(recipe, size).model.input_shape
        return [f"model.input_shape=[{','.join(str(d) for d in shape)}]"]

    def label(self, size: int | None) -> str:
        """How tables and logs write a size: `batch 512`, `240^3`, `224^2`."""
        if size is None:
            return "none fits"
        return f"batch {size}" if self.kind == "max-batch" else f"{size}^{self.dims}"

    def ratio(self, size: int | None, reference: int | None) -> float | None:
        """How much larger than `reference`: batches, or pixels or voxels (the side's power)."""
        if not size or not reference:
            return None
        return (size / reference) ** self.dims

    def describe(self) -> str:
        if self.kind == "max-batch":
            return "the per-rank batch"
        if self.step == 1:
            return "the side of the input, any size (a model that needs multiples of N: --step N)"
        why = "2^(levels-1): one voxel at the bottom level" if self.model == "unet3d" else "the network stride"
        return f"the side of a {'cubic' if self.dims == 3 else 'square'} input, in steps of {self.step} ({why})"


def size_axis(kind: str, recipe: Recipe) -> SizeAxis:
    if kind not in KINDS:
        raise ValueError(f"unknown benchmark {kind!r}; choose {' or '.join(KINDS)}")
    if kind == "max-batch":
        return SizeAxis(kind, recipe.model.name, 1, 1, recipe.train.batch_size, 1, "batch")
    spatial = recipe.model.input_shape[:-1]
    if recipe.model.builder is not None:  # your model's own grid is yours to give: --step (and --min)
        step = smallest = 1
    elif recipe.model.name == "unet3d":
        step = 2 ** (recipe.model.levels - 1)
        smallest = step
    else:
        step = smallest = RESNET_STRIDE
    start = max(smallest, min(spatial) - min(spatial) % step)
    return SizeAxis(kind, recipe.model.name, step, smallest, start, len(spatial), "side")
