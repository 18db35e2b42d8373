"""Proving a plan made for a step too large to run here: on its structural twin.

`lms-launch plan` plans a paper-sized step (ResNet-50 at batch 256, the 3D U-Net at 192^3) for a GPU
that this machine does not have, and cannot run it. Whether the rewrite is gated in what TensorFlow
executes does not depend on tensor sizes, only on the graph: so the same recipe is built again at
its smallest input (`Task.smallest_input_shape`) and batch, which gives the same ops under the same
names; the plan is applied to it unchanged (`rewrite_with_plan` refuses if any op it names is
missing), and that step runs once on split CPU devices for the gating check (lms_core.tf.gating).
"""
from __future__ import annotations

import dataclasses

from launcher.config import Recipe
from launcher.rank.devices import HOST_DEVICE, SPLIT_COMPUTE_CPU
from lms_core.report import Verification

TWIN_BATCH = 2  # batch norm needs more than one value per channel at the 1x1 bottom


def twin_recipe(recipe: Recipe) -> Recipe:
    from launcher.rank.tasks import build_task

    shape = build_task(recipe).smallest_input_shape()
    return dataclasses.replace(
        recipe, model=dataclasses.replace(recipe.model, input_shape=shape),
        train=dataclasses.replace(recipe.train, batch_size=min(recipe.train.batch_size, TWIN_BATCH)))


def verify_on_twin(recipe: Recipe, plan) -> Verification:
    """The gating check of `plan`, made on `recipe`'s step, run on its twin (the verdict says at
    which input and batch). Needs split CPU devices (launcher.rank.devices.split_cpu) before
    TensorFlow started. Raises ValueError when the twin lacks an op the plan names."""
    import keras

    import lms_core.tf as lms_tf
    from launcher.rank.training import build_training
    from lms_core.tf.gating import verify_gating
    from lms_core.tf.op_profile import sample_inputs

    small = twin_recipe(recipe)
    compute = f"/device:{SPLIT_COMPUTE_CPU}"
    keras.backend.clear_session()  # layer names restart, so the twin's ops are named as the original's
    setup = build_training(small, ranks=1, device=SPLIT_COMPUTE_CPU)
    rewritten = lms_tf.rewrite_with_plan(setup.step, *setup.specs, plan=plan, compute_device=compute,
                                         host_device=HOST_DEVICE)
    report = verify_gating(rewritten, *sample_inputs(setup.specs, compute))
    return report.verification(traced_at=(list(small.model.input_shape), small.train.batch_size))
