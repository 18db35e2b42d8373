"""Swap just enough, at the link's pace: plans from each tensor's read/write order (Zhang et al.,
"Efficient Memory Management for GPU-based Deep Learning Systems", arXiv 1903.06631).

The distance planner (lms_core.planner) swaps every tensor whose consumers lie far enough apart in
levels, and the auto-tuner searches TFLMS's four knobs for the fastest set that fits. No setting of
those knobs says "swap only these tensors, each once, and bring each back when the link is free and
the budget allows": a threshold that swaps enough at the peak also swaps everything else that far
apart, and one `ahead` serves every copy back. This planner decides per tensor instead, on the
simulated schedule of the unswapped step:

1. **When each tensor is used.** For every swappable tensor (the same rules as the distance planner:
   lms_core.planner.reason_not_to_swap), its reads in time order; the longest idle gap after which
   only backward ops read it splits its readers into near ones (they keep the original) and far
   ones (they read a copy brought back).
2. **When it could be off the device.** Copies out run in production order on the device-to-host
   queue, so a tensor leaves the device when its copy is done and its near readers have run. Copies
   back run on the host-to-device queue, scheduled as late as the link allows: from the last
   backward read to the first, each copy ends by the time its first far reader starts, or by the
   start of the copy after it. Between the two the tensor costs the device nothing.
3. **Which to swap.** While the simulated memory over time exceeds the budget, at the moment of the
   largest excess it takes, among the tensors off the device then, the one whose removal takes the
   most excess away per byte moved, over the whole window it is off (so one tensor that spans the
   overflowing stretch beats several that each cover part of it). It stops when nothing is over.
4. **Triggers.** A copy back starts when its trigger has run: the latest op on the first far
   reader's chain of backward inputs that ends before the copy's scheduled start (an ancestor of
   the reader, so the plan can never deadlock). The plan entries are the same swaps and triggers
   the distance planner makes, applied, gated and verified the same way (lms_core.tf).
5. **Checked by the simulator.** The plan is replayed on the same simulator (lms_core.simulator),
   which queues the copies and stalls readers whose copy is late. If the replayed peak is over the
   budget (the schedule of step 2 assumed the unswapped times), planning is repeated for a budget
   lowered by the overshoot, a few times at most. Where the budget is below the schedule's floor
   (the most the unswapped step holds at one moment with every candidate off the device whenever
   it could be) and the plan misses it, the floor is planned for too, and the better kept: aiming
   below the floor mostly adds copies and waits for the same peak.
6. **Refined on the replay** (`lms.refine_on_replay`). A copy back after idle time on the
   host-to-device queue is triggered earlier where the device has room (lms_core.prefetch): the
   replay's backward pass is stretched by stalls, which the unswapped schedule's triggers ignore.
   Then swaps of backward-made tensors that the replay shows are not needed are dropped
   (lms_core.pruning).

It is not a search over TFLMS's knobs: there are no levels, thresholds or group sizes, only the
schedule, the sizes and the link's rates, and the smallest set of tensors whose time off the device
covers the excess.
"""
from __future__ import annotations

import dataclasses
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lms_core.config import LMSConfig
from lms_core.driver import Feedback, Proposal, best_of, better, plan_until_it_fits, replayed
from lms_core.graph import BACKWARD, Graph, Op, tensor_name
from lms_core.link import LinkRates
from lms_core.plan import ControlEdge, Plan, Skip, Swap, SwapIn
from lms_core.loops import list_record
from lms_core.planner import (SHAPE_ONLY_TYPES, latest_backward_inputs, reason_not_to_swap, swap_phase)
from lms_core.prefetch import fill_idle_link
from lms_core.pruning import drop_unneeded_swaps
from lms_core.simulator import SimulationResult, SimulationStalled, simulate

if TYPE_CHECKING:
    from lms_core.recompute import Relief

MAX_REPLANS = 6  # rounds of "the replay overshot: plan for less" before the best plan so far is kept
MAX_PACING = 60  # replays per round that add waits for copies out behind at the peak (_paced)


@dataclass(frozen=True)
class Return:
    """One copy back of a swapped tensor, for far readers close together in time."""

    readers: tuple[str, ...]  # in time order
    needed_at: float  # when the first starts: the copy must have arrived
    done_at: float  # when the last ends: the copy's device buffer is released then


@dataclass(frozen=True, eq=False)  # one object per tensor: compared by identity
class Candidate:
    """A tensor that may be swapped, with its accesses on the unswapped schedule."""

    tensor: str
    producer: Op
    nbytes: int
    produced_at: float  # when its producer ends: the copy out may start
    near_done_at: float  # when its last near reader ends (its producer's end when it has none)
    returns: tuple[Return, ...]  # the copies back, in time order
    order: int  # position of the producer in the schedule: copies out queue in this order


@dataclass(frozen=True)
class Window:
    """A stretch of the unswapped schedule during which a chosen tensor is off the device."""

    start: float
    end: float

    def covers(self, moment: float) -> bool:
        return self.start <= moment < self.end


@dataclass(frozen=True)
class Layout:
    """When a chosen tensor leaves the device and when each of its copies back starts (base times)."""

    released_at: float  # copy out done and near readers run
    backs: tuple[float, ...]  # per return

    def windows(self, candidate: Candidate) -> list[Window]:
        """The stretches it is off the device: until its first copy back, then between each
        return's last reader and the next copy back."""
        starts = [self.released_at] + [r.done_at for r in candidate.returns[:-1]]
        return [Window(start, end) for start, end in zip(starts, self.backs) if start < end]


