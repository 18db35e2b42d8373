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
from lms_core.plan import Plan, Recompute
from lms_core.recompute import (Segment, candidate_segments, find_segment, plan_recompute, reason_not_to_recompute,
                                with_recomputes)
from lms_core.simulator import simulate
from tests.fixtures import COMPUTE, HOST, MIB, analyzed, assert_same_training, chain_step, t, unit_costs

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


@pytest.mark.parametrize("mib_per_s, link_share, expected", [(4, 1.0, []), (4, 0.5, ["a:0"]), (1, 1.0, ["a:0"])])
def test_recompute_takes_what_the_link_cannot_carry_off_in_time(mib_per_s, link_share, expected):
    """The chain computes for 10 s and holds 24 MiB at t = 8 (the test above), 20 MiB at t = 7 and 9;
    the budget is 16 MiB. By t = 8 a link of 4 MiB/s each way can have moved 32 MiB out, but only
    8 MiB back in the 2 s left: swaps can have min(32, 8) = 8 MiB off then, the whole excess; at
    t = 9, min(36, 4) = 4 MiB, again the whole excess; at t = 7, 12. Trusting the link for all of it
    leaves recompute nothing. Trusted for half, 4 MiB at t = 8 are left to recompute, and a, the one
    tensor idle then, is freed; the 2 MiB left at t = 9 go to the swaps (nothing is idle then). At
    1 MiB/s the link has 2 MiB off at t = 8: 6 MiB are left, and a is again all recompute can free."""
    from lms_core.link import LinkRates

    g = chain_step()
    rate = mib_per_s * MIB
    link = LinkRates("test", h2d_bytes_per_s=rate, d2h_bytes_per_s=rate, source="test")
    chosen = plan_recompute(g, {}, unit_costs(g), link, 16 * MIB, MIB, link_share=link_share)
    assert [entry.tensor for entry in chosen.recomputes] == expected


def test_freeing_a_tensor_costs_its_own_segment_and_the_ones_it_lengthens():
    """With c freed (made again from b), freeing b too makes c's segment make b first: b's own
    segment (from a) and one op more in c's. Freeing a lengthens nothing: c's segment reads b."""
    from lms_core.recompute import RECOMPUTABLE_TYPES, freeing

    g = chain_step()
    costs = unit_costs(g)
    freed = {"c:0": find_segment(g, "c:0", costs, MIB)}
    with_b = freeing(g, costs, MIB, RECOMPUTABLE_TYPES, freed, "b:0")
    assert {name: segment.ops for name, segment in with_b.items()} == {"b:0": ("b",), "c:0": ("b", "c")}
    assert sum(segment.seconds for segment in with_b.values()) - freed["c:0"].seconds == 2.0
    with_a = freeing(g, costs, MIB, RECOMPUTABLE_TYPES, freed, "a:0")
    assert {name: segment.ops for name, segment in with_a.items()} == {"a:0": ("a",)}


def test_a_segment_reads_the_clone_that_a_segment_triggered_before_it_makes():
    """With a, b and c all freed, c's segment makes a, b and c again (from x) just before grad_c;
    b's makes a and b before grad_b, a's makes a before grad_a: six clones. Sharing, b's and a's
    segments read c's clones instead: three clones, the step three seconds shorter, and a's segment
    needs nothing of its own. Sharing a alone, b's segment still makes b, from c's clone of a."""
    from lms_core.recompute import entries_for

    g = chain_step()
    costs = unit_costs(g)
    freed = {"a:0": find_segment(g, "a:0", costs, MIB)}
    freed["b:0"] = find_segment(g, "b:0", costs, MIB, freed=frozenset({"a:0"}))
    freed["c:0"] = find_segment(g, "c:0", costs, MIB, freed=frozenset({"a:0", "b:0"}))
    assert [freed[t].ops for t in ("a:0", "b:0", "c:0")] == [("a",), ("a", "b"), ("a", "b", "c")]
    apart = entries_for(g, costs, freed)
    shared = entries_for(g, costs, freed, frozenset({("a:0", "a"), ("b:0", "a"), ("b:0", "b")}))
    by_tensor = {entry.tensor: entry for entry in shared}
    assert by_tensor["b:0"].ops == ["b"] and by_tensor["b:0"].clones == ["lms/recompute_c_0/b"]
    assert by_tensor["b:0"].made() == [] and by_tensor["b:0"].seconds == 0.0
    assert by_tensor["a:0"].clones == ["lms/recompute_c_0/a"] and by_tensor["a:0"].made() == []
    rewritten = with_recomputes(g, shared)
    assert len(rewritten) == len(g) + 3
    assert rewritten["gradient_tape/grad_b"].inputs == ["gradient_tape/grad_c:0", "lms/recompute_c_0/b:0"]
    assert rewritten["gradient_tape/grad_a"].inputs == ["gradient_tape/grad_b:0", "lms/recompute_c_0/a:0"]
    steps = [simulate(with_recomputes(g, entries), Plan(settings={}), unit_costs(with_recomputes(g, entries)), LINK)
             for entries in (apart, shared)]
    assert steps[0].step_time_s - steps[1].step_time_s == 3.0
    only_a = {entry.tensor: entry for entry in entries_for(g, costs, freed, frozenset({("b:0", "a")}))}
    assert only_a["b:0"].made() == [("b", "lms/recompute_b_0/b")] and only_a["b:0"].shared == ["lms/recompute_c_0/a"]
    assert with_recomputes(g, list(only_a.values()))["lms/recompute_b_0/b"].inputs == ["lms/recompute_c_0/a:0"]


