"""Serializing the backward branches (lms_core.serialize), on a hand-built step and on real steps.

The hand-built step forks like a ResNet block: `a` feeds a main path (conv -> relu) and a shortcut
(relu), summed into `s`. Its backward pass splits the gradient of `s` into the two branches and sums
them again into the gradient of `a`:

    seed ─┬─ g_c1 (ReluGrad) ─ g_b1 (Mul) ──┐
          └─ g_b2 (ReluGrad) ───────────────┴─ g_a (AddN) ─ g_x

The main branch's own work is g_c1 and g_b1 (8 MiB of outputs), the shortcut's is g_b2 (4 MiB): the
main branch runs first, and the shortcut may start only once g_b1 is done.
"""
from __future__ import annotations

import tensorflow as tf

import lms_core.tf as lms_tf
from lms_core.config import LMSConfig
from lms_core.graph import Graph, Op
from lms_core.passes.pipeline import analyze
from lms_core.plan import ControlEdge
from lms_core.serialize import backward_region, branch_edges, with_control_edges
from lms_core.tf.estimate import estimate_peak
from lms_core.tf.gating import verify_gating
from tests.fixtures import COMPUTE, HOST
from benchmarks.architectures import ARCHITECTURES, resnet50_imagenet, training_step
from tests.fixtures import t

GIB = 1 << 30


def forked_step() -> Graph:
    g = "gradient_tape/"
    ops = [
        Op("x", "Placeholder", outputs=[t(1)]),
        Op("w_handle", "Placeholder", outputs=[t(None, shape=(), dtype="resource")]),
        Op("w", "ReadVariableOp", inputs=["w_handle:0"], outputs=[t(0.01)]),
        Op("a", "Relu", inputs=["x:0"], outputs=[t(4)]),
        Op("b1", "Conv2D", inputs=["a:0", "w:0"], outputs=[t(4)]),
        Op("c1", "Relu", inputs=["b1:0"], outputs=[t(4)]),
        Op("b2", "Relu", inputs=["a:0"], outputs=[t(4)]),
        Op("s", "AddV2", inputs=["c1:0", "b2:0"], outputs=[t(4)]),
        Op("loss", "Mean", inputs=["s:0"], outputs=[t(0)]),
        Op("ones", "Const", outputs=[t(0)]),
        Op(g + "seed", "Mul", inputs=["ones:0", "loss:0"], outputs=[t(4)]),
        Op(g + "g_c1", "ReluGrad", inputs=[g + "seed:0", "c1:0"], outputs=[t(4)]),
        Op(g + "g_b1", "Mul", inputs=[g + "g_c1:0", "b1:0"], outputs=[t(4)]),
        Op(g + "g_w", "Conv2DBackpropFilter", inputs=["a:0", g + "g_c1:0"], outputs=[t(0.01)]),
        Op(g + "g_b2", "ReluGrad", inputs=[g + "seed:0", "b2:0"], outputs=[t(4)]),
        Op(g + "g_a", "AddN", inputs=[g + "g_b1:0", g + "g_b2:0"], outputs=[t(4)]),
        Op(g + "g_x", "ReluGrad", inputs=[g + "g_a:0", "a:0"], outputs=[t(1)]),
        Op("sgd/assign", "AssignSubVariableOp", inputs=["w_handle:0", g + "g_w:0"]),
    ]
    return analyze(Graph(ops, outputs=["loss:0"]))


def test_the_heavier_branch_runs_first_and_the_other_waits_for_it():
    g = forked_step()
    assert backward_region(g) == {f"gradient_tape/{n}" for n in ("seed", "g_c1", "g_b1", "g_w", "g_b2", "g_a", "g_x")}
    edges = branch_edges(g)
    assert edges == [ControlEdge(before="gradient_tape/g_b1", after="gradient_tape/g_b2")]
    ordered = with_control_edges(g, edges)
    assert ordered["gradient_tape/g_b2"].control_inputs == ["gradient_tape/g_b1"]
    assert ordered["gradient_tape/g_b2"].level > ordered["gradient_tape/g_b1"].level
    assert g["gradient_tape/g_b2"].level < g["gradient_tape/g_b1"].level  # before: the shortcut ran early
    assert ordered["gradient_tape/g_b2"].category == g["gradient_tape/g_b2"].category == "backward"


def test_gradients_kept_across_the_other_branch_are_swapped_with_swap_backward():
    """Ordered, two backward tensors wait while the other branch runs: the seed gradient (the
    shortcut's input, kept while the main branch runs) and the main branch's result g_b1 (kept
    while the shortcut runs, until the join g_a). Both are swapped with lms.swap_backward, and
    brought back when the other branch is done; neither without it."""
    from lms_core.planner import plan_swaps

    g = with_control_edges(forked_step(), branch_edges(forked_step()))
    assert g["gradient_tape/g_a"].level - g["gradient_tape/g_b1"].level == 2
    config = dict(enabled=True, swapout_threshold=2, swapin_ahead=1, min_tensor_bytes=0, include_scopes=["gradient_tape/"])
    swaps = plan_swaps(g, LMSConfig(**config)).swaps
    assert [(s.tensor, [(i.trigger, i.consumers) for i in s.swap_ins]) for s in swaps] == [
        ("gradient_tape/seed:0", [("gradient_tape/g_b1", ["gradient_tape/g_b2"])]),
        ("gradient_tape/g_b1:0", [("gradient_tape/g_b2", ["gradient_tape/g_a"])])]
    assert plan_swaps(g, LMSConfig(**config, swap_backward=False)).swaps == []


