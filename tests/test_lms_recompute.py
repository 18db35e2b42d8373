"""Recompute (lms_core.recompute, lms_core.tf.recompute): a tensor freed after its forward readers and
made again just before its first backward reader, from tensors live then.

The hand-built chain (tests.fixtures.chain_step: x -> a -> b -> c -> loss, each activation 4 MiB,
one second per op, the backward chain reading c, b, a in turn) is followed by hand; a real Keras
step is rewritten, run on the split CPU devices, and checked on what TensorFlow executed.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lms_core.config import LMSConfig, SettingError
from lms_core.graph import BACKWARD, Graph, Op
from lms_core.link import link_named
from lms_core.plan import Plan
from lms_core.recompute import (Segment, candidate_segments, find_segment, plan_recompute, reason_not_to_recompute,
                                with_recomputes)
from lms_core.simulator import simulate
from tests.fixtures import COMPUTE, HOST, MIB, analyzed, chain_step, t, unit_costs

LINK = link_named("pcie3")


def test_each_activation_of_the_chain_is_made_again_from_the_one_before_it():
    """a = Relu(x), b = Relu(a), c = Relu(b). Each is read by one backward op (grad_a, grad_b,
    grad_c, in that order from the end), and the tensor before it is live then anyway (x is the
    step's input; a is read later, by grad_a; b by grad_b): one op to clone each, triggered by the
    backward op just before its reader."""
    g = chain_step()
    segments = {s.tensor: s for s in candidate_segments(g, unit_costs(g), MIB)}
    assert segments["a:0"] == Segment("a:0", 4 * MIB, ("a",), ("x:0",), ("gradient_tape/grad_a",),
                                      "gradient_tape/grad_b", 1.0)
    assert segments["b:0"].anchors == ("a:0",) and segments["b:0"].trigger == "gradient_tape/grad_c"
    assert segments["c:0"].anchors == ("b:0",) and segments["c:0"].trigger == "gradient_tape/seed"
    # With b freed too, a clone of c can no longer read it: c's segment makes b again first.
    both = find_segment(g, "c:0", unit_costs(g), MIB, freed=frozenset({"b:0"}))
    assert both.ops == ("b", "c") and both.anchors == ("a:0",) and both.seconds == 2.0


def test_only_deterministic_stateless_ops_are_cloned():
    g = chain_step()
    assert reason_not_to_recompute(g["a"]) is None
    stateful = analyzed(Graph([*[op for op in chain_step().ops.values() if op.name != "a"],
                               Op("a", "RandomUniform", inputs=["x:0"], outputs=[t(4, shape=(4, 256, 256, 4))])],
                              ["loss:0"]))
    assert reason_not_to_recompute(stateful["a"]) == \
        "RandomUniform is not on the list of deterministic, stateless ops"
    assert find_segment(stateful, "b:0", unit_costs(stateful), MIB, freed=frozenset({"a:0"})) == \
        "a: RandomUniform is not on the list of deterministic, stateless ops"
    assert reason_not_to_recompute(g["gradient_tape/grad_a"]).startswith("ReluGrad is not")
    looped = dataclasses.replace(g["b"], region="while/Merge")
    assert reason_not_to_recompute(looped) == "inside v1 control flow (while/Merge)"
    for op in ("x", "loss"):  # the step's input and the loss are not recomputable ops either
        assert reason_not_to_recompute(g[op]) is not None


def test_the_rewritten_chain_clones_waits_for_its_trigger_and_reroutes_the_backward_reader():
    g = chain_step()
    (segment,) = [s for s in candidate_segments(g, unit_costs(g), MIB) if s.tensor == "b:0"]
    rewritten = with_recomputes(g, [segment.entry()])
    clone = rewritten["lms/recompute_b_0/b"]
    assert (clone.type, clone.inputs, clone.control_inputs) == ("Relu", ["a:0"], ["gradient_tape/grad_c"])
    assert clone.category == BACKWARD  # it feeds the backward pass only
    assert rewritten["gradient_tape/grad_b"].inputs == ["gradient_tape/grad_c:0", "lms/recompute_b_0/b:0"]
    assert rewritten["c"].inputs == ["b:0"]  # the forward reader keeps the original
    assert len(rewritten) == len(g) + 1


def test_recompute_takes_the_tensors_idle_at_the_peak_and_stops_where_none_is():
    """Unswapped, the chain peaks at 24 MiB at t = 8, as grad_b starts (a, b, c, the seed, grad_c
    and grad_b's output; the simulator allocates before it frees at one instant). Of a, b and c
    only a is idle then (its forward reader b ended at 4, its backward reader starts at 9): freed,
    and made again at 9 from x, it takes 4 MiB off and a second on, and holds x (16 bytes) until its
    clone reads it. At the new peak, at t = 8, b and c are being read: nothing more to recompute,
    though the budget asked for 16 MiB."""
    g = chain_step()
    costs = unit_costs(g)
    before = simulate(g, Plan(settings={}), costs, LINK)
    assert before.peak_device_bytes == 24 * MIB and before.step_time_s == 10.0
    chosen = plan_recompute(g, {}, costs, LINK, 16 * MIB, MIB)
    assert [entry.tensor for entry in chosen.recomputes] == ["a:0"]
    after = simulate(chosen.graph, Plan(settings={}), chosen.costs, LINK)
    assert after.peak_device_bytes == 20 * MIB + 16 and after.step_time_s == 11.0
    assert chosen.costs["lms/recompute_a_0/a"] == costs["a"]


def test_the_planner_keeps_recompute_where_it_beats_the_link_and_not_where_it_is_not_allowed():
    """A link of 1 MB/s: a 4 MiB copy takes seconds each way; a ReLU made again takes one. Planned
    for 21 MiB, recomputing a (the test above) fits in 20 MiB and 16 bytes, at 11 s."""
    from lms_core.costs import PROFILES
    from lms_core.planning import Target, plan_graph

    g = chain_step()
    slow = link_named(1.0e-3)
    target = Target(slow, PROFILES["v100"], device_memory_bytes=21 * MIB, host_memory_bytes=1 << 30,
                    measured_op_seconds=unit_costs(g))
    config = LMSConfig(enabled=True, mode="auto", min_tensor_bytes=MIB, memory_ratio=1.0)
    both = plan_graph(g, config, target=target)
    assert [r.tensor for r in both.plan.recomputes] == ["a:0"] and not both.plan.swaps
    assert both.simulation.step_time_s == 11.0 and "recompute: 1 tensor(s) of 4.00 MiB" in both.report.tuning
    swaps = plan_graph(g, dataclasses.replace(config, actions=["swap"]), target=target)
    assert not swaps.plan.recomputes and swaps.simulation.step_time_s > 11.0


def test_actions_are_checked():
    with pytest.raises(SettingError, match=r"actions: must list one or both of swap, recompute; got \['keep'\]"):
        LMSConfig(actions=["keep"])
    with pytest.raises(SettingError, match="actions: must list one or both"):
        LMSConfig(actions=[])


# --- a real step -----------------------------------------------------------------------------------

def recomputed_unet(device_mib: float = 40):
    """The CPU recipe's U-Net, planned with recompute alone for a device of `device_mib`, rewritten for
    the split CPU devices; and the same step, not rewritten, with the same weights."""
    from launcher.rank.training import build_training
    from launcher.recipe import load_recipe
    from lms_core.costs import PROFILES
    from lms_core.planning import Target
    from tests.fixtures import RECIPES
    import lms_core.tf as lms_tf

    recipe = load_recipe(RECIPES / "unet3d-cpu.yaml", ["lms.actions=[recompute]", "model.input_shape=[16,16,16,4]",
                                                        "model.levels=3", "model.base_filters=8"])
    setup = build_training(recipe, ranks=1, device="CPU:1")
    plain = build_training(recipe, ranks=1, device="CPU:1")
    for mine, theirs in zip(plain.model.variables, setup.model.variables):
        mine.assign(theirs)
    target = Target(LINK, PROFILES["v100"], int(device_mib * MIB), 1 << 30)
    rewritten = lms_tf.rewrite(setup.step, *setup.specs, config=recipe.lms, compute_device=COMPUTE,
                               host_device=HOST, target=target)
    return rewritten, setup, plain


def test_a_recomputed_keras_step_runs_every_clone_after_its_trigger_and_trains_the_same():
    import tensorflow as tf

    from lms_core.tf.gating import verify_gating
    from lms_core.tf.op_profile import sample_inputs

    rewritten, setup, plain = recomputed_unet(device_mib=6)
    plan = rewritten.plan
    assert plan.recomputes and not plan.swaps
    clones = sum(len(entry.clones) for entry in plan.recomputes)
    batch = sample_inputs(setup.specs, COMPUTE)
    report = verify_gating(rewritten, *batch)
    assert (report.clones_gated, report.clones, report.clones_early) == (clones, clones, [])
    assert f"recomputed ops after their trigger: {clones}/{clones}" in report.verification().describe()
    with tf.device(COMPUTE):
        losses = [float(rewritten(*batch)) for _ in range(3)]
        expected = [float(plain.step(*batch)) for _ in range(3)]
    assert losses == expected  # the same kernels on the same inputs: bit for bit
    for mine, theirs in zip(setup.model.trainable_variables, plain.model.trainable_variables):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


def test_grappler_sees_the_recomputed_step_lower_and_a_clone_without_its_trigger_fails_the_check():
    """The negative control: the same rewrite with the clones' control inputs taken out. TensorFlow
    then runs them as soon as their anchors exist, in the forward pass, and the check says so."""
    import lms_core.tf as lms_tf
    from lms_core.tf.gating import verify_gating
    from lms_core.tf.op_profile import sample_inputs
    from lms_core.tf.reimport import RewrittenStep

    rewritten, setup, _ = recomputed_unet(device_mib=6)
    estimate = lms_tf.estimate_rewrite(rewritten, 6 * MIB)
    assert estimate.lms_bytes < estimate.baseline_bytes
    ungated = type(rewritten.graph_def)()
    ungated.CopyFrom(rewritten.graph_def)
    clones = {clone for entry in rewritten.plan.recomputes for clone in entry.clones}
    for node in ungated.node:
        if node.name in clones:
            kept = [name for name in node.input if not name.startswith("^")]
            del node.input[:]
            node.input.extend(kept)
    broken = RewrittenStep(rewritten.concrete, ungated, rewritten.planning, compute_device=COMPUTE, host_device=HOST,
                           host_ops=rewritten.host_ops)
    report = verify_gating(broken, *sample_inputs(setup.specs, COMPUTE))
    assert report.clones_gated < report.clones and not report.all_gated
    assert any("does not wait for" in reason for reason in report.clones_early)