@pytest.mark.parametrize("budget_mib, expected", [(28, {("b:0", "b")}), (27, set())])
def test_a_clone_is_shared_only_where_the_step_has_room_to_hold_it_longer(budget_mib, expected):
    """x -> a -> b -> c -> d: b freed, and d made again from a (its segment clones b, c and d just
    before grad_d; c itself is kept for grad_c). b's own segment clones b just before grad_b, after
    grad_c. Shared, d's clone of b is held on from the end of its last reader (d's clone of c, at
    t = 10) to where b's own clone would start (t = 13): at t = 11 and 12, as grad_d and grad_c
    start, the step holds 24 MiB (a, c, the seed's output, d's clone, and two gradients), 28 with
    it. Room in a budget of 28 MiB, none in 27."""
    from lms_core.access_order import Schedule
    from lms_core.recompute import entries_for, room_to_share

    g = chain_step("abcd")
    costs = unit_costs(g)
    freed = {"b:0": find_segment(g, "b:0", costs, MIB),
             "d:0": find_segment(g, "d:0", costs, MIB, freed=frozenset({"b:0", "c:0"}))}
    assert freed["d:0"].ops == ("b", "c", "d") and freed["b:0"].ops == ("b",)
    step = with_recomputes(g, entries_for(g, costs, freed))
    schedule = Schedule(step, simulate(step, Plan(settings={}), unit_costs(step), LINK, keep_events=True))
    assert (schedule.end["lms/recompute_d_0/c"], schedule.start["lms/recompute_b_0/b"]) == (10.0, 13.0)
    assert [usage // MIB for time, usage in zip(schedule.times, schedule.usage) if 10 < time < 13] == [24, 24]
    wanted = [usage - budget_mib * MIB for usage in schedule.usage]
    assert room_to_share(g, costs, freed, schedule, wanted) == expected
    shared = with_recomputes(g, entries_for(g, costs, freed, frozenset({("b:0", "b")})))
    assert simulate(shared, Plan(settings={}), unit_costs(shared), LINK).peak_device_bytes == 28 * MIB


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


def test_no_recompute_base_is_planned_where_the_floor_is_over_the_device():
    """The chain's floor is 20 MiB, at t = 8: b and c still read, the seed, grad_c and grad_b's
    output, none of which a swap moves or recompute frees. On a 19 MiB device no plan in the step's
    order runs, recomputing a included (20 MiB and 16 bytes, the test above), so no recompute base is
    planned: the plan swaps alone (the tuned distance plan, whose ops wait for copies)."""
    from lms_core.costs import PROFILES
    from lms_core.planning import Target, plan_graph, swap_floor

    g = chain_step()
    config = LMSConfig(enabled=True, mode="auto", min_tensor_bytes=MIB, memory_ratio=1.0)
    slow = link_named(1.0e-3)
    unswapped = simulate(g, Plan(settings=config.settings()), unit_costs(g), slow, keep_events=True)
    assert swap_floor(g, unswapped, config, slow, "", frozenset())[0] == 20 * MIB
    target = Target(slow, PROFILES["v100"], device_memory_bytes=19 * MIB, host_memory_bytes=1 << 30,
                    measured_op_seconds=unit_costs(g))
    planned = plan_graph(g, config, target=target)
    assert not planned.plan.recomputes and "recompute" not in planned.report.tuning


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
    # At 6 MiB the faster plan has segments reading clones a segment triggered earlier made (shared):
    # each clone is counted once, with the segment that makes it and its trigger.
    assert any(entry.shared for entry in plan.recomputes)
    clones = len({clone for entry in plan.recomputes for clone in entry.clones})  # each once, however many read it
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


def test_what_holds_memory_at_the_floor_is_the_clones_result_else_an_anchor():
    """Two recomputes: b made again from a, d from c. At the floor's moment b's clone holds its
    result: only b is to blame, though d's anchor c is resident too (some op may read c then anyway).
    Without a clone's result there, the recomputes whose anchors are resident are."""
    from lms_core.plan import Recompute
    from lms_core.recompute import held_by

    def entry(tensor: str, anchor: str) -> Recompute:
        op = tensor.split(":")[0]
        return Recompute(tensor=tensor, nbytes=4 * MIB, ops=[op], clones=[f"lms/recompute_{op}_0/{op}"],
                         anchors=[anchor], consumers=[f"gradient_tape/grad_{op}"], trigger="t", seconds=1.0)

    entries = [entry("b:0", "a:0"), entry("d:0", "c:0")]
    assert held_by(entries, frozenset({"lms/recompute_b_0/b:0", "c:0"})) == {"b:0"}
    assert held_by(entries, frozenset({"a:0", "c:0"})) == {"b:0", "d:0"}
    assert held_by(entries, frozenset({"x:0"})) == set()


def test_recompute_never_raises_the_floor_the_swaps_must_get_under():
    """ResNet-50 at batch 1024 for a 16 GiB H100 on PCIe gen5, the issue's first row. The swaps' floor
    (the most the unswapped order holds with every swappable tensor off whenever it could be) of the
    step as traced is over the 14.40 GiB budget already: no plan can fit it, and recompute must not
    make it worse. Chosen at the unswapped peak alone, the recomputes do: a ReLU made again beside its
    anchor, the previous block's output, holds two block outputs more where the backward pass is at
    its tightest. Kept within the floor, most of them stay and the floor is the traced one."""
    from benchmarks.architectures import resnet50_imagenet, training_step
    import lms_core.tf as lms_tf
    from lms_core.costs import PROFILES
    from lms_core.driver import PEAK_TIE
    from lms_core.planning import Target, op_costs, swap_floor
    from lms_core.recompute import FloorCheck
    from lms_core.serialize import order_edges, with_control_edges

    _, _, step, specs, _ = training_step(resnet50_imagenet(1024))
    traced = lms_tf.trace_step(step, *specs)
    graph = with_control_edges(traced.graph, order_edges(traced.graph, MIB))
    config = LMSConfig(enabled=True, mode="auto")
    link, gib = link_named("pcie5"), 1 << 30
    costs, _ = op_costs(graph, Target(link, PROFILES["h100"], 16 * gib, 512 * gib))
    budget = int(16 * gib * config.memory_ratio)

    def floor_of(g: Graph, unswapped) -> tuple[int, frozenset[str]]:
        return swap_floor(g, unswapped, config, link, "/device:GPU:0", traced.data_inputs)

    def floor_after(check: FloorCheck | None) -> tuple[int, int]:
        chosen = plan_recompute(graph, config.settings(), costs, link, budget, config.min_tensor_bytes,
                                floor_check=check)
        unswapped = simulate(chosen.graph, Plan(settings=config.settings()), chosen.costs, link, keep_events=True)
        return floor_of(chosen.graph, unswapped)[0], len(chosen.recomputes)

    traced_floor = floor_of(graph, simulate(graph, Plan(settings=config.settings()), costs, link, keep_events=True))[0]
    assert traced_floor > budget
    unchecked, unchecked_count = floor_after(None)
    assert unchecked > traced_floor * (1 + PEAK_TIE)
    checked, checked_count = floor_after(FloorCheck(floor_of, traced_floor))
    assert checked <= traced_floor * (1 + PEAK_TIE)
    assert unchecked_count > checked_count > unchecked_count // 2


def keras_resnet50():
    """keras.applications.ResNet50 itself (53 convolutions, Keras 3's batch norms) at 96x96, batch 16,
    10 classes: the test architectures' "resnet50" is a toy whose peak is its weights and their state,
    which nothing recomputed lowers."""
    import keras

    model = keras.applications.ResNet50(weights=None, input_shape=(96, 96, 3), classes=10, classifier_activation=None)
    return model, ((16, 96, 96, 3), (16,))


@pytest.mark.parametrize("name", ["densenet_block", "lstm", "mobilenet_v2", "keras_resnet50", "transformer_block",
                                  "unet3d"])
def test_each_test_architecture_recomputed_is_gated_and_trains_bit_for_bit(name):
    """The test architectures (benchmarks/architectures.py; ResNet-50 as Keras ships it), each planned
    with recompute alone for a device of 80% of its unswapped peak, rewritten for the split CPU
    devices: every clone ran after its trigger on the partitions TensorFlow executed, and three steps
    give the losses and weights of the step as traced, bit for bit (the clones run the same kernels on
    the same inputs).

    Except ResNet-50, within 1e-6 after one step: Grappler optimizes the forward ops and not their
    clones alike. It sums a batch norm's output and the shortcut as one rewritten add
    (AddOpsRewrite) and fuses a convolution with its bias add, where a clone waiting for its trigger
    is left as it was, so a block output made again differs from the original by rounding (1e-7 of
    a kernel's gradient). Over more steps this model's training at batch 16 magnifies any rounding
    difference (one of 1e-7 in a single gradient moved the third loss by 1e-3)."""
    import tensorflow as tf

    import lms_core.tf as lms_tf
    from benchmarks.architectures import ARCHITECTURES, training_step
    from lms_core.costs import PROFILES
    from lms_core.planning import Target, op_costs
    from lms_core.tf.gating import verify_gating

    build = keras_resnet50 if name == "keras_resnet50" else ARCHITECTURES[name]
    config = LMSConfig(enabled=True, mode="auto", actions=["recompute"], min_tensor_bytes=0, memory_ratio=1.0)
    model_a, _, step_a, specs, batch = training_step(build, device=COMPUTE)
    traced = lms_tf.trace_step(step_a, *specs)
    unlimited = Target(LINK, PROFILES["v100"], 1 << 40, 1 << 40)
    peak = simulate(traced.graph, Plan(settings={}), op_costs(traced.graph, unlimited)[0], LINK).peak_device_bytes
    steps = 1 if name == "keras_resnet50" else 3
    with tf.device(COMPUTE):
        expected = [float(step_a(*batch)) for _ in range(steps)]
    model_b, _, step_b, _, _ = training_step(build, device=COMPUTE)
    target = Target(LINK, PROFILES["v100"], int(0.8 * peak), 1 << 40)
    rewritten = lms_tf.rewrite(step_b, *specs, config=config, compute_device=COMPUTE, host_device=HOST, target=target)
    plan = rewritten.plan
    assert plan.recomputes and not plan.swaps
    clones = len({clone for entry in plan.recomputes for clone in entry.clones})  # each once, however many read it
    report = verify_gating(rewritten, *batch)
    assert (report.clones_gated, report.clones, report.clones_early) == (clones, clones, []), \
        report.verification().first_failure()
    losses = [float(rewritten(*batch)) for _ in range(steps)]
    if name == "keras_resnet50":
        assert_same_training(losses, expected, model_b.variables, model_a.variables, rtol=1e-6)
        return
    assert losses == expected
    for mine, theirs in zip(model_b.variables, model_a.variables):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy(), err_msg=theirs.path)


def test_a_clone_reading_a_swapped_anchor_reads_its_swap_in():
    """b = Relu(a) is recomputed from a, and a is swapped, its copy back read by b's clone and by
    a's own gradient. Applied to the GraphDef, the clone must read the swap-in, not the original: the
    original would stay on the device until the clone runs, all through the backward pass, and the
    swap would free nothing (the 3D U-Net at 368^3: Grappler saw 25.72 GiB where the plan was made
    for 15.71, until the swaps edited the clones the GraphDef holds rather than copies of them)."""
    from tensorflow.core.framework import graph_pb2

    from lms_core.plan import Swap, SwapIn
    from lms_core.tf.apply import apply_plan

    graph_def = graph_pb2.GraphDef()
    for name, op, inputs in [("x", "Placeholder", []), ("a", "Relu", ["x"]), ("b", "Relu", ["a"]),
                             ("seed", "Relu", ["b"]), ("grad_b", "ReluGrad", ["seed", "b"]),
                             ("grad_a", "ReluGrad", ["grad_b", "a"])]:
        node = graph_def.node.add(name=name, op=op, device=COMPUTE)
        node.input.extend(inputs)
        node.attr["T"].type = 1  # DT_FLOAT
    recompute = Recompute(tensor="b:0", nbytes=4 * MIB, ops=["b"], clones=["lms/recompute_b_0/b"], anchors=["a:0"],
                          consumers=["grad_b"], trigger="seed", seconds=1.0)
    swap_in = SwapIn(name="lms/swapin_a_0", trigger="seed", trigger_level=3,
                     consumers=["lms/recompute_b_0/b", "grad_a"], consumer_levels=[4, 5])
    swap = Swap(tensor="a:0", producer_type="Relu", shape=[4], dtype="float32", nbytes=4 * MIB, producer_level=1,
                swap_out="lms/swapout_a_0", swap_ins=[swap_in])
    plan = Plan(settings={}, swaps=[swap], recomputes=[recompute])
    applied = {node.name: node for node in apply_plan(graph_def, plan, COMPUTE, HOST).node}
    assert list(applied["lms/recompute_b_0/b"].input) == ["lms/swapin_a_0", "^seed"]
    assert list(applied["grad_a"].input) == ["grad_b", "lms/swapin_a_0"]
    assert list(applied["grad_b"].input) == ["seed", "lms/recompute_b_0/b"]
    assert list(applied["b"].input) == ["a"]  # the forward pass reads the original