@dataclass(frozen=True)
class AccessOrderResult:
    plan: Plan
    simulation: SimulationResult  # the plan replayed on the target
    budget_bytes: int  # the device budget it was made for
    fits: bool
    replans: int  # rounds planned for a lowered budget after the replay overshot
    candidates: int  # tensors it could choose from
    floor_bytes: int = 0  # the most the unswapped schedule holds at one moment that no candidate can leave
    planned_for_floor: bool = False  # the budget was below the floor, and the plan made for the floor was kept
    copies_moved: int = 0  # copies back triggered earlier, into the link's idle time (lms_core.prefetch)
    swaps_dropped: int = 0  # swaps the replay showed were not needed (lms_core.pruning)
    unrefined: AccessOrderResult | None = None  # when refined: the plan as it was before (refine_on_replay off)

    @property
    def refined(self) -> bool:
        """Whether the replay changed the plan (lms.refine_on_replay)."""
        return bool(self.copies_moved or self.swaps_dropped)

    def describe(self) -> str:
        from lms_core.units import format_bytes

        waits = sum(1 for swap in self.plan.swaps if swap.waiters)
        return (f"access-order: {len(self.plan.swaps)} of {self.candidates} candidate tensors swapped, "
                f"{format_bytes(self.plan.swapped_bytes)}, {self.plan.swap_in_count} copies back"
                + (f"; {waits} copies out waited for" if waits else "")
                + (f"; planned {self.replans} more time(s) for a lower budget after the replay overshot"
                   if self.replans else "")
                + (f"; the budget is below this schedule's floor: {format_bytes(self.floor_bytes)} on the device "
                   f"at one moment of the unswapped order that no swap can move"
                   if self.floor_bytes > self.budget_bytes else "")
                + ("; the plan made for the floor was kept (a lower peak, or as low and faster)"
                   if self.planned_for_floor else "")
                + (f"; {self.copies_moved} copies back moved into the link's idle time" if self.copies_moved else "")
                + (f"; {self.swaps_dropped} swaps the replay did not need dropped" if self.swaps_dropped else ""))


def plan_access_order(graph: Graph, config: LMSConfig, costs: dict[str, float], link: LinkRates, budget_bytes: int,
                      compute_device: str = "", data_inputs: frozenset[str] = frozenset(),
                      control_edges: list[ControlEdge] = (), unswapped: SimulationResult | None = None
                      ) -> AccessOrderResult:
    """The plan for `graph` (analysed, with `control_edges` imposed) that keeps the simulated device
    peak within `budget_bytes` on `link`, swapping as little as it can. `unswapped` is the replay of
    the step without swaps, if the caller has one (with `keep_events`)."""
    if unswapped is None or unswapped.executed is None:
        unswapped = simulate(graph, Plan(settings=config.settings()), costs, link, keep_events=True)
    schedule = Schedule(graph, unswapped)
    candidates, skipped = find_candidates(graph, config, schedule, link, compute_device, data_inputs)
    floor = schedule_floor(schedule, candidates)

    def rounds(aim: int) -> tuple[Plan, SimulationResult, int]:
        return _rounds(graph, config, schedule, candidates, skipped, link, control_edges, costs, aim)

    plan, simulation, replans = rounds(budget_bytes)
    planned_for_floor = False
    if simulation.peak_device_bytes > budget_bytes and floor > budget_bytes:
        # Aiming below the floor can swap more and wait longer for no lower peak (ResNet-50 at batch
        # 1024 on nvlink2: planned for 14.40 GiB, +25% and 15.41 GiB; for its floor, +14% and 15.41
        # GiB). But the replay's order is not the unswapped one (ops wait for copies), so aiming low
        # can also end below the floor (the U-Net at 368^3 on pcie3: 14.94 GiB against a floor of
        # 15.50; 16.06 aimed at it). So both are planned, and the lower peak kept; of two alike the
        # faster, then the one moving fewer bytes.
        at_floor = rounds(floor)
        if _lower_or_cheaper(at_floor[1], simulation, budget_bytes):
            (plan, simulation, replans), planned_for_floor = at_floor, True
    unrefined = AccessOrderResult(plan, simulation, budget_bytes, simulation.peak_device_bytes <= budget_bytes,
                                  replans, len(candidates), floor, planned_for_floor)
    if not config.refine_on_replay:
        return unrefined
    before = {s.name: s.trigger for swap in plan.swaps for s in swap.swap_ins}
    plan, simulation = fill_idle_link(graph, plan, simulation, costs, link, budget_bytes)
    moved = sum(s.trigger != before[s.name] for swap in plan.swaps for s in swap.swap_ins)
    plan, simulation, dropped = drop_unneeded_swaps(graph, plan, simulation, costs, link, budget_bytes)
    if not moved and not dropped:
        return unrefined
    return dataclasses.replace(unrefined, plan=plan, simulation=simulation,
                               fits=simulation.peak_device_bytes <= budget_bytes, copies_moved=moved,
                               swaps_dropped=dropped, unrefined=unrefined)


def _lower_or_cheaper(one: SimulationResult, other: SimulationResult, budget_bytes: int) -> bool:
    """Of two replayed plans, whether `one` is the better (lms_core.driver.better: the lower peak,
    peaks within its tie of the budget counting alike, then the faster step, then the fewer bytes)."""
    a = replayed(None, one, one.peak_device_bytes <= budget_bytes, budget_bytes)
    b = replayed(None, other, other.peak_device_bytes <= budget_bytes, budget_bytes)
    return better(b, a, budget_bytes) is a