def test_a_swap_whose_copy_would_come_back_beside_the_original_is_not_made():
    """Ordered, the seed gradient is read at once by g_c1 (near) and later by g_b2. With swapin_ahead 2
    the swap-in's trigger would be g_c1 itself: the copy would arrive while the original is still on
    the device for g_c1, two copies at once. That swap is skipped, with the reason; one level ahead
    (trigger g_b1, after g_c1's read) it is made."""
    from lms_core.planner import plan_swaps

    g = with_control_edges(forked_step(), branch_edges(forked_step()))
    config = dict(enabled=True, swapout_threshold=2, min_tensor_bytes=0, include_scopes=["gradient_tape/seed"])
    early = plan_swaps(g, LMSConfig(**config, swapin_ahead=2))
    assert early.swaps == []
    (skip,) = [s for s in early.skipped if s.tensor == "gradient_tape/seed:0"]
    level = g["gradient_tape/g_c1"].level
    assert skip.reason == (f"its swap-in would start at level {level}, while the original is still read at level "
                           f"{level}: both copies would be on the device at once (a smaller lms.swapin_ahead brings it "
                           f"back later)")
    assert [s.tensor for s in plan_swaps(g, LMSConfig(**config, swapin_ahead=1)).swaps] == ["gradient_tape/seed:0"]


def test_no_setting_makes_grapplers_peak_worse_on_a_vgg_style_net():
    """Issue 10's case: aggressive settings on a small VGG-style net raised Grappler's peak by 8%.
    Whatever the settings, a plan must not raise it."""
    from benchmarks.architectures import conv_relu_step

    step, specs = conv_relu_step((64, 64, 3), batch=32, blocks=4, filters=32, classes=10)
    for threshold in (1, 2):
        for ahead in (1, 2):
            for sync in (0, 3):
                config = LMSConfig(enabled=True, mode="manual", swapout_threshold=threshold, swapin_ahead=ahead,
                                   sync_mode=sync, min_tensor_bytes=0)
                rewritten = lms_tf.rewrite(step, *specs, config=config)
                estimate = lms_tf.estimate_rewrite(rewritten, 1 << 40)
                assert rewritten.plan.swaps and estimate.lms_bytes <= estimate.baseline_bytes, (threshold, ahead, sync)


def test_a_convolutions_filter_gradient_runs_before_its_input_gradient():
    """Both read relu_grad; the filter gradient also reads the batch x (swapped back for it): it runs
    first, so x can go before the input gradient allocates a tensor of x's size."""
    from lms_core.serialize import order_edges
    from tests.fixtures import tiny_step

    g = analyze(tiny_step())
    assert order_edges(g) == [ControlEdge(before="gradient_tape/conv_filter_grad", after="gradient_tape/conv_input_grad")]


def test_small_joins_are_left_alone():
    # Both branch results are 4 MiB: with a 5 MiB floor neither counts, and nothing is ordered.
    assert branch_edges(forked_step(), min_bytes=5 << 20) == []


def test_a_plan_carries_its_edges_and_the_rewrite_applies_them():
    _, _, step, specs, _ = training_step(resnet50_imagenet(2))
    config = LMSConfig(enabled=True, mode="manual", swapout_threshold=1_000_000)  # order only, no swaps
    rewritten = lms_tf.rewrite(step, *specs, config=config, compute_device="/device:GPU:0", host_device=HOST)
    plan = rewritten.plan
    assert plan.swaps == [] and len(plan.control_edges) > 50  # ResNet-50: every block's fork, every BN's terms
    nodes = {n.name: n for n in rewritten.graph_def.node}
    for edge in plan.control_edges:
        assert f"^{edge.before}" in nodes[edge.after].input
    off = lms_tf.rewrite(step, *specs, config=LMSConfig(enabled=True, mode="manual", swapout_threshold=1_000_000,
                                                        serialize_branches=False))
    assert off.plan.control_edges == [] and off.graph_def == off.concrete.graph.as_graph_def()


def test_tensorflow_executes_the_order():
    """On split devices every edge holds in the partition graphs TensorFlow executed: its two ops ran
    under their own names (the rewrite keeps them from Grappler), and the later one had the earlier
    among its ancestors."""
    _, _, step, specs, batch = training_step(ARCHITECTURES["resnet50"], device=COMPUTE)
    swap_all = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, swapin_ahead=1, min_tensor_bytes=0)
    rewritten = lms_tf.rewrite(step, *specs, config=swap_all, compute_device=COMPUTE, host_device=HOST)
    report = verify_gating(rewritten, *batch)
    assert report.all_gated, report.verification().first_failure()
    assert report.edges_kept == report.edges_checked == len(rewritten.plan.control_edges) > 50, report.edges_broken


def test_grappler_estimates_less_memory_with_the_order():
    """Grappler's own estimate of ResNet-50 at 224x224, batch 32, with the default swaps, is lower
    with the backward pass ordered than without (at batch 512: 6.3 against 13.9 GiB)."""
    _, _, step, specs, _ = training_step(resnet50_imagenet(32))
    peaks = {}
    for serialize in (False, True):
        config = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, swapin_ahead=1, serialize_branches=serialize)
        rewritten = lms_tf.rewrite(step, *specs, config=config)
        peaks[serialize] = estimate_peak(rewritten.graph_def, rewritten.concrete, host_ops=rewritten.host_ops).device_bytes
    assert peaks[True] < peaks[False], {k: v / GIB for k, v in peaks.items()}