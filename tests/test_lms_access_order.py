"""The access-order strategy (lms_core.access_order): on a hand-made schedule it meets a budget with
the traffic a hand computation gives; the bound is never above a simulated step; and its plans,
applied to the test architectures, are gated in what TensorFlow executes and train the same.

The chain below runs one op per second (fixtures.unit_costs), each activation 4 MiB:

    x  ones  a  b  c  loss  seed  grad_c  grad_b  grad_a          ops, in the order they run
    0  1     2  3  4  5     6     7       8       9               start (s)

a, b and c are each read again by their gradient, so when grad_b starts (t=8) the device holds a, b,
grad_c, grad_b and the seed (freed as grad_b starts, counted with it, as Grappler counts it): 24 MiB,
the step's peak.
"""
from __future__ import annotations

import pytest

from lms_core.access_order import (Schedule, _paced, choose, find_candidates, lower_bound_s, lowest_free_budget,
                                   plan_access_order, zero_overhead_point)
from lms_core.config import LMSConfig
from lms_core.link import NAMED_LINKS, LinkRates
from lms_core.plan import Plan
from lms_core.simulator import simulate
from lms_core.tuner import tune
from tests.fixtures import MIB, chain_step, unit_costs

CONFIG = LMSConfig(min_tensor_bytes=MIB)
FAST = LinkRates("fast", 1e12, 1e12, "test")  # a 4 MiB copy takes 4 us: hidden behind any op
SLOW = LinkRates("slow", 2 * MIB, 2 * MIB, "test")  # a 4 MiB copy takes 2 s: two ops' time


def unswapped(graph, link=FAST):
    return simulate(graph, Plan(settings={}), unit_costs(graph), link, keep_events=True)


def first_round(graph, link, budget):
    """The planner's first round for `budget` (the tensors `choose` takes, then the waits the
    replays add in `_paced`), even below the floor, where plan_access_order plans for the floor: the
    chain's floor is 20 MiB, so its pacing shows only below that."""
    costs = unit_costs(graph)
    schedule = Schedule(graph, unswapped(graph, link))
    candidates, skipped = find_candidates(graph, CONFIG, schedule, link, "", frozenset())
    chosen, waits, holds, _ = choose(schedule, candidates, link, budget)
    return _paced(graph, CONFIG, schedule, chosen, waits, holds, link, skipped, [], costs, budget, {})


def test_the_chain_peaks_where_the_docstring_says():
    base = unswapped(chain_step())
    assert base.peak_device_bytes == 24 * MIB
    assert base.step_time_s == 10.0


def test_one_tensor_over_the_budget_is_one_tensor_swapped_and_costs_no_time_on_a_fast_link():
    """24 MiB at the peak, a budget of 20: one activation must be off the device at t=8. Of a, b, c
    only a is idle then and for longest (read at 3 by b, next at 9 by grad_a; b is read at 8 itself):
    a goes out and comes back, 4 MiB each way, hidden behind the ops."""
    graph = chain_step()
    result = plan_access_order(graph, CONFIG, unit_costs(graph), FAST, 20 * MIB)
    assert [swap.tensor for swap in result.plan.swaps] == ["a:0"]
    assert result.fits and result.simulation.peak_device_bytes <= 20 * MIB
    assert result.simulation.traffic_bytes == 2 * 4 * MIB
    assert result.simulation.step_time_s == 10.0 and result.simulation.stall_time_s == 0


def test_on_a_slow_link_the_budget_is_met_by_waiting_and_the_wait_is_what_the_link_forces():
    """The same budget with 2 s per copy: a must be off at t=8 and is read at t=9; its copy back
    cannot start before grad_b allocates at 8 and takes 2 s, so grad_a cannot start before 10: at
    least one second more than the unswapped step."""
    graph = chain_step()
    result = plan_access_order(graph, CONFIG, unit_costs(graph), SLOW, 20 * MIB)
    assert [swap.tensor for swap in result.plan.swaps] == ["a:0"]
    assert result.fits
    assert result.simulation.step_time_s >= 11.0


