"""The training step at a size, built as the worker builds it (launcher.rank.training), reusing what the
size does not change.

- max-batch: the Keras model and its optimizer do not depend on the batch, so they are built once and
  each size only traces a fresh `tf.function` of the same step at its own input specs. A fresh
  function per size keeps no earlier trace alive: ResNet-50's traced graph at a large batch is big,
  and a search makes a dozen.
- max-resolution: the model's layers are built for their input shape, so each size rebuilds the
  model after clearing Keras' session (layer names then restart, and every build names its ops as
  the first one did, which the gating check on the plan's twin relies on).

Everything is built on the host CPU: the step is traced and estimated, not run, in this process.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable

from launcher.bench.floor import Floor, floor_after_rewrites, step_floor, variables_bytes
from launcher.bench.sizes import SizeAxis
from launcher.config import Recipe

BUILD_DEVICE = "CPU:0"


@dataclass
class SizedStep:
    """The step at one size, ready to trace."""

    size: int
    recipe: Recipe  # the recipe at this size
    step: Callable  # a tf.function
    specs: tuple  # (inputs, labels) TensorSpecs
    weights_bytes: int  # the model's variables
    optimizer_bytes: int  # the optimizer's variables


class StepSource:
    """Steps at any size of one recipe along one axis."""

    def __init__(self, axis: SizeAxis, recipe: Recipe):
        self.axis = axis
        self.recipe = recipe
        self._setup = None  # max-batch: the one model and optimizer
        self.builds = 0  # models built so far (the reuse a test can see)
        self._floors: dict[int, tuple[Floor, Floor]] = {}  # size -> both floors: the two floor rows share traces

    def at(self, size: int) -> SizedStep:
        from launcher.rank.training import make_train_step

        sized = self.axis.recipe_at(self.recipe, size)
        if self.axis.kind == "max-batch":
            if self._setup is None:
                self._setup = self._build(sized)
            setup = self._setup
            step = make_train_step(setup.model, setup.optimizer, setup.task, ranks=1)
            specs = (setup.task.input_spec(size), setup.task.label_spec(size))
        else:
            self._setup = None
            gc.collect()  # the previous size's model and traces go before the next is built
            setup = self._build(sized)
            step, specs = setup.step, setup.specs
        return SizedStep(size, sized, step, specs, variables_bytes(setup.model.variables),
                         variables_bytes(setup.optimizer.variables))

    def _build(self, recipe: Recipe):
        import keras

        from launcher.rank.training import build_training

        keras.backend.clear_session()
        self.builds += 1
        return build_training(recipe, ranks=1, device=BUILD_DEVICE)

    def floor_at(self, size: int) -> Floor:
        """The floor of the traced step at `size` (launcher.bench.floor)."""
        return self.floors_at(size)[0]

    def floors_at(self, size: int) -> tuple[Floor, Floor]:
        """(the floor of the traced step, the floor after the floor-lowering rewrites) at `size`, from
        one trace; remembered, so the second floor search traces no size the first one did."""
        if size not in self._floors:
            import lms_core.tf as lms_tf

            sized = self.at(size)
            graph = lms_tf.trace_step(sized.step, *sized.specs).graph
            self._floors[size] = (step_floor(graph, sized.weights_bytes, sized.optimizer_bytes),
                                  floor_after_rewrites(graph, sized.weights_bytes, sized.optimizer_bytes))
        return self._floors[size]

    def describe_at(self, size: int, target=None) -> tuple[Floor, float | None]:
        """(the floor, the simulator's unswapped step time on `target`, or None without one) at
        `size`, from one trace."""
        import lms_core.tf as lms_tf

        sized = self.at(size)
        traced = lms_tf.trace_step(sized.step, *sized.specs)
        floor = step_floor(traced.graph, sized.weights_bytes, sized.optimizer_bytes)
        return floor, None if target is None else unswapped_step_seconds(traced.graph, target)


def unswapped_step_seconds(graph, target) -> float:
    """The simulator's step time of the unswapped step on the target's device and link
    (lms_core.planning's 'unlimited' time: what a plan's overhead is measured against)."""
    from lms_core.plan import Plan
    from lms_core.planning import op_costs
    from lms_core.simulator import simulate

    costs, _ = op_costs(graph, target)
    return simulate(graph, Plan(settings={}), costs, target.link).step_time_s
