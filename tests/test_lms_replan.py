"""Planning again where the two memory models disagree (lms_core.tf.rewrite_within_estimate).

The auto-tuner judges a plan by its simulator against device memory x `lms.memory_ratio`; Grappler's
estimate, which says "fits" in `lms-launch plan`, the bench and a rank's log, counts otherwise: its
copies take no time, and it adds the loop lists a plan keeps at its own peak. On a Seq2Seq step with
a sampled softmax (recipes/seq2seq-cpu.yaml, larger) there is a device memory where the tuner's plan
fits its budget and the estimate puts it over. The expected budget of the second plan is computed
here from the first plan's estimate, not read from the code."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import lms_core.tf as lms_tf
from launcher.recipe import load_recipe
from lms_core.config import LMSConfig
from lms_core.costs import PROFILES
from lms_core.link import link_named
from lms_core.planning import Target
from lms_core.units import format_bytes

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "seq2seq-cpu.yaml"
# 40 tokens each way, 256 units, batch 64, 64 sampled words: Grappler + loop lists put the unswapped
# step at 111.5 MiB; at 78.20 MiB (70.1% of it) the case below holds (found by scanning device memories
# with the gradient loops' zero lists unset and their zeros deferred: the tuner's plan fits its budget
# and not the estimate from 80 to 87 MB, and the re-plan fits both at 81, 81.5 and 82 MB, not at the
# quarter-MB steps between, where no re-plan fits both and the first plan is kept, as docs/lms.md says).
OVERRIDES = ["model.softmax_samples=64", "model.input_shape=[40,40]", "model.units=256", "train.batch_size=64"]
DEVICE_MEMORY = 82_000_000
GPU, HOST = "/device:GPU:0", "/device:CPU:0"  # the estimate's virtual GPU; nothing runs here


@pytest.fixture(scope="module")
def setup():
    from launcher.rank.training import build_training

    return build_training(load_recipe(RECIPE, OVERRIDES), ranks=1, device="CPU:0")


def target() -> Target:
    return Target(link_named("pcie3"), PROFILES["v100"], DEVICE_MEMORY, 16 << 30)


def test_where_the_estimate_refuses_the_tuners_plan_a_plan_for_the_overshoot_less_fits_both(setup):
    config = LMSConfig(enabled=True, mode="auto", min_tensor_bytes=4096)
    budget = int(DEVICE_MEMORY * config.memory_ratio)
    first = lms_tf.rewrite(setup.step, *setup.specs, config=config, compute_device=GPU, host_device=HOST,
                           target=target())
    first_estimate = lms_tf.estimate_rewrite(first, DEVICE_MEMORY)
    # The case: the tuner says its plan fits, the estimate says it does not.
    assert first.planning.simulation.peak_device_bytes <= budget
    assert not first_estimate.lms_fits

    kept, estimate = lms_tf.rewrite_within_estimate(setup.step, *setup.specs, config=config, compute_device=GPU,
                                                    host_device=HOST, target=target())
    assert estimate.lms_fits and kept.planning.simulation.peak_device_bytes <= budget  # both fit
    assert kept.plan.swapped_bytes > first.plan.swapped_bytes  # by swapping more
    lowered = budget - (first_estimate.lms_bytes - DEVICE_MEMORY)  # by hand: the overshoot off the budget
    assert (f"the estimate put the plan at {format_bytes(first_estimate.lms_bytes)}: re-planned for a budget of "
            f"{format_bytes(lowered)}") in kept.report.tuning
    assert kept.report.tuning.endswith("kept that plan")


# At 82.5 MB, swapping alone, the plan for the first lowered budget is no better by the estimate (the
# same figure), and the next budget down, lowered by that overshoot again, fits both. (With recompute
# allowed, the re-plan recomputes and the estimate puts it lower: 64.88 MB against 90.42.)
DEVICE_MEMORY_TWO_REPLANS = 82_500_000


def test_a_replan_whose_estimate_is_no_lower_does_not_end_the_search(setup):
    config = LMSConfig(enabled=True, mode="auto", min_tensor_bytes=4096, actions=["swap"])
    memory = DEVICE_MEMORY_TWO_REPLANS
    at = dataclasses.replace(target(), device_memory_bytes=memory)

    def estimate_at(ratio: float):
        planned = lms_tf.rewrite(setup.step, *setup.specs, config=dataclasses.replace(config, memory_ratio=ratio),
                                 compute_device=GPU, host_device=HOST, target=at)
        return lms_tf.estimate_rewrite(planned, memory).lms_bytes

    # By hand, each budget is the last one less the last estimate's overshoot.
    first = estimate_at(config.memory_ratio)
    second_ratio = config.memory_ratio - (first - memory) / memory
    second = estimate_at(second_ratio)
    assert first > memory and second >= first  # the first re-plan is no better by the estimate
    third_ratio = second_ratio - (second - memory) / memory

    kept, estimate = lms_tf.rewrite_within_estimate(setup.step, *setup.specs, config=config, compute_device=GPU,
                                                    host_device=HOST, target=at)
    assert estimate.lms_fits and kept.planning.simulation.peak_device_bytes <= int(memory * config.memory_ratio)
    assert kept.report.tuning.endswith(
        f"the estimate put the plan at {format_bytes(first)}: re-planned for a budget of "
        f"{format_bytes(int(memory * second_ratio))}; the estimate put the plan at {format_bytes(second)}: "
        f"re-planned for a budget of {format_bytes(int(memory * third_ratio))}; kept that plan")


def test_a_manual_plan_is_not_planned_again(setup):
    """Without tuning there is no budget to lower: the recipe's settings are the plan, over or not."""
    config = LMSConfig(enabled=True, mode="manual", swapout_threshold=8, min_tensor_bytes=4096)
    small = dataclasses.replace(target(), device_memory_bytes=DEVICE_MEMORY // 4)
    kept, estimate = lms_tf.rewrite_within_estimate(setup.step, *setup.specs, config=config, compute_device=GPU,
                                                    host_device=HOST, target=small)
    plain = lms_tf.rewrite(setup.step, *setup.specs, config=config, compute_device=GPU, host_device=HOST, target=small)
    assert not estimate.lms_fits
    assert [s.tensor for s in kept.plan.swaps] == [s.tensor for s in plain.plan.swaps]
    assert estimate.lms_bytes == lms_tf.estimate_rewrite(plain, small.device_memory_bytes).lms_bytes