@pytest.mark.parametrize("link", [FAST, SLOW, NAMED_LINKS["pcie3"]], ids=lambda link: link.name)
@pytest.mark.parametrize("budget_mib", [24, 22, 20, 16, 12])
def test_the_bound_is_never_above_a_simulated_step(link, budget_mib):
    graph = chain_step()
    costs, budget = unit_costs(graph), budget_mib * MIB
    base = unswapped(graph, link)
    bound, forced = lower_bound_s(Schedule(graph, base), link, budget)
    assert forced == max(0, base.peak_device_bytes - budget)
    ordered = plan_access_order(graph, CONFIG, costs, link, budget, unswapped=base)
    tuned = tune(graph, costs, link, budget, 1 << 40, CONFIG)
    fitting = [sim for sim in (ordered.simulation, tuned.simulation, base) if sim.peak_device_bytes <= budget]
    assert fitting or budget_mib < 20  # the budgets the chain can meet are met
    for sim in fitting:  # a plan over the budget may well be faster: the bound is for those that meet it
        assert bound <= sim.step_time_s + 1e-9


def test_a_copy_out_the_link_cannot_finish_in_time_makes_the_op_allocating_then_wait():
    """Budget 20 with copies out of 2 s: a ends at t=3, its copy is done at 5, before the peak at 8
    (grad_b). But TensorFlow's executor sees a copy end only when it next waits for the GPU, and
    without a wait that is grad_a's, for its copy back, after the peak: so grad_b, the op allocating
    at the peak, waits for a's copy, at no cost (it starts at 8, as without swaps). Aimed at 8 MiB
    (the planner's first round: 8 MiB is below the step's floor, which the planner also plans for,
    next test) the device is already over it when c allocates at t=4 (a, b, c): a, read last by b
    (done at 4), must be gone by then, but its copy is only done at 5, so c waits for it."""
    graph = chain_step()
    costs = unit_costs(graph)
    relaxed = plan_access_order(graph, CONFIG, costs, SLOW, 20 * MIB)
    assert {swap.tensor: swap.waiters for swap in relaxed.plan.swaps} == {"a:0": ["gradient_tape/grad_b"]}
    assert relaxed.fits and relaxed.plan.settings["sync_mode"] == 1
    assert {name: start for name, start, _ in relaxed.simulation.executed}["gradient_tape/grad_b"] == 8.0
    tight, tight_replay = first_round(graph, SLOW, 8 * MIB)
    waits = {swap.tensor: swap.waiters for swap in tight.swaps}
    assert waits["a:0"] == ["c"]
    assert tight.settings["sync_mode"] == 1  # the simulator and the rewrite hold waiters in sync mode 1
    assert tight_replay.stall_time_s >= 1.0  # c starts at 5, not 4
    assert tight_replay.peak_device_bytes > 8 * MIB


def test_below_the_floor_the_plan_for_the_floor_is_kept_unless_aiming_lower_ends_lower():
    """The chain's floor is 20 MiB (test_the_floor_is_what_no_swap_can_move). On the fast link,
    aimed at 16 MiB the planner swaps a and b and the step still peaks at 20 MiB; planned for the
    floor it swaps a alone, with the same peak and step and half the bytes moved: that plan is kept.
    On the slow link the replay is not the unswapped schedule: ops wait for copies, so grad_b no
    longer starts the instant grad_c frees seed and c, and aimed at 8 MiB the step peaks below the
    floor (a lower peak beats the floor's plan, whatever it costs)."""
    graph = chain_step()
    costs = unit_costs(graph)
    at_floor = plan_access_order(graph, CONFIG, costs, FAST, 20 * MIB)
    below = plan_access_order(graph, CONFIG, costs, FAST, 16 * MIB)
    assert {s.tensor: s.waiters for s in below.plan.swaps} == {"a:0": ["gradient_tape/grad_b"]}
    assert below.simulation.traffic_bytes == 2 * 4 * MIB == at_floor.simulation.traffic_bytes
    assert below.simulation.peak_device_bytes == 20 * MIB == below.floor_bytes
    assert not below.fits and below.planned_for_floor
    assert "the plan made for the floor was kept" in below.describe()
    slow = plan_access_order(graph, CONFIG, costs, SLOW, 8 * MIB)
    assert slow.simulation.peak_device_bytes < slow.floor_bytes == 20 * MIB
    assert not slow.planned_for_floor


def test_a_copy_out_still_queued_at_the_replayed_peak_makes_the_op_allocating_there_wait():
    """The first round for 12 MiB (below the floor), 2 s per copy. a's copy out runs 3-5, so c
    (allocating at 4: a, b, c) waits for it until 5; b's copy queues behind a's, 5-7. c then runs
    5-6, loss 6-7, seed 7-8, grad_c 8-9. Nothing waits for b's copy, so the executor sees it end
    only at grad_b, which waits for b's copy back: b is still there when grad_c allocates at 8, the
    replay's peak, and grad_c waits for b's copy. Replayed again, seed allocates at 7, the instant
    b's copy ends: allocations at an instant count before its frees, so b, c and seed's output are
    all there, and seed waits for that copy too (the unswapped schedule, on which the waits are
    first planned, had b's copy done long before). grad_c's wait stays, and costs nothing: the copy
    has ended by then."""
    plan, _ = first_round(chain_step(), SLOW, 12 * MIB)
    assert {swap.tensor: swap.waiters for swap in plan.swaps} == {
        "a:0": ["c"], "b:0": ["gradient_tape/grad_c", "gradient_tape/seed"]}


def test_the_floor_is_what_no_swap_can_move():
    """With every activation off the device whenever it could be, the chain still holds 20 MiB as
    grad_b starts at t=8: grad_c's output and b (its readers), grad_b's new output, and seed and c,
    which grad_c frees at that very instant (an instant's allocations count before its frees, in
    the simulator as in Grappler). No budget below that is met, and the plan says why."""
    graph = chain_step()
    result = plan_access_order(graph, CONFIG, unit_costs(graph), FAST, 16 * MIB)
    assert result.floor_bytes == 20 * MIB
    assert not result.fits and result.simulation.peak_device_bytes >= result.floor_bytes
    assert "below this schedule's floor: 20.00 MiB" in result.describe()


@pytest.mark.parametrize("link, saved_mib", [(FAST, 4), (LinkRates("mid", 8 * MIB, 8 * MIB, "test"), 4), (SLOW, 0)],
                         ids=["fast", "mid", "slow"])
def test_the_zero_overhead_point_is_the_largest_saving_that_costs_no_time(link, saved_mib):
    """The chain's floor is 20 MiB of its 24 (above): the most any plan saves is a (4 MiB), off the
    device at t=8 and read at t=9. Its copy back can start at 8 at the earliest and must be done by
    9: at 0.5 s per copy (8 MiB/s) it is, for free; at 2 s per copy it is not, so on that link no
    saving is free and the point is the unswapped peak."""
    graph = chain_step()
    point = zero_overhead_point(graph, CONFIG, unit_costs(graph), link, resolution_bytes=1024)
    assert point.unswapped_bytes == 24 * MIB
    assert point.budget_bytes == (24 - saved_mib) * MIB
    assert point.step_time_s <= point.unswapped_step_s * 1.01
    assert point.saving == pytest.approx(saved_mib / 24)
    assert point.bound_bytes <= point.budget_bytes


def test_no_saving_is_free_beyond_what_the_link_moves_around_each_moment():
    """At 2 MiB/s on the chain (10 s of compute): at t=8 the device holds 24 MiB; in the 2 s after
    it only 4 MiB can come back, so at least 20 MiB stay. At t=7 (20 MiB) 6 MiB can come back in
    the 3 s left: 14. At t=9 (20 MiB), 2 MiB in 1 s: 18. Earlier moments hold less. 20 MiB it is."""
    graph = chain_step()
    assert lowest_free_budget(Schedule(graph, unswapped(graph, SLOW)), SLOW) == 20 * MIB


# --- on what TensorFlow executes ---------------------------------------------------------------------


