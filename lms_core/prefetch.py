"""Copies back started earlier where the link would idle and the device has room: the access-order
planner's last step (lms_core.access_order).

The access-order planner places each copy back on the unswapped schedule, as late as the link
allows. On a link slower than the step needs, the replay's backward pass is stretched by stalls,
and a copy triggered by the op a copy's time before its reader on the unswapped schedule starts
only when that op has run: the host-to-device queue idles between copies while the device has
room. The 3D U-Net at 368^3 on PCIe 3 moves 96 GiB back, 8.6 s of copies; in its replay the queue
idled 3.6 s of the backward pass, 2.2 s of it while the device held under 6 GiB (issue 16).

So the replay's copies back are walked in the order they ran. Where the queue was idle before one,
it is triggered instead by the op that ends first after the trigger of the copy ahead (so it
cannot overtake that copy), among the ops on its first reader's chain of latest backward inputs
(ancestors of the reader, so the plan cannot deadlock), if the replay's device memory, plus the
copies already moved over that stretch, leaves room for its buffer from that op's end until the
copy started. (From the trigger's end, though the copy may start later, when the queue is free and
its tensor on the host: Grappler's estimate, whose copies take no time, holds the buffer from
then.) The plan is replayed and kept if the step is faster and its peak no higher than allowed: of
the moves, their first half, quarter and so on, the fastest; this repeats while it helps. It
changes triggers only: the same tensors, the same copies, the same bytes moved.
"""
from __future__ import annotations

import bisect
import copy

from lms_core.graph import Graph
from lms_core.link import LinkRates
from lms_core.plan import Plan
from lms_core.planner import latest_backward_inputs
from lms_core.simulator import SimulationResult, SimulationStalled, simulate

MAX_PASSES = 16  # rounds of "trigger the copies after idle link time earlier", each a few replays
MIN_GAIN_S = 1e-4  # a copy moved earlier by less than this is left alone


def fill_idle_link(graph: Graph, plan: Plan, simulation: SimulationResult, costs: dict[str, float],
                   link: LinkRates, limit_bytes: int, min_gain: float = 0.0) -> tuple[Plan, SimulationResult]:
    """`plan` with copies back triggered earlier into the host-to-device queue's idle time, and its
    replay (`simulation` must have been made `keep_events`). `limit_bytes`: no peak above this, nor
    above the plan's own, is accepted. `min_gain`: the passes end after one that shortens the step
    by less than this share of it (each pass costs several replays)."""
    if not plan.swaps or not simulation.memory_events:
        return plan, simulation
    limit = max(limit_bytes, simulation.peak_device_bytes)
    latest = latest_backward_inputs(graph)
    for _ in range(MAX_PASSES):
        moved = earlier_triggers(plan, simulation, link, limit, latest)
        # Each move shifts the replay after it, which the room found for the later ones assumed
        # unmoved: of the prefixes of the moves (in the order the copies ran) that halve down to
        # one, the one whose replay is fastest within the limit is kept.
        # Trials are replayed without memory events (making and sorting them is nearly half of a
        # replay: lms_core.pruning); the one kept is replayed with them, for the next pass.
        count, better = len(moved), None
        while count:
            trial = with_triggers(plan, dict(list(moved.items())[:count]), graph)
            try:
                replay = simulate(graph, trial, costs, link)
            except SimulationStalled:
                replay = None
            if replay is not None and replay.peak_device_bytes <= limit and replay.step_time_s < (
                    better[1].step_time_s if better else simulation.step_time_s):
                better = trial, replay
            count //= 2
        if better is None:
            break
        gain = simulation.step_time_s - better[1].step_time_s
        plan, simulation = better[0], simulate(graph, better[0], costs, link, keep_events=True)
        if gain < min_gain * simulation.step_time_s:
            break
    return plan, simulation


