"""Swaps the replay shows an access-order plan does not need (the access-order planner's last step,
after lms_core.prefetch).

The planner's later rounds only add swaps: where a replay's peak is over the budget, they add the
tensors left on the device there, hold copies back past it, or lower the budget. Tensors the
backward pass makes are taken only that way, for one replay's peak, and a later round can cover
that moment otherwise; each is copied out and back while the backward pass needs the link for the
forward tensors' copies back. So each swap of such a tensor is dropped alone on a replay, those
that make the step faster without a higher peak are ranked by the time they save, and dropped in
that order, each kept dropped if the replay still says so. The 3D U-Net at 368^3 on PCIe 3: 3 of
its 13 such swaps, 8.9 GiB less each way, 17191 ms became 16205 ms (1.26x the bound became 1.18x).
"""
from __future__ import annotations

import dataclasses

from lms_core.graph import BACKWARD, Graph
from lms_core.link import LinkRates
from lms_core.plan import Plan
from lms_core.simulator import SimulationResult, SimulationStalled, simulate


def drop_unneeded_swaps(graph: Graph, plan: Plan, simulation: SimulationResult, costs: dict[str, float],
                        link: LinkRates, limit_bytes: int) -> tuple[Plan, SimulationResult, int]:
    """`plan` without the swaps of backward-made tensors the replay does not need, its replay (made
    `keep_events`), and how many were dropped. No peak above `limit_bytes`, nor above the plan's
    own, is accepted."""
    limit = max(limit_bytes, simulation.peak_device_bytes)

    def replayed(without: set[str]) -> tuple[Plan, SimulationResult] | None:
        # Without memory events: a trial needs its peak and step time only, and making and sorting a
        # step's events took nearly half of each trial (ResNet-50 at batch 1024: 7 s of trials a plan
        # became 4). The plan kept is replayed once more with them.
        trial = dataclasses.replace(plan, swaps=[swap for swap in plan.swaps if swap.tensor not in without])
        try:
            replay = simulate(graph, trial, costs, link)
        except SimulationStalled:
            return None
        return (trial, replay) if replay.peak_device_bytes <= limit else None

    made_backward = [swap.tensor for swap in plan.swaps
                     if graph[swap.tensor.rpartition(":")[0]].category == BACKWARD]
    savings = []
    for tensor in made_backward:
        result = replayed({tensor})
        if result is not None and result[1].step_time_s < simulation.step_time_s:
            savings.append((simulation.step_time_s - result[1].step_time_s, tensor))
    kept, dropped = (plan, simulation), set()
    for _, tensor in sorted(savings, reverse=True):
        result = replayed(dropped | {tensor})
        if result is not None and result[1].step_time_s < kept[1].step_time_s:
            dropped.add(tensor)
            kept = result
    if not dropped:
        return plan, simulation, 0
    return kept[0], simulate(graph, kept[0], costs, link, keep_events=True), len(dropped)
