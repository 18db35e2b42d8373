"""Swaps the replay does not need (lms_core.pruning), on the six-activation chain of
tests/test_lms_prefetch.py (one op per second, 4 MiB tensors, 2 s per copy, budget 24 MiB), whose
access-order plan swaps a, b and c and takes 19 s.

Add to it a swap of grad_f's output, a tensor the backward pass makes at 10-11 and grad_e reads at
once, copied back when grad_f has run: its copy out runs 11-13 (the queue is free since c's ended at
9), its copy back 13-15, once the tensor is on the host, and grad_e waits for it until 15. The step
takes 23 s, with a peak of 20 MiB. Dropped, the plan is the 24 MiB plan again: 19 s, 24 MiB, which
the budget allows.
"""
from __future__ import annotations

import dataclasses

from lms_core.plan import Swap, SwapIn
from lms_core.pruning import drop_unneeded_swaps
from lms_core.simulator import simulate
from tests.fixtures import MIB, chain_step, unit_costs
from tests.test_lms_prefetch import CONFIG, SLOW, plan_access_order

GRAD_F, GRAD_E = "gradient_tape/grad_f", "gradient_tape/grad_e"


def with_grad_f_swapped(graph, plan):
    producer = graph[GRAD_F]
    swap = Swap(tensor=f"{GRAD_F}:0", producer_type=producer.type, shape=list(producer.outputs[0].shape),
                dtype=producer.outputs[0].dtype, nbytes=4 * MIB, producer_level=producer.level,
                swap_out="lms/swapout_grad_f_0",
                swap_ins=[SwapIn(name="lms/swapin_grad_f_0_0", trigger=GRAD_F, trigger_level=producer.level,
                                 consumers=[GRAD_E], consumer_levels=[graph[GRAD_E].level])])
    return dataclasses.replace(plan, swaps=[*plan.swaps, swap])


def test_a_backward_made_swap_that_only_costs_time_is_dropped():
    graph = chain_step("abcdef")
    costs = unit_costs(graph)
    planned = plan_access_order(graph, CONFIG, costs, SLOW, 24 * MIB)
    assert planned.simulation.step_time_s == 19.0 and planned.simulation.peak_device_bytes == 24 * MIB
    padded = with_grad_f_swapped(graph, planned.plan)
    replay = simulate(graph, padded, costs, SLOW, keep_events=True)
    assert replay.d2h_busy[-1] == (11.0, 13.0) and (13.0, 15.0) in replay.h2d_busy
    assert {name: start for name, start, _ in replay.executed}[GRAD_E] == 15.0
    assert replay.step_time_s == 23.0 and round(replay.peak_device_bytes / MIB) == 20
    pruned, pruned_replay, dropped = drop_unneeded_swaps(graph, padded, replay, costs, SLOW, 24 * MIB)
    assert dropped == 1 and [swap.tensor for swap in pruned.swaps] == ["a:0", "b:0", "c:0"]
    assert pruned_replay.step_time_s == 19.0 and pruned_replay.peak_device_bytes == 24 * MIB


def test_no_swap_is_dropped_if_that_raises_the_peak_past_the_limit():
    """The same padded plan held to its own peak (20 MiB): without grad_f's swap the step peaks at
    24 MiB, so the swap stays, though it costs 4 s. Swaps of tensors the forward pass makes (a, b, c)
    are not tried."""
    graph = chain_step("abcdef")
    costs = unit_costs(graph)
    planned = plan_access_order(graph, CONFIG, costs, SLOW, 24 * MIB)
    padded = with_grad_f_swapped(graph, planned.plan)
    replay = simulate(graph, padded, costs, SLOW, keep_events=True)
    kept, kept_replay, dropped = drop_unneeded_swaps(graph, padded, replay, costs, SLOW, 0)
    assert dropped == 0 and kept is padded and kept_replay is replay
