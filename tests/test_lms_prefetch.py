"""Copies back moved into the link's idle time (lms_core.prefetch), on a chain of six activations
a..f (tests.fixtures.chain_step), one op per second, 4 MiB each, copies of 2 s each way:

    x ones a b c d e f loss seed grad_f grad_e grad_d grad_c grad_b grad_a      ops, in order
    0 1    2 3 4 5 6 7 8    9    10     11     12     13     14     15          start, unswapped (s)

With a budget of 24 MiB the access-order planner swaps a, b and c, and grad_e waits for their
copies out (done at 5, 7 and 9). On the unswapped schedule each copy back starts two seconds before
its reader, so it is triggered by the op before that reader: c's by grad_e, b's by grad_c, a's by
grad_b. In the replay that places them one after another with the queue idle between:

    c: grad_e ends 12, copy 12-14, grad_c 14-15
    b: grad_c ends 15, copy 15-17, grad_b 17-18
    a: grad_b ends 18, copy 18-20, grad_a 20-21      step 21 s, the queue idle 14-15 and 17-18

Triggered by the first op on their reader's chain that ends after the trigger of the copy ahead
(grad_d, ending at 13, for b; grad_c, at 15, for a), each starts as the queue frees:

    b: copy 14-16, grad_b 16-17;  a: copy 16-18, grad_a 18-19      step 19 s
"""
from __future__ import annotations

from lms_core.access_order import plan_access_order
from lms_core.config import LMSConfig
from lms_core.link import LinkRates
from lms_core.plan import Plan
from lms_core.planner import latest_backward_inputs
from lms_core.prefetch import earlier_triggers, fill_idle_link, with_triggers
from lms_core.simulator import simulate
from tests.fixtures import MIB, chain_step, unit_costs

CONFIG = LMSConfig(min_tensor_bytes=MIB)
SLOW = LinkRates("slow", 2 * MIB, 2 * MIB, "test")  # a 4 MiB copy takes 2 s
GRAD = "gradient_tape/grad_"


def triggers(plan: Plan) -> dict[str, str]:
    return {swap.tensor: swap_in.trigger for swap in plan.swaps for swap_in in swap.swap_ins}


def test_copies_back_move_into_the_queues_idle_time_and_the_step_shortens_by_it():
    graph = chain_step("abcdef")
    costs = unit_costs(graph)
    planned = plan_access_order(graph, CONFIG, costs, SLOW, 24 * MIB)
    assert triggers(planned.plan) == {"a:0": GRAD + "c", "b:0": GRAD + "d", "c:0": GRAD + "e"}
    assert planned.simulation.h2d_busy == [(12.0, 14.0), (14.0, 16.0), (16.0, 18.0)]
    assert planned.simulation.step_time_s == 19.0
    # The same plan triggered as the unswapped schedule placed the copies (the module docstring):
    unmoved = with_triggers(planned.plan, {"lms/swapin_b_0_0": GRAD + "c", "lms/swapin_a_0_0": GRAD + "b"}, graph)
    before = simulate(graph, unmoved, costs, SLOW, keep_events=True)
    assert before.h2d_busy == [(12.0, 14.0), (15.0, 17.0), (18.0, 20.0)]
    assert before.step_time_s == 21.0
    # Only triggers change: the same copies, the same bytes, no higher peak.
    assert planned.simulation.traffic_bytes == before.traffic_bytes == 3 * 2 * 4 * MIB
    assert planned.simulation.peak_device_bytes == before.peak_device_bytes <= 24 * MIB
    moved, replay = fill_idle_link(graph, unmoved, before, costs, SLOW, 24 * MIB)
    assert triggers(moved) == triggers(planned.plan) and replay.step_time_s == 19.0


def test_a_copy_moves_only_where_the_device_has_room_for_it():
    """In the replay without the moves, at 14 s the device holds grad_d's output, c's copy back and
    grad_c's new output: 12 MiB, the most it holds over 13-16 s and over 15-18 s. b's copy, moved
    to grad_d's trigger, needs 4 MiB more from grad_d's end (13 s: Grappler's estimate holds a copy's
    buffer from its trigger's end, though the queue is busy until 14): it is moved under a limit of
    16 MiB, not of 15. a's copy
    moves only behind b's: left where it was, b's copy is asked for when grad_c ends (15 s), and no
    op on grad_a's chain ends after that before a's own trigger, grad_b."""
    graph = chain_step("abcdef")
    costs = unit_costs(graph)
    planned = plan_access_order(graph, CONFIG, costs, SLOW, 24 * MIB)
    unmoved = with_triggers(planned.plan, {"lms/swapin_b_0_0": GRAD + "c", "lms/swapin_a_0_0": GRAD + "b"}, graph)
    before = simulate(graph, unmoved, costs, SLOW, keep_events=True)
    latest = latest_backward_inputs(graph)
    assert earlier_triggers(unmoved, before, SLOW, 15 * MIB, latest) == {}
    assert earlier_triggers(unmoved, before, SLOW, 16 * MIB, latest) == {
        "lms/swapin_b_0_0": GRAD + "d", "lms/swapin_a_0_0": GRAD + "c"}


def test_turned_off_the_planner_leaves_the_triggers_the_schedule_gave():
    """`lms.refine_on_replay: false` (what the estimate's re-plan uses when Grappler puts a refined
    plan over the device memory): the module docstring's first timeline, step 21 s."""
    graph = chain_step("abcdef")
    planned = plan_access_order(graph, LMSConfig(min_tensor_bytes=MIB, refine_on_replay=False), unit_costs(graph),
                                SLOW, 24 * MIB)
    assert triggers(planned.plan) == {"a:0": GRAD + "b", "b:0": GRAD + "c", "c:0": GRAD + "e"}
    assert planned.simulation.step_time_s == 21.0 and planned.copies_moved == 0
    moved = plan_access_order(graph, CONFIG, unit_costs(graph), SLOW, 24 * MIB)
    assert moved.copies_moved == 2 and "2 copies back moved into the link's idle time" in moved.describe()
    # The refined result keeps the plan as it was, for Grappler's second opinion (rewrite_within_estimate).
    assert moved.unrefined.plan.swaps == planned.plan.swaps and moved.unrefined.simulation.step_time_s == 21.0
    assert planned.unrefined is None