def _rounds(graph: Graph, config: LMSConfig, schedule: Schedule, candidates: list[Candidate], skipped: list[Skip],
            link: LinkRates, control_edges: list[ControlEdge], costs: dict[str, float], budget_bytes: int
            ) -> tuple[Plan, SimulationResult, int]:
    """Plans for `budget_bytes`, replays, and plans again where the replay overshoots (lms_core.driver's
    loop with the replay judging, MAX_REPLANS more rounds at most): the best plan (plan_access_order's
    steps 3 to 5), its replay, and how many rounds came before it."""
    by_tensor = {c.tensor: c for c in candidates}
    held: dict[Hold, float] = {}  # copies back held past the replay's peak (kept across rounds)
    forced: set[str] = set()  # tensors chosen whatever the unswapped schedule says
    paced: dict[str, set[str]] = {}  # tensor -> ops that wait for its copy out (found by replays, kept across rounds)

    def propose(target: int) -> Proposal:
        chosen, waits, holds, met = choose(schedule, candidates, link, target, held,
                                           [by_tensor[t] for t in sorted(forced)])
        plan, simulation = _paced(graph, config, schedule, chosen, waits, holds, link, skipped, control_edges,
                                  costs, budget_bytes, paced)
        return Proposal((plan, simulation, {c.tensor for c in chosen}, met), target, target, simulation.step_time_s)

    def next_target(rounds, limit_bytes: int) -> int | None:
        last = rounds[-1]
        plan, simulation, chosen, met = last.proposal.plan
        improved = len(rounds) == 1 or better(best_of(rounds[:-1], limit_bytes), last, limit_bytes) is last
        if last.fits or not chosen or (not met and not improved):
            return None  # done, or below what any choice of these tensors reaches (the floor) and no better
        # The replay's times drift from the unswapped schedule's (waits, queued copies): a copy back
        # that arrives early there holds memory at the replay's peak. Hold those copies past that
        # moment and plan again; with none to hold, plan for a budget lowered by the overshoot.
        late, resident, moment = _at_replay_peak(schedule, plan, simulation)
        unswapped_there = {t for t in resident if t in by_tensor and t not in chosen and moment is not None
                           and by_tensor[t].near_done_at <= moment < by_tensor[t].returns[-1].needed_at}
        if late or unswapped_there:
            held.update(late)
            forced.update(unswapped_there)
            return last.proposal.budget_bytes
        return last.proposal.budget_bytes - max(simulation.peak_device_bytes - budget_bytes, budget_bytes // 200)

    outcome = plan_until_it_fits(propose, _replayed, budget_bytes, budget_bytes, MAX_REPLANS + 1, next_target)
    kept = outcome.best
    plan, simulation, _, _ = kept.proposal.plan
    return plan, simulation, kept.number - 1


def _replayed(proposal: Proposal) -> Feedback:
    """The judge of an access-order plan: its replay on the simulator."""
    simulation = proposal.plan[1]
    return Feedback(simulation.peak_device_bytes, simulation.step_time_s, measured=False,
                    traffic_bytes=simulation.traffic_bytes)


def schedule_floor(schedule: Schedule, candidates: list[Candidate]) -> int:
    """The most device memory the unswapped schedule holds at one moment with every candidate off
    the device whenever it could be (from its last near read to each copy back's first reader):
    no plan of these candidates peaks lower while the step keeps this order (a replay whose ops wait
    for copies runs in another, and can: plan_access_order plans for both). It counts, as the
    simulator does, an op's new buffers with those its predecessor frees at the same instant."""
    return floor_and_moment(schedule, candidates)[0]


def floor_and_moment(schedule: Schedule, candidates: list[Candidate]) -> tuple[int, float]:
    """`schedule_floor`, and the moment of the schedule it is reached (the first, where several)."""
    usage = list(schedule.usage)
    for candidate in candidates:
        _apply(schedule.times, usage, _off_windows(candidate), -candidate.nbytes)
    if not usage:
        return 0, 0.0
    floor = max(usage)
    return floor, schedule.times[usage.index(floor)]


def held_at_floor(result: SimulationResult, schedule: Schedule, candidates: list[Candidate]
                  ) -> tuple[int, frozenset[str]]:
    """`schedule_floor`, and the buffers it counts at its moment: those of `result` (the unswapped
    replay `schedule` was made from, with its memory events) allocated by then and not yet released
    before it, less the candidates off the device then."""
    floor, moment = floor_and_moment(schedule, candidates)
    allocated, released = set(), set()
    for event in result.memory_events or ():
        if event.time < moment or (event.time == moment and event.nbytes > 0):
            allocated.add(event.buffer)
        if event.nbytes < 0 and event.time < moment:
            released.add(event.buffer)
    off = {c.tensor for c in candidates if any(w.covers(moment) for w in _off_windows(c))}
    return floor, frozenset(allocated - released - off)


def _off_windows(candidate: Candidate) -> list[Window]:
    """When `candidate` could be off the device: from its last near read (or the end of a copy back's
    last reader) to the first reader of each copy back."""
    starts = [candidate.near_done_at] + [r.done_at for r in candidate.returns[:-1]]
    return [Window(start, r.needed_at) for start, r in zip(starts, candidate.returns) if start < r.needed_at]


def _paced(graph: Graph, config: LMSConfig, schedule: Schedule, chosen: list[Candidate], waits: dict[str, float],
           holds: dict[Hold, float], link: LinkRates, skipped: list[Skip], control_edges: list[ControlEdge],
           costs: dict[str, float], budget_bytes: int, paced: dict[str, set[str]]) -> tuple[Plan, SimulationResult]:
    """The plan of the chosen tensors, replayed; while the replay's peak is over the budget because
    copies out have not caught up (a tensor whose readers on the device are done is still there, its
    copy queued behind others), the op allocating at that peak waits for the earliest of those
    copies, enough of them to take the excess away, and the plan is replayed again. Where the step
    produces faster than the link drains (ResNet-50's stem at a large batch), this paces the forward
    pass to the link there and nowhere else; `waits_for` cannot see it, as it works on the unswapped
    schedule's order, which the replay's waits change. `paced` gathers those waits. Waits planned
    on different orders can hold each other up (two branches, each waiting for a copy the other's
    producer makes): the waits a deadlocked replay names are dropped and it is replayed again."""
    dropped: set[tuple[str, str]] = set()  # (tensor, op) waits that deadlocked a replay: never made again

    def replay() -> tuple[Plan, SimulationResult]:
        while True:
            plan = build_plan(graph, config, schedule, chosen, waits, holds, link, skipped, control_edges, paced,
                              dropped)
            try:
                return plan, simulate(graph, plan, costs, link, keep_events=True)
            except SimulationStalled as stall:  # each wait held in the replay it came from, not together
                stuck = {(tensor, op) for tensor, ops in stall.waiting_for_copies_out.items() for op in ops}
                if not stuck:
                    raise
                dropped.update(stuck)

    plan, simulation = replay()
    for _ in range(MAX_PACING):
        if simulation.peak_device_bytes <= budget_bytes or not simulation.memory_events:
            break
        behind = _copies_out_behind(graph, plan, simulation, simulation.peak_device_bytes - budget_bytes)
        if not behind:
            break
        for tensor, waiter in behind.items():
            paced.setdefault(tensor, set()).add(waiter)
        plan, simulation = replay()
    return plan, simulation


def _replay_peak(simulation: SimulationResult) -> tuple[int, dict[str, int]]:
    """The index of the memory event at the replay's peak, and the buffers live then (name -> bytes)."""
    usage, peak, at = 0, -1, 0
    events = simulation.memory_events
    for i, event in enumerate(events):
        usage += event.nbytes
        if usage > peak:
            peak, at = usage, i
    live: dict[str, int] = {}
    for event in events[:at + 1]:
        if event.nbytes > 0:
            live[event.buffer] = event.nbytes
        else:
            live.pop(event.buffer, None)
    return at, live


def _copies_out_behind(graph: Graph, plan: Plan, simulation: SimulationResult, excess: int) -> dict[str, str]:
    """Swapped tensors on the device at the replay's peak only because their copies out are still
    queued (every device reader done by then), earliest copy first, as many as take `excess` bytes
    away: tensor -> the op allocating at the peak, which is to wait for them."""
    events = simulation.memory_events
    if not events:
        return {}
    at, live = _replay_peak(simulation)
    peak_op, peak_start, _ = simulation.executed[events[at].op_index]
    ended = {name: end for name, _, end in simulation.executed}
    released = {event.buffer: event.time for event in events if event.nbytes < 0}
    behind = []
    for swap in plan.swaps:
        if swap.tensor not in live or peak_op in swap.waiters:
            continue
        far = {c for swap_in in swap.swap_ins for c in swap_in.consumers}
        near = {c for c, _ in graph.consumers(swap.tensor) if c not in far}
        producer = swap.tensor.rpartition(":")[0]
        # A zero-time op (a Reshape) ends as it starts: the op at the peak may be the tensor's own
        # producer, which cannot wait for its output's copy out (the replay would stall).
        if producer != peak_op and all(ended.get(op, float("inf")) <= peak_start for op in (producer, *near)):
            behind.append((released.get(swap.tensor, float("inf")), swap.tensor, swap.nbytes))
    waits: dict[str, str] = {}
    for _, tensor, nbytes in sorted(behind):
        if excess <= 0:
            break
        waits[tensor] = peak_op
        excess -= nbytes
    return waits


def _at_replay_peak(schedule: Schedule, plan: Plan, simulation: SimulationResult
                    ) -> tuple[dict[Hold, float], set[str], float | None]:
    """At the replay's peak: the copies back on the device whose readers start after the op running
    then (on the unswapped schedule), each to be held until that op has started; the buffers
    resident then; and that op's start on the unswapped schedule. (The replay's order drifts from the
    unswapped schedule's where readers wait for copies: other branches run meanwhile, and what they
    make lives longer.)"""
    events = simulation.memory_events
    at, live = _replay_peak(simulation) if events else (0, {})
    moment = schedule.start.get(simulation.executed[events[at].op_index][0]) if events else None
    if moment is None:
        return {}, set(live), None
    holds = {}
    for swap in plan.swaps:
        for k, swap_in in enumerate(swap.swap_ins):
            if swap_in.name in live and min(schedule.start[c] for c in swap_in.consumers) > moment:
                holds[(swap.tensor, k)] = schedule.after(moment)
    return holds, set(live), moment


class Schedule:
    """The unswapped step as the simulator ran it: each op's start and end, and device memory over
    time as a step function (one point per instant, at that instant's highest)."""

    def __init__(self, graph: Graph, result: SimulationResult):
        self.graph = graph
        self.start = {name: start for name, start, _ in result.executed}
        self.end = {name: end for name, _, end in result.executed}
        self.position = {name: i for i, (name, _, _) in enumerate(result.executed)}
        events = sorted((e.time, e.phase, e.nbytes, e.op_index) for e in result.memory_events)
        self.times: list[float] = []
        self.usage: list[int] = []
        self.allocating: list[str | None] = []  # the op whose allocation made each point's high, if any
        usage = 0
        for time, _, delta, op_index in events:
            usage += delta
            op = result.executed[op_index][0] if delta > 0 and op_index >= 0 else None
            if self.times and self.times[-1] == time:
                if usage > self.usage[-1]:
                    self.usage[-1], self.allocating[-1] = usage, op or self.allocating[-1]
                continue
            self.times.append(time)
            self.usage.append(usage)
            self.allocating.append(op)
        self._index = {time: i for i, time in enumerate(self.times)}
        self.compute_s = result.compute_time_s
        self.step_s = result.step_time_s
        self.peak = max(self.usage, default=0)

    def op_at(self, moment: float) -> str | None:
        """The op whose allocation makes the memory high at `moment` (a time of the step function)."""
        return self.allocating[self._index[moment]]

    def after(self, moment: float) -> float:
        """The time of the step function's next point after `moment`."""
        i = bisect_right(self.times, moment)
        return self.times[i] if i < len(self.times) else moment + 1e-9


def find_candidates(graph: Graph, config: LMSConfig, schedule: Schedule, link: LinkRates, compute_device: str,
                    data_inputs: frozenset[str]) -> tuple[list[Candidate], list[Skip]]:
    """Every tensor that may be swapped (lms_core.planner's rules), its readers split at its longest
    idle gap before backward-only reads into near and far ones, and the far ones grouped into copies
    back wherever they pause longer than a copy back takes; and the tensors that qualify but may not
    be swapped, with why."""
    candidates, skipped = [], []
    for name in graph.order:
        producer = graph[name]
        if swap_phase(producer, name in data_inputs, config) is None or name not in schedule.end:
            continue
        for index, info in enumerate(producer.outputs):
            tensor = tensor_name(name, index)
            readers = sorted({c for c, _ in graph.consumers(tensor) if graph[c].type not in SHAPE_ONLY_TYPES},
                             key=lambda c: (schedule.start[c], c))
            split = _longest_gap(graph, schedule, schedule.end[name], readers)
            if split is None:
                continue
            far = [graph[c] for c in readers[split:]]
            reason = reason_not_to_swap(producer, info, far, config, compute_device)
            if reason is None and info.nbytes < config.min_tensor_bytes:
                continue
            if reason is not None:
                skipped.append(Skip(tensor, info.nbytes, reason))
                continue
            near_done = max([schedule.end[name]] + [schedule.end[c] for c in readers[:split]])
            copy_back_s = info.nbytes / link.h2d_bytes_per_s
            candidates.append(Candidate(tensor, producer, info.nbytes, schedule.end[name], near_done,
                                        _returns(schedule, readers[split:], copy_back_s), schedule.position[name]))
    return candidates, skipped


def _longest_gap(graph: Graph, schedule: Schedule, produced_at: float, readers: list[str]) -> int | None:
    """The index of the first far reader: the split before which the idle time is longest, with only
    backward readers after it; None when no such split leaves a gap."""
    best, best_gap = None, 0.0
    done = produced_at
    for split, reader in enumerate(readers):
        if all(graph[r].category == BACKWARD for r in readers[split:]):
            gap = schedule.start[reader] - done
            if gap > best_gap:
                best, best_gap = split, gap
        done = max(done, schedule.end[reader])
    return best


def _returns(schedule: Schedule, far: list[str], copy_back_s: float) -> tuple[Return, ...]:
    """The far readers in groups: a new copy back wherever they pause for longer than it takes."""
    groups: list[list[str]] = []
    done = float("-inf")
    for reader in far:
        if groups and schedule.start[reader] - done <= copy_back_s:
            groups[-1].append(reader)
        else:
            groups.append([reader])
        done = max(done, schedule.end[reader])
    return tuple(Return(tuple(group), schedule.start[group[0]], max(schedule.end[r] for r in group))
                 for group in groups)


class Stalls:
    """Where the step waits for copies out: a wait at base time `m` holds the op starting then until
    the copies out of the tensors it waits for are done, and delays everything after it. Times on
    the unswapped schedule ("base") map to times of the step with those waits ("real") and back."""

    def __init__(self, stalls: list[tuple[float, float]] = ()):
        self.moments = [m for m, _ in stalls]
        self.after = []  # total delay of every event at or after each moment
        total = 0.0
        for _, delay in stalls:
            total += delay
            self.after.append(total)

    def real(self, base: float) -> float:
        i = bisect_right(self.moments, base)
        return base + (self.after[i - 1] if i else 0.0)

    def base(self, real: float) -> float:
        """The base time of a real one; a moment inside a wait maps to just before the waiting op."""
        for i, moment in enumerate(self.moments):
            before = self.after[i - 1] if i else 0.0
            if real < moment + before:
                return real - before
            if real < moment + self.after[i]:
                return moment - 1e-12
        return real - (self.after[-1] if self.after else 0.0)

    @property
    def total(self) -> float:
        return self.after[-1] if self.after else 0.0


Hold = tuple[str, int]  # a copy back: (tensor, which return)


def lay_out(chosen: list[Candidate], waits: dict[str, float], link: LinkRates, copy_out: bool = True,
            holds: dict[Hold, float] | None = None) -> tuple[dict[str, Layout], Stalls]:
    """When each chosen tensor is off the device (base times), and the waits the plan makes.

    Copies out run in production order on one queue; a tensor in `waits` must be gone by its moment,
    so the op there waits for its copy. Copies back run on the other queue as late as possible: from
    the last needed to the first, each done by its first reader's start and before the next starts;
    a copy in `holds` may not start before its moment (the budget has no room for it then), and the
    copies queued after it wait for it. Without `copy_out`, copies out take no time (what `cover`
    assumes). Reads delayed by held copies are the replay's to time."""
    stalls: list[tuple[float, float]] = []
    pending: dict[float, float] = {}  # moment -> the latest copy end a wait there needs (real time)
    free, released_real = 0.0, {}
    timeline = Stalls()
    for candidate in sorted(chosen, key=lambda c: c.order):
        for moment in sorted(m for m in pending if m <= candidate.produced_at):  # waits passed: now known
            timeline = _stall(stalls, timeline, moment, pending.pop(moment))
        start = max(free, timeline.real(candidate.produced_at))
        free = start + (candidate.nbytes / link.d2h_bytes_per_s if copy_out else 0.0)
        released_real[candidate.tensor] = max(free, timeline.real(candidate.near_done_at))
        if candidate.tensor in waits:
            moment = waits[candidate.tensor]
            pending[moment] = max(pending.get(moment, 0.0), free)
    for moment in sorted(pending):
        timeline = _stall(stalls, timeline, moment, pending[moment])
    copies = sorted(((c.returns[k].needed_at, c.order, k, c) for c in chosen for k in range(len(c.returns))),
                    key=lambda item: item[:3])
    back_real: dict[Hold, float] = {}
    next_start = float("inf")
    for needed, _, k, candidate in reversed(copies):
        start = min(timeline.real(needed), next_start) - candidate.nbytes / link.h2d_bytes_per_s
        back_real[(candidate.tensor, k)] = start
        next_start = start
    if holds:
        queue_free = float("-inf")
        for _, _, k, candidate in copies:
            key = (candidate.tensor, k)
            start = max(back_real[key], timeline.real(holds.get(key, float("-inf"))), queue_free)
            back_real[key] = start
            queue_free = start + candidate.nbytes / link.h2d_bytes_per_s
    layout = {c.tensor: Layout(timeline.base(released_real[c.tensor]),
                               tuple(timeline.base(back_real[(c.tensor, k)]) for k in range(len(c.returns))))
              for c in chosen}
    return layout, timeline


def _stall(stalls: list[tuple[float, float]], timeline: Stalls, moment: float, copy_end: float) -> Stalls:
    delay = max(0.0, copy_end - timeline.real(moment))
    if delay <= 0:
        return timeline
    stalls.append((moment, delay))
    return Stalls(stalls)


def choose(schedule: Schedule, candidates: list[Candidate], link: LinkRates, budget_bytes: int,
           held: dict[Hold, float] | None = None, include: list[Candidate] = ()
           ) -> tuple[list[Candidate], dict[str, float], dict[Hold, float], bool]:
    """Tensors to swap (`include` among them), the moments some of them must be gone by (the op
    there waits for their copies out), those some copies back must wait for (`held` to start with),
    and whether the budget could be met at every moment: `cover`, then `waits_for`."""
    chosen, holds, met = cover(schedule, candidates, link, budget_bytes, held, include)
    return chosen, waits_for(schedule, chosen, link, budget_bytes, holds), holds, met


def cover(schedule: Schedule, candidates: list[Candidate], link: LinkRates, budget_bytes: int,
          held: dict[Hold, float] | None = None, include: list[Candidate] = ()
          ) -> tuple[list[Candidate], dict[Hold, float], bool]:
    """Tensors whose time off the device covers every moment the unswapped step is over the budget,
    moving as few bytes as the greedy finds, and the moments some copies back must wait for. A
    tensor is off from its last near read (the copy out's pace is `waits_for`'s concern) to its
    copy back, scheduled as late as the link allows and, where that brings it back into a moment
    over the budget, held until that moment has passed. The flag says whether every moment could be
    brought within the budget (not where nothing can be off the device: the floor there).

    At the moment of the largest excess it takes a tensor off the device then, one whose windows
    cover most of the time spent over the budget and whose bytes that moment needs (a tensor larger
    than the excess there moves bytes no moment needs)."""
    times, usage = schedule.times, list(schedule.usage)
    durations = [later - earlier for earlier, later in zip(times, times[1:])] + [0.0]
    chosen: list[Candidate] = list(include)
    holds: dict[Hold, float] = dict(held or {})
    layout, _ = lay_out(chosen, {}, link, copy_out=False, holds=holds)
    for candidate in chosen:
        _apply(times, usage, layout[candidate.tensor].windows(candidate), -candidate.nbytes)
    left = [c for c in candidates if c not in chosen]
    stuck: set[int] = set()  # moments nothing can be taken off at: the floor there, or the link's pace
    while True:
        over = [u - budget_bytes for u in usage]
        worst = max((i for i in range(len(over)) if i not in stuck), key=over.__getitem__, default=None)
        if worst is None or over[worst] <= 0:
            break
        excess = over[worst]
        moment = times[worst]
        hot = [0.0]  # time spent over the budget before each point
        for duration, above in zip(durations, over):
            hot.append(hot[-1] + (duration if above > 0 else 0.0))
        best, best_hold = _best_cover(schedule, left, _BackQueue(chosen, layout, link), moment, hot, excess)
        early = None
        if best is None:
            # The queue brings a chosen tensor back before this moment for reads after it: hold that
            # copy until the moment has passed (its readers may then wait for it).
            early = max(((c, k) for c in chosen for k, r in enumerate(c.returns)
                         if layout[c.tensor].backs[k] <= moment < r.needed_at), key=lambda ck: (
                            ck[0].returns[ck[1]].needed_at, ck[0].nbytes), default=None)
            if early is None:
                stuck.add(worst)  # nothing can be off the device at that moment: go on with the others
                continue
        if best is not None:
            chosen.append(best)
            left.remove(best)
            if best_hold is not None:
                holds[(best.tensor, best_hold)] = schedule.after(moment)
        else:
            holds[(early[0].tensor, early[1])] = schedule.after(moment)
        before, (layout, _) = layout, lay_out(chosen, {}, link, copy_out=False, holds=holds)
        for candidate in chosen:  # a new copy moves others on the queues: apply what changed
            old = before[candidate.tensor] if candidate.tensor in before else None
            if old != layout[candidate.tensor]:
                if old is not None:
                    _apply(times, usage, old.windows(candidate), +candidate.nbytes)
                _apply(times, usage, layout[candidate.tensor].windows(candidate), -candidate.nbytes)
    return chosen, holds, not stuck


def _best_cover(schedule: Schedule, left: list[Candidate], queue: "_BackQueue", moment: float, hot: list[float],
                excess: int) -> tuple[Candidate | None, int | None]:
    """`cover`'s choice at `moment`: among the tensors not chosen yet that can be off the device then,
    one that needs no hold first (its reads need not wait), then the one taking the most excess away
    over the time spent over the budget (`hot`: that time before each point of the schedule); with
    the return it must hold past the moment, if any."""
    times = schedule.times
    best, best_key, best_hold = None, None, None
    for candidate in left:
        if not candidate.near_done_at <= moment < candidate.returns[-1].needed_at:
            continue
        starts = queue.starts_of(candidate)
        # A copy back that would start before the moment for reads after it is held past it.
        hold = next((k for k, (start, r) in enumerate(zip(starts, candidate.returns))
                     if start <= moment < r.needed_at), None)
        if hold is not None:
            starts = starts[:hold] + (schedule.after(moment),) + starts[hold + 1:]
        windows = Layout(candidate.near_done_at, starts).windows(candidate)
        if not any(window.covers(moment) for window in windows):
            continue
        coverage = sum(hot[bisect_left(times, w.end)] - hot[bisect_left(times, w.start)] for w in windows)
        key = (hold is None, coverage * min(candidate.nbytes, excess) / candidate.nbytes, candidate.nbytes)
        if best_key is None or key > best_key:
            best, best_key, best_hold = candidate, key, hold
    return best, best_hold


class _BackQueue:
    """The host-to-device queue as the chosen tensors use it (as late as possible), to place one more
    tensor's copies back on it: each done by its first reader's start and before the chosen copies
    needed after it begin. (Its own effect on the others is worked out once it is chosen.)"""

    def __init__(self, chosen: list[Candidate], layout: dict[str, Layout], link: LinkRates):
        self.link = link
        copies = sorted(((c.returns[k].needed_at, c.order, k, layout[c.tensor].backs[k])
                         for c in chosen for k in range(len(c.returns))), key=lambda item: item[:3])
        self.keys = [item[:3] for item in copies]
        self.starts = [item[3] for item in copies]

    def starts_of(self, candidate: Candidate) -> tuple[float, ...]:
        starts = []
        for k, copy in enumerate(candidate.returns):
            after = bisect_right(self.keys, (copy.needed_at, candidate.order, k))
            next_start = self.starts[after] if after < len(self.starts) else float("inf")
            starts.append(min(copy.needed_at, next_start) - candidate.nbytes / self.link.h2d_bytes_per_s)
        return tuple(starts)


def waits_for(schedule: Schedule, chosen: list[Candidate], link: LinkRates, budget_bytes: int,
              holds: dict[Hold, float]) -> dict[str, float]:
    """Where the step must wait for copies out: going through the schedule in time, at each moment
    still over the budget, the fewest chosen tensors (in the order the queue finishes them) whose
    copies out must be done before the op there allocates; each gets that moment. Waiting at the
    first such moment also lets later copies finish sooner, so later moments need shorter waits."""
    waits: dict[str, float] = {}
    times = schedule.times

    def remaining(layout: dict[str, Layout]) -> list[int]:
        usage = list(schedule.usage)
        for candidate in chosen:
            _apply(times, usage, layout[candidate.tensor].windows(candidate), -candidate.nbytes)
        return usage

    layout, _ = lay_out(chosen, waits, link, holds=holds)
    usage = remaining(layout)
    for i, moment in enumerate(times):
        excess = usage[i] - budget_bytes
        if excess <= 0:
            continue
        late = [c for c in chosen if c.near_done_at <= moment < layout[c.tensor].backs[0]
                and layout[c.tensor].released_at > moment]
        if not late:
            continue
        late.sort(key=lambda c: (layout[c.tensor].released_at, c.order))
        for candidate in late:
            waits[candidate.tensor] = moment
            excess -= candidate.nbytes
            if excess <= 0:
                break
        layout, _ = lay_out(chosen, waits, link, holds=holds)
        usage = remaining(layout)
    return waits


def _apply(times: list[float], usage: list[int], windows: list[Window], delta: int) -> None:
    for window in windows:
        for i in range(bisect_left(times, window.start), bisect_left(times, window.end)):
            usage[i] += delta


def build_plan(graph: Graph, config: LMSConfig, schedule: Schedule, chosen: list[Candidate], waits: dict[str, float],
               holds: dict[Hold, float], link: LinkRates, skipped: list[Skip], control_edges: list[ControlEdge],
               paced: dict[str, set[str]] | None = None, dropped: set[tuple[str, str]] = frozenset()) -> Plan:
    """The chosen tensors as plan entries: one swap-in per return, triggered by the latest backward
    ancestor of its first reader that ends before the copy back should start; a tensor that must be
    gone by a moment has the op allocating then as its waiter (sync mode 1's mechanism), and so do
    the ops `paced` names for theirs, but for the (tensor, op) waits in `dropped`."""
    latest = latest_backward_inputs(graph)
    layout, _ = lay_out(chosen, waits, link, holds=holds)
    swaps, not_made = [], list(skipped)
    for candidate in sorted(chosen, key=lambda c: c.order):
        name, index = candidate.producer.name, int(candidate.tensor.rpartition(":")[2])
        swap_ins = []
        for k, copy in enumerate(candidate.returns):
            first = graph[copy.readers[0]]
            trigger = _trigger(graph, schedule, latest, first, layout[candidate.tensor].backs[k])
            if trigger is None or schedule.end[trigger.name] < candidate.near_done_at:
                break
            swap_ins.append(SwapIn(name=f"lms/swapin_{name}_{index}_{k}", trigger=trigger.name,
                                   trigger_level=trigger.level, consumers=list(copy.readers),
                                   consumer_levels=[graph[c].level for c in copy.readers]))
        if len(swap_ins) < len(candidate.returns):
            not_made.append(Skip(candidate.tensor, candidate.nbytes, (
                f"no backward op before {candidate.returns[len(swap_ins)].readers[0]} runs after its near readers "
                f"to start a copy back")))
            continue
        info = candidate.producer.outputs[index]
        waiter = schedule.op_at(waits[candidate.tensor]) if candidate.tensor in waits else None
        # Never the producer itself: a zero-time producer (a Reshape) can be the op at the moment the
        # tensor must be gone, and waiting for its own output's copy out would stall the step.
        waiters = sorted(op for op in ({waiter} - {None} | (paced or {}).get(candidate.tensor, set())) - {name}
                         if (candidate.tensor, op) not in dropped)
        swaps.append(Swap(tensor=candidate.tensor, producer_type=candidate.producer.type, shape=list(info.shape),
                          dtype=info.dtype, nbytes=candidate.nbytes, producer_level=candidate.producer.level,
                          swap_out=f"lms/swapout_{name}_{index}", swap_ins=swap_ins,
                          waiters=waiters,
                          tensor_list=None if info.tensor_list is None else list_record(info.tensor_list)))
    settings = dict(config.settings(), strategy="access-order", sync_mode=1 if any(s.waiters for s in swaps) else 0)
    return Plan(settings=settings, swaps=swaps, skipped=not_made, control_edges=list(control_edges), ops=len(graph),
                levels=1 + max((op.level for op in graph.ops.values()), default=-1))


def _trigger(graph: Graph, schedule: Schedule, latest: dict[str, str | None], reader: Op, start_by: float) -> Op | None:
    """Walks back from `reader` along its latest backward inputs to the first op that ends by
    `start_by` (the op after which the copy back should start). Where every op on that chain ends
    later, the one that ends first: the copy starts late and the reader may wait for it, but the
    tensor is still off the device until then (dropping it would break the budget it was chosen for)."""
    current, earliest = latest[reader.name], None
    while current is not None and schedule.end.get(current, float("inf")) > start_by:
        earliest = current
        current = latest[current]
    current = current if current is not None else earliest
    return None if current is None else graph[current]


def lower_bound_s(schedule: Schedule, link: LinkRates, budget_bytes: int, relief: "Relief | None" = None
                  ) -> tuple[float, int]:
    """(seconds, bytes): no plan that keeps the step's order makes it faster than this, and the
    budget forces at least these bytes off the device at the unswapped peak.

    At any moment m over the budget, forced(m) = (usage(m) - budget) bytes must be off the device:
    all were made before m and are read after it. Swapped, their copies out end before m and their
    copies back start after it, each on a queue of the link's rate. So with swaps alone the step
    takes at least
        max(compute before m, forced(m) / D2H) + max(compute from m, forced(m) / H2D),
    at every such moment, and never less than its compute. (The unswapped step runs its compute
    without a gap, so the compute before m is m.)

    With `relief` (lms_core.recompute.Relief: recompute allowed too), r of those bytes may instead
    be made again after m, at a compute cost of at least cost(r) (the cheapest idle bytes' producers'
    time: Relief.least), and only the rest cross the link: the bound at m is the least over r of
        max(compute before m, (forced(m) - r) / D2H) + max(compute from m + cost(r), (forced(m) - r) / H2D),
    a bound over both actions, never above the swaps' alone."""
    bound = schedule.compute_s
    for moment, usage in zip(schedule.times, schedule.usage):
        forced = usage - budget_bytes
        if forced <= 0:
            continue
        before = min(moment, schedule.compute_s)

        def step_s(recomputed: float, cost_s: float = 0.0) -> float:
            left = forced - recomputed
            return (max(before, left / link.d2h_bytes_per_s)
                    + max(schedule.compute_s - before + cost_s, left / link.h2d_bytes_per_s))

        at_moment = step_s(0.0)
        if at_moment > bound and relief is not None:  # only a moment that raises the bound is worth the search
            at_moment = relief.least(moment, forced, step_s)
        bound = max(bound, at_moment)
    return bound, max(0, schedule.peak - budget_bytes)


@dataclass(frozen=True)
class ZeroOverheadPoint:
    """The lowest device budget the access-order planner meets with a predicted step at most
    `tolerance` slower than without swapping (Zhang et al.'s "no communication overhead" saving)."""

    budget_bytes: int  # the device peak of that plan; the unswapped peak where no saving is free
    unswapped_bytes: int
    bound_bytes: int  # no plan in the step's order peaks lower without a slower step (lowest_free_budget)
    step_time_s: float
    unswapped_step_s: float
    swaps: int
    tolerance: float

    @property
    def saving(self) -> float:
        """The share of the unswapped peak the plan saves."""
        return 1 - self.budget_bytes / self.unswapped_bytes if self.unswapped_bytes else 0.0

    def describe(self) -> str:
        from lms_core.units import format_bytes

        return (f"zero-overhead point: {format_bytes(self.budget_bytes)} on the device, {self.saving:.1%} less than "
                f"{format_bytes(self.unswapped_bytes)} without swapping, {self.swaps} tensor(s) swapped, step "
                f"{self.step_time_s * 1000:.0f} ms ({self.step_time_s / self.unswapped_step_s - 1:+.1%}; at most "
                f"{self.tolerance:+.0%} allowed); no plan saves more than "
                f"{1 - self.bound_bytes / self.unswapped_bytes:.1%} for free on this link")


def zero_overhead_point(graph: Graph, config: LMSConfig, costs: dict[str, float], link: LinkRates,
                        compute_device: str = "", data_inputs: frozenset[str] = frozenset(),
                        control_edges: list[ControlEdge] = (), tolerance: float = 0.01,
                        resolution_bytes: int = 1 << 20) -> ZeroOverheadPoint:
    """Bisects the device budget between this schedule's floor and the unswapped peak for the lowest
    one whose access-order plan fits with a step within `tolerance` of the unswapped step, to
    `resolution_bytes` (or 1/256 of the peak, if coarser). A plan's peak, not the budget asked for,
    is the answer: it is what the device must hold."""
    unswapped = simulate(graph, Plan(settings=config.settings()), costs, link, keep_events=True)
    schedule = Schedule(graph, unswapped)
    candidates, _ = find_candidates(graph, config, schedule, link, compute_device, data_inputs)
    limit = unswapped.step_time_s * (1 + tolerance)
    bound = max(lowest_free_budget(schedule, link), schedule_floor(schedule, candidates))
    best = ZeroOverheadPoint(unswapped.peak_device_bytes, unswapped.peak_device_bytes, bound, unswapped.step_time_s,
                             unswapped.step_time_s, 0, tolerance)

    def free_at(budget: int) -> bool:
        nonlocal best
        result = plan_access_order(graph, config, costs, link, budget, compute_device, data_inputs, control_edges,
                                   unswapped=unswapped)
        simulation = result.simulation
        if not result.fits or simulation.step_time_s > limit:
            return False
        if simulation.peak_device_bytes < best.budget_bytes:
            best = ZeroOverheadPoint(simulation.peak_device_bytes, unswapped.peak_device_bytes, bound,
                                     simulation.step_time_s, unswapped.step_time_s, len(result.plan.swaps), tolerance)
        return True

    resolution = max(resolution_bytes, unswapped.peak_device_bytes // 256)
    low, high = bound, unswapped.peak_device_bytes
    if free_at(low):
        return best
    while high - low > resolution:  # `low` is not free; `high` is (the unswapped step itself)
        middle = (low + high) // 2
        if free_at(middle):
            high = middle
        else:
            low = middle
    return best


def lowest_free_budget(schedule: Schedule, link: LinkRates) -> int:
    """The lowest device budget whose lower bound (lower_bound_s) is the unswapped compute: at every
    moment m, no more bytes can be off the device without slowing the step than the link moves out
    before m (m x D2H) and back after it ((compute - m) x H2D)."""
    lowest = 0
    for moment, usage in zip(schedule.times, schedule.usage):
        lowest = max(lowest, usage - int(link_carry(schedule, moment, link)))
    return lowest


def link_carry(schedule: Schedule, moment: float, link: LinkRates) -> float:
    """The most bytes swaps can have off the device at `moment` of the unswapped step without slowing
    it: what the link moves out before then (m x D2H) and back after it ((compute - m) x H2D)."""
    before = min(moment, schedule.compute_s)
    return min(before * link.d2h_bytes_per_s, (schedule.compute_s - before) * link.h2d_bytes_per_s)