def earlier_triggers(plan: Plan, simulation: SimulationResult, link: LinkRates, limit_bytes: int,
                     latest: dict[str, str | None]) -> dict[str, str]:
    """Swap-in -> the op to trigger it instead, for the copies back after idle time on the queue
    that the replay's memory has room to start earlier (module docstring)."""
    ends = {name: end for name, _, end in simulation.executed}
    on_host = _copied_out(plan, simulation)
    usage = _Usage(simulation)
    started = {event.buffer: event.time for event in simulation.memory_events if event.nbytes > 0}
    # The queue serves copies in the order they are asked for (their triggers' ends), each once its
    # tensor is on the host.
    copies = sorted((started[swap_in.name], swap_in.name, swap_in.trigger, swap_in.consumers[0], swap.nbytes,
                     on_host.get(swap.tensor, float("inf")))
                    for swap in plan.swaps for swap_in in swap.swap_ins if swap_in.name in started)
    moved: dict[str, str] = {}
    queue_free = asked = None  # when the queue is free again; when the copy before was asked for
    for start, name, trigger, reader, nbytes, copied_out in copies:
        if queue_free is not None and start - max(queue_free, copied_out) > MIN_GAIN_S:
            # Asked for with or before the copy ahead, this copy could go first, and hold the queue
            # until its tensor is on the host: its new trigger ends after that copy's.
            earlier = _first_ending_after(reader, asked, ends, latest)
            begin = None if earlier is None else max(ends[earlier], queue_free, copied_out)
            # Room is needed from the trigger's end, not the copy's start: Grappler's estimate,
            # whose copies take no time, holds the buffer from then.
            if begin is not None and begin < start - MIN_GAIN_S and \
                    usage.most(ends[earlier], start) + nbytes <= limit_bytes:
                moved[name], trigger = earlier, earlier
                usage.add(ends[earlier], start, nbytes)
                start = begin
        asked = ends.get(trigger, start)
        queue_free = max(queue_free if queue_free is not None else start, start) + nbytes / link.h2d_bytes_per_s
    return moved


def _first_ending_after(reader: str, moment: float, ends: dict[str, float],
                        latest: dict[str, str | None]) -> str | None:
    """The op on `reader`'s chain of latest backward inputs that ends first after `moment`."""
    found, current = None, latest.get(reader)
    while current is not None and ends.get(current, float("-inf")) > moment:
        found, current = current, latest.get(current)
    return found


def _copied_out(plan: Plan, simulation: SimulationResult) -> dict[str, float]:
    """Swapped tensor -> when its copy out ended in the replay: the device-to-host queue copies them
    in the order their producers ran (each producer's outputs in order), one interval each."""
    position = {name: i for i, (name, _, _) in enumerate(simulation.executed)}
    swaps = sorted((position[s.tensor.rpartition(":")[0]], int(s.tensor.rpartition(":")[2]), s.tensor)
                   for s in plan.swaps if s.tensor.rpartition(":")[0] in position)
    return {tensor: end for (_, _, tensor), (_, end) in zip(swaps, simulation.d2h_busy)}


def with_triggers(plan: Plan, triggers: dict[str, str], graph: Graph) -> Plan:
    """A copy of `plan` whose swap-ins named in `triggers` are triggered by the op given."""
    changed = copy.deepcopy(plan)
    for swap in changed.swaps:
        for swap_in in swap.swap_ins:
            if swap_in.name in triggers:
                swap_in.trigger = triggers[swap_in.name]
                swap_in.trigger_level = graph[swap_in.trigger].level
    return changed


class _Usage:
    """The replay's device memory over time (each instant at its highest, which also stands for the
    stretch to the next instant: an over-estimate there), plus the buffers of copies moved earlier
    over the stretches they now start before."""

    def __init__(self, simulation: SimulationResult):
        self.times: list[float] = []
        self.levels: list[int] = []
        level = 0
        for event in simulation.memory_events:  # sorted by time, then phase
            level += event.nbytes
            if self.times and self.times[-1] == event.time:
                self.levels[-1] = max(self.levels[-1], level)
            else:
                self.times.append(event.time)
                self.levels.append(level)
        self.extra = [0] * len(self.times)  # bytes of the copies moved earlier, at each point

    def _span(self, start: float, end: float) -> range:
        first = max(0, bisect.bisect_right(self.times, start) - 1)  # the point in force at `start`
        return range(first, max(first + 1, bisect.bisect_left(self.times, end)))

    def most(self, start: float, end: float) -> int:
        return max(self.levels[i] + self.extra[i] for i in self._span(start, end))

    def add(self, start: float, end: float, nbytes: int) -> None:
        for i in self._span(start, end):
            self.extra[i] += nbytes