# The test architectures whose peak activations can leave the device (the toy ResNet-50's peak is its
# weights, gradients and momentum; the unrolled LSTM's, per-step temporaries read at once).
@pytest.mark.parametrize("name", ["densenet_block", "mobilenet_v2", "transformer_block", "unet3d"])
def test_access_order_plans_are_gated_and_train_the_same_on_split_devices(name):
    import tensorflow as tf

    import lms_core.tf as lms_tf
    from lms_core.costs import PROFILES
    from lms_core.planning import Target, op_costs
    from lms_core.tf.gating import verify_gating
    from tests.fixtures import COMPUTE, HOST
    from benchmarks.architectures import ARCHITECTURES, training_step
    from tests.fixtures import assert_same_training

    config = LMSConfig(enabled=True, mode="auto", strategy="access-order", min_tensor_bytes=0, memory_ratio=1.0)
    model_a, _, step_a, specs, batch = training_step(ARCHITECTURES[name], device=COMPUTE)
    traced = lms_tf.trace_step(step_a, *specs)
    unlimited = Target(NAMED_LINKS["pcie3"], PROFILES["v100"], 1 << 40, 1 << 40)
    peak = simulate(traced.graph, Plan(settings={}), op_costs(traced.graph, unlimited)[0],
                    unlimited.link).peak_device_bytes
    target = Target(NAMED_LINKS["pcie3"], PROFILES["v100"], int(0.8 * peak), 1 << 40)  # it must swap
    with tf.device(COMPUTE):
        losses_a = [float(step_a(*batch)) for _ in range(3)]
    model_b, _, step_b, _, _ = training_step(ARCHITECTURES[name], device=COMPUTE)
    rewritten = lms_tf.rewrite(step_b, *specs, config=config, compute_device=COMPUTE, host_device=HOST, target=target)
    assert rewritten.plan.settings["strategy"] == "access-order" and rewritten.plan.swaps
    assert rewritten.planning.access_order.fits
    report = verify_gating(rewritten, *batch)
    assert report.all_gated, report.verification().first_failure()
    assert report.edges_kept == report.edges_checked
    losses_b = [float(rewritten(*batch)) for _ in range(3)]
    rtol = 1e-4 if name == "unet3d" else 1e-6  # instance norm's gradient, as in test_lms_rewrite
    assert_same_training(losses_b, losses_a, model_b.variables, model_a.variables, rtol=rtol)


def test_the_bound_over_both_actions_recomputes_what_beats_the_link():
    """One moment m of a step: 8 MiB must be off the device, 1 s of compute before m and 1 s after,
    a link of 2 MiB/s each way, and a 4 MiB tensor idle at m that costs 1 s per MiB to make again.
    Swapping all 8 MiB: 4 s out before m, 4 s back after it, 8 s. Recomputing r MiB leaves 8 - r to
    the link, (8 - r) / 2 s each way, and the compute after m grows to 1 + r s: the two balance at
    r = 2 (3 s each way, 3 s after m), 6 s in all; more recompute costs more than it saves."""
    from lms_core.recompute import Relief

    mib = float(MIB)
    relief = Relief(((1.0 / mib, 0.0, 10.0, 4 * MIB),))

    def step_s(recomputed: float, cost_s: float = 0.0) -> float:
        left = 8 * mib - recomputed
        return max(1.0, left / (2 * mib)) + max(1.0 + cost_s, left / (2 * mib))

    assert step_s(0.0) == 8.0
    assert relief.least(5.0, 8 * MIB, step_s) == pytest.approx(6.0, rel=1e-6)
    assert relief.least(10.0, 8 * MIB, step_s) == 8.0  # not idle then: swaps alone
    # At 0.1 s per MiB all 4 idle MiB are worth making again (1.4 s after m): 4 MiB cross, 2 s each way.
    cheap = Relief(((0.1 / mib, 0.0, 10.0, 4 * MIB),))
    assert cheap.least(5.0, 8 * MIB, step_s) == pytest.approx(4.0, rel=1e-6)


@pytest.mark.parametrize("budget_mib", [20, 16, 12])
def test_the_bound_over_both_actions_is_under_the_swaps_and_under_every_plan_that_fits(budget_mib):
    """On the chain with a 2 s copy, the bound over both actions is never above the swaps' alone, nor
    above the step of a plan with recompute that fits the budget."""
    from lms_core.recompute import plan_recompute, recompute_relief

    graph = chain_step()
    costs, budget = unit_costs(graph), budget_mib * MIB
    base = unswapped(graph, SLOW)
    schedule = Schedule(graph, base)
    relief = recompute_relief(graph, schedule.start, schedule.end, costs, MIB)
    assert relief.tensors  # a, b and c can be made again
    swaps_only, _ = lower_bound_s(schedule, SLOW, budget)
    both, _ = lower_bound_s(schedule, SLOW, budget, relief)
    assert schedule.compute_s <= both <= swaps_only
    chosen = plan_recompute(graph, {}, costs, SLOW, budget, MIB)
    recomputed = simulate(chosen.graph, Plan(settings={}), chosen.costs, SLOW)
    if recomputed.peak_device_bytes <= budget:
        assert both <= recomputed.step_time_s + 1e-9
