"""Replays a planned step on a model of one GPU: a compute stream, a D2H and an H2D copy queue.

Ops run on the compute stream one at a time, each for its cost (lms_core.costs): whichever is ready
first (all inputs produced, swap-ins arrived), ties broken by the categorized order (level, then
graph order). That is how TensorFlow's executor and Grappler's FirstReady scheduler pick work, so a
consumer waiting for a copy does not hold up ops that could run meanwhile.
Device memory follows reference counts: a tensor is resident from its producer's start to the end of
its last device reader. For a swapped tensor the swap-out's copy is one such reader, so the device
buffer is released only when the copy to the host has finished, and, unless an op waits for that
copy (sync_mode 1 or 3), only when the host next waits for the GPU after that (see HOST_RUNS_AHEAD).
A swap-in's copy starts when its trigger has run, the tensor has reached the host and the H2D queue
is free; its buffer is resident from the copy's start until its last consumer ends, and a consumer
whose swap-in has not arrived stalls the stream. Copies take bytes / link rate; with an infinite link
they take no time, as in Grappler's model, and the two estimates can be compared (for plans whose
copies out are waited for: Grappler counts a swapped tensor gone as its readers end, which the
executor does not see otherwise).

Predicts peak device and host memory, step time, stall time, the share of transfer time hidden behind
compute, and device memory per level; on request (`keep_events`), every device allocation and release
in the order applied, for lms_core.memory (buffer lifetimes, allocator and pool models).
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

from lms_core.add_chains import with_add_chains
from lms_core.graph import Graph, once_per_graph, order_positions, split_tensor
from lms_core.link import LinkRates
from lms_core.plan import Plan
from lms_core.reserved_lists import with_reserved_lists

# Memory events at one instant are applied in this order. Buffers an op allocates as it starts
# count together with those freed as its predecessor ends (Grappler's trace does the same), except
# for an op that started the instant a copy it waited for arrived (a copy is an op of its own), and
# for a copy back's buffer, allocated once its trigger has ended and freed what it read.
# A buffer allocated after a copy and released at that same instant (a chain of ops that take no
# time) is released after its allocation, not before: FREE_AFTER_COPY.
ALLOC, FREE, ALLOC_AFTER_COPY, FREE_AFTER_COPY = 0, 1, 2, 3


# TensorFlow's executor runs ahead of the GPU: it launches kernels and allocates their outputs as
# soon as their inputs' kernels are launched, and waits for the GPU only where an op needs a copy's
# result (a swap-in's consumer, or an op that waits for a swap-out). A swapped tensor's device buffer is
# returned when its copy to the host completes, but the executor sees that only at its next wait, by
# which time it has allocated for every op launched meanwhile: in a forward pass where nothing waits,
# for all of it. So a copy out that no op waits for frees its buffer, as far as the allocator's peak
# goes, at the first of those waits after the copy ends. Measured on an H100 (2026-11-27,
# benchmarks/results/gpu-lms-swap-outs.txt): ResNet-50 at batch 256 with 241 tensors swapped, the peak
# was 20.48 GiB with no copy waited for (21.10 without LMS) and 4.29 GiB with every copy waited for.
HOST_RUNS_AHEAD = True


class SimulationStalled(ValueError):
    """The plan deadlocks: ops wait for a swap-in whose trigger never runs (`parked`: swap-in ->
    waiting ops) or for the copy out of a tensor that is never produced (`waiting_for_copies_out`:
    tensor -> waiting ops), each held up, directly or not, by the other."""

    def __init__(self, never_ran: int, parked: dict[str, list[str]], waiting_for_copies_out: dict[str, list[str]]):
        super().__init__(f"simulation stalled: {never_ran} op(s) never ran (a swap-in whose trigger never runs: "
                         f"{sorted(parked)[:3]}; a copy out of a tensor never produced: "
                         f"{sorted(waiting_for_copies_out)[:3]})")
        self.parked = parked
        self.waiting_for_copies_out = waiting_for_copies_out


@dataclass(frozen=True)
class MemoryEvent:
    """One change of device memory, as the simulator applies it (sorted by time, then phase)."""

    time: float
    phase: int  # ALLOC, FREE, ALLOC_AFTER_COPY or FREE_AFTER_COPY: the order of events at one instant
    nbytes: int  # > 0 allocated, < 0 released
    buffer: str  # a tensor ("op:index") or a swap-in (its copy back's device buffer)
    op_index: int  # in `SimulationResult.executed`: the op the replay was running when it recorded the
    # event (the producer; the last reader that released it; for a copy, the op that started it)


@dataclass
class SimulationResult:
    peak_device_bytes: int
    peak_host_bytes: int
    step_time_s: float
    compute_time_s: float
    stall_time_s: float
    transfer_time_s: float  # D2H + H2D copy time, summed
    hidden_share: float  # share of transfer time overlapped with compute (1.0: fully hidden)
    swapped_bytes: int
    traffic_bytes: int  # moved over the link: each swap out, and each copy back
    forward_time_s: float  # when the loss was computed
    device_by_level: list[tuple[int, int]] = field(default_factory=list)  # (level, max device bytes); with keep_timeline
    d2h_busy: list[tuple[float, float]] = field(default_factory=list)  # copy intervals (start, end)
    h2d_busy: list[tuple[float, float]] = field(default_factory=list)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (time, device bytes) after each change
    resident_at_peak: list[tuple[str, int]] = field(default_factory=list)  # the largest buffers at the peak
    # With keep_events: the ops in the order they ran, (op, start, end), and the device memory events.
    executed: list[tuple[str, float, float]] | None = None
    memory_events: list[MemoryEvent] | None = None


class CopyQueue:
    """One direction of the link: copies run one after another at the link's rate."""

    def __init__(self, bytes_per_s: float):
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0
        self.busy: list[tuple[float, float]] = []

    def copy(self, ready: float, nbytes: int) -> tuple[float, float]:
        """(start, end) of a copy that may start at `ready`, behind the copies already queued."""
        start = max(ready, self.free_at)
        end = start + (0.0 if self.bytes_per_s == float("inf") else nbytes / self.bytes_per_s)
        self.free_at = end
        self.busy.append((start, end))
        return start, end


@dataclass(frozen=True)
class StepStructure:
    """What the simulator needs of a graph whatever the plan (`step_structure` builds it once per
    graph, because the auto-tuner simulates the same graph dozens of times)."""

    position: dict[str, int]  # op -> index in the topological order (the last tie-break)
    predecessor_count: dict[str, int]  # op -> distinct ops it waits for
    successors: dict[str, tuple[str, ...]]  # op -> distinct ops that wait for it
    outputs: dict[str, tuple[tuple[str, int], ...]]  # op -> its output tensors and their bytes
    readers: dict[str, frozenset[str]]  # tensor -> ops reading it
    inputs: dict[str, tuple[str, ...]]  # op -> distinct input tensors
    loss_ops: frozenset[str]  # the producers the step's outputs read: the forward pass ends with them


@once_per_graph
def step_structure(graph: Graph) -> StepStructure:
    outputs, readers = {}, {}
    for name in graph.order:
        tensors = tuple((f"{name}:{i}", info.nbytes or 0) for i, info in enumerate(graph[name].outputs))
        outputs[name] = tensors
        for tensor, _ in tensors:
            readers[tensor] = frozenset(c for c, _ in graph.consumers(tensor))
    # The output ops themselves wait, through control edges, for the whole step.
    loss_ops = frozenset(split_tensor(t)[0] for out in graph.outputs for t in graph[split_tensor(out)[0]].inputs)
    return StepStructure(
        position=order_positions(graph),
        predecessor_count={name: len(set(graph.predecessors(graph[name])) & graph.ops.keys()) for name in graph.order},
        successors={name: tuple(dict.fromkeys(graph.successors(name))) for name in graph.order},
        outputs=outputs, readers=readers,
        inputs={name: tuple(dict.fromkeys(graph[name].inputs)) for name in graph.order},
        loss_ops=loss_ops)


@dataclass
class PlanRoutes:
    """What the plan changes on the device: which reads go to a swap-in, which ops start copies, and
    which wait for one (the sync modes)."""

    reroute: dict[tuple[str, str], str] = field(default_factory=dict)  # (consumer, tensor) -> swap-in
    swap_of: dict[str, object] = field(default_factory=dict)  # swapped tensor -> its Swap
    swap_in_of: dict[str, object] = field(default_factory=dict)  # swap-in name -> its Swap
    triggers: dict[str, list[str]] = field(default_factory=dict)  # op -> swap-ins it starts
    waiters_out: dict[str, list[str]] = field(default_factory=dict)  # op -> tensors whose swap-outs it waits for
    waiters_in: dict[str, list[str]] = field(default_factory=dict)  # op -> swap-ins it waits for


def plan_routes(plan: Plan) -> PlanRoutes:
    sync = plan.settings.get("sync_mode", 0)
    routes = PlanRoutes()
    for swap in plan.swaps:
        routes.swap_of[swap.tensor] = swap
        for swap_in in swap.swap_ins:
            routes.swap_in_of[swap_in.name] = swap
            routes.triggers.setdefault(swap_in.trigger, []).append(swap_in.name)
            for consumer in swap_in.consumers:
                routes.reroute[(consumer, swap.tensor)] = swap_in.name
            if sync in (2, 3):
                for waiter in swap_in.waiters:
                    routes.waiters_in.setdefault(waiter, []).append(swap_in.name)
        if sync in (1, 3):
            for waiter in swap.waiters:
                routes.waiters_out.setdefault(waiter, []).append(swap.tensor)
    return routes


def simulate(graph: Graph, plan: Plan, costs: dict[str, float], link: LinkRates, persistent_bytes: int = 0,
             keep_timeline: bool = False, keep_events: bool = False) -> SimulationResult:
    """`graph` carries `category` and `level`; `plan` may have no swaps (the baseline).
    `persistent_bytes` is memory held throughout that no tensor of the graph stands for; variables
    need none, since the `ReadVariableOp` tensors that read them are counted, as Grappler does.
    `keep_events` fills `executed` and `memory_events`; `keep_timeline`, `timeline` and `device_by_level`. A plan's AddN chains (lms_core.add_chains)
    are replayed as their adds, and its unset zero lists (lms_core.reserved_lists) as filled by their
    loops; on a graph already rewritten with them, as it is."""
    graph = with_reserved_lists(with_add_chains(graph, plan.add_chains), plan.reserved_lists)
    replay = _Replay(graph, plan, costs, link)
    replay.run()
    result = replay.result(persistent_bytes, keep_timeline)
    if keep_events:
        result.executed = list(replay.executed)
        result.memory_events = [MemoryEvent(time, phase, delta, buffer, op_index) for (time, phase, delta, buffer), op_index
                                in sorted(zip(replay.events, replay.event_ops))]
    return result


class _Replay:
    """One replay of the step: the compute stream runs ops in ready order; copies run on the queues."""

    def __init__(self, graph: Graph, plan: Plan, costs: dict[str, float], link: LinkRates):
        self.graph, self.plan, self.costs = graph, plan, costs
        self.structure = step_structure(graph)
        self.routes = plan_routes(plan)
        self.refs, self.nbytes = self._device_readers()
        self.last_end: dict[str, float] = {}
        self.events: list[tuple[float, int, int, str]] = []  # (time, phase, device delta, buffer)
        self.allocated_at: dict[str, tuple[float, int]] = {}  # buffer -> (time, phase) of its allocation
        self.event_ops: list[int] = []  # for each event, the index in `executed` of the op that recorded it
        self.waited_out = {t for tensors in self.routes.waiters_out.values() for t in tensors}
        self.unwaited_out: list[tuple[float, str]] = []  # (copy end, tensor) of copies out no op waits for
        self.host_waits: list[float] = []  # when the executor resumed after waiting for a copy
        self.executed: list[tuple[str, float, float]] = []  # (op, start, end) in the order run
        self.host_events: list[tuple[float, int, int, str]] = []
        self.end: dict[str, float] = {}
        self.swapped_out_at: dict[str, float] = {}
        self.arrival: dict[str, float] = {}
        self.host_refs = {s.tensor: len(s.swap_ins) for s in plan.swaps}  # swap-ins still to copy each back
        self.d2h, self.h2d = CopyQueue(link.d2h_bytes_per_s), CopyQueue(link.h2d_bytes_per_s)
        self.stream = self.stall = self.compute = 0.0
        self.forward_end: float | None = None
        self.op_end_times: list[tuple[float, int]] = []
        self.parked: dict[str, list[str]] = {}  # swap-in not started yet -> ops that need it
        self.parked_out: dict[str, list[str]] = {}  # tensor not produced yet -> ops waiting for its swap-out
        self.deferred: dict[str, list[tuple[str, float]]] = {}  # tensor not yet on the host -> (swap-in, trigger end)
        self.pending = dict(self.structure.predecessor_count)
        self.ready_at = {name: 0.0 for name in graph.order}
        self.queue: list[tuple[float, int, int, int, str]] = []

    def _device_readers(self) -> tuple[dict[str, int], dict[str, int]]:
        """Readers still to run of every device buffer, and its bytes, once the plan is applied: a
        swapped tensor's far readers read a swap-in instead, and its swap-out's copy reads it too."""
        refs, nbytes = {}, {}
        reroute, swap_of = self.routes.reroute, self.routes.swap_of
        for name in self.graph.order:
            for tensor, size in self.structure.outputs[name]:
                nbytes[tensor] = size
                readers = self.structure.readers[tensor]
                if tensor in swap_of:
                    readers = {c for c in readers if (c, tensor) not in reroute}
                refs[tensor] = len(readers) + (1 if tensor in swap_of else 0)
        for swap in self.plan.swaps:
            for swap_in in swap.swap_ins:
                refs[swap_in.name] = len(set(swap_in.consumers))
                nbytes[swap_in.name] = swap.nbytes
        return refs, nbytes

    def run(self) -> None:
        graph, position = self.graph, self.structure.position
        self.queue = [(0.0, 0, graph[n].level, position[n], n) for n, count in self.pending.items() if count == 0]
        heapq.heapify(self.queue)
        while self.queue:
            ready, after_copy, _, _, name = heapq.heappop(self.queue)
            finish = self._compute(name, ready, after_copy)
            self._swap_out(name, finish)
            self._swap_in(name, finish)
            self._wake_successors(name, finish)
        if self.parked or self.parked_out or self.deferred or len(self.end) != len(graph.order):
            raise SimulationStalled(len(graph.order) - len(self.end), dict(self.parked), dict(self.parked_out))
        self._release_unwaited_copies_out()

    def _release_unwaited_copies_out(self) -> None:
        """Each copy out that no op waits for frees its buffer at the executor's first wait for the
        GPU after the copy ends, or when the step ends (HOST_RUNS_AHEAD)."""
        waits = sorted(self.host_waits)
        step_end = max(self.stream, self.d2h.free_at, self.h2d.free_at)
        starts = [start for _, start, _ in self.executed]
        for copy_end, tensor in self.unwaited_out:
            i = bisect.bisect_left(waits, copy_end)
            at = waits[i] if i < len(waits) else max(step_end, copy_end)
            self._release(tensor, at, op_index=max(0, bisect.bisect_right(starts, at) - 1))

    def _enqueue(self, name: str) -> None:
        """Queue an op whose inputs are produced, at the time its swap-ins arrive and the waits of
        the sync mode are met. A consumer whose swap-in has not been started (its trigger is an
        ancestor of the group's first consumer only) is parked until the trigger runs."""
        routes = self.routes
        needs = [routes.reroute[(name, t)] for t in self.structure.inputs[name] if (name, t) in routes.reroute]
        needs += routes.waiters_in.get(name, [])
        missing = next((s for s in needs if s not in self.arrival), None)
        if missing is not None:
            self.parked.setdefault(missing, []).append(name)
            return
        outs = routes.waiters_out.get(name, [])
        unproduced = next((t for t in outs if t not in self.swapped_out_at), None)
        if unproduced is not None:  # waits for the copy out of a tensor whose producer has not run yet
            self.parked_out.setdefault(unproduced, []).append(name)
            return
        copies = [self.arrival[s] for s in needs] + [self.swapped_out_at[t] for t in outs]
        copied_at = max(copies, default=-1.0)
        if copies:  # the executor waits for the GPU here, and sees the copies out that have ended
            self.host_waits.append(max(self.ready_at[name], copied_at))
        # A copy ends after the op that started it, however fast the link: an op whose last wait is
        # a copy queues behind the ops that became ready at the same instant without one, and its
        # buffers are allocated after that instant's frees. With an infinite link this is the limit
        # of ever faster links, and Grappler's order, where the swap-in is an op of its own.
        after_copy = 1 if copied_at >= self.ready_at[name] else 0
        heapq.heappush(self.queue, (max(self.ready_at[name], copied_at), after_copy, self.graph[name].level,
                                    self.structure.position[name], name))

    def _event(self, time: float, phase: int, delta: int, buffer: str, op_index: int | None = None) -> None:
        if delta > 0:
            self.allocated_at[buffer] = (time, phase)
        elif phase == FREE and self.allocated_at.get(buffer) == (time, ALLOC_AFTER_COPY):
            phase = FREE_AFTER_COPY
        self.events.append((time, phase, delta, buffer))
        # the op being run (appended as it starts), or the one running at `time` for a release decided later
        self.event_ops.append(len(self.executed) - 1 if op_index is None else op_index)

    def _release(self, buffer: str, at: float, op_index: int | None = None) -> None:
        self.last_end[buffer] = max(self.last_end.get(buffer, 0.0), at)
        self.refs[buffer] -= 1
        if self.refs[buffer] == 0 and self.nbytes[buffer]:
            self._event(self.last_end[buffer], FREE, -self.nbytes[buffer], buffer, op_index)

    def _compute(self, name: str, ready: float, after_copy: int) -> float:
        """Runs `name` on the compute stream: its outputs are allocated as it starts, the inputs it
        read last are freed as it ends. Returns when it ends."""
        start = max(self.stream, ready)
        self.stall += start - self.stream  # the stream idles only while waiting for a copy
        cost = self.costs.get(name, 0.0)
        finish = start + cost
        self.executed.append((name, start, finish))
        self.stream = finish
        self.compute += cost
        self.end[name] = finish
        if name in self.structure.loss_ops:  # the forward pass ends when the loss is computed
            self.forward_end = finish if self.forward_end is None else max(self.forward_end, finish)
        for tensor, size in self.structure.outputs[name]:
            if size:
                self._event(start, ALLOC_AFTER_COPY if after_copy and start == ready else ALLOC, size, tensor)
                if self.refs[tensor] == 0:
                    self._event(finish, FREE, -size, tensor)
        for tensor in self.structure.inputs[name]:
            buffer = self.routes.reroute.get((name, tensor), tensor)
            if buffer in self.refs:
                self._release(buffer, finish)
        self.op_end_times.append((finish, self.graph[name].level))
        return finish

    def _swap_out(self, name: str, finish: float) -> None:
        """Copies the swapped outputs of `name` to the host; each device buffer is released when its copy ends."""
        for tensor, _ in self.structure.outputs[name]:
            swap = self.routes.swap_of.get(tensor)
            if swap is None:
                continue
            copy_start, copy_end = self.d2h.copy(finish, swap.nbytes)
            self.host_events.append((copy_start, ALLOC, swap.nbytes, tensor))
            self.swapped_out_at[tensor] = copy_end
            if HOST_RUNS_AHEAD and tensor not in self.waited_out:
                self.unwaited_out.append((copy_end, tensor))
            else:
                self._release(tensor, copy_end)
            for swap_in_name, triggered in self.deferred.pop(tensor, []):
                self._copy_back(swap_in_name, triggered)
            for waiting in self.parked_out.pop(tensor, []):
                self._enqueue(waiting)

    def _swap_in(self, name: str, finish: float) -> None:
        """Starts the swap-ins `name` triggers: each copy starts when the trigger is done, the value
        has reached the host and the H2D queue is free; its device buffer is allocated as it starts."""
        for swap_in_name in self.routes.triggers.get(name, []):
            tensor = self.routes.swap_in_of[swap_in_name].tensor
            if tensor in self.swapped_out_at:
                self._copy_back(swap_in_name, finish)
            else:  # a trigger on another branch ran before the tensor was even produced: wait for it
                self.deferred.setdefault(tensor, []).append((swap_in_name, finish))

    def _copy_back(self, swap_in_name: str, triggered: float) -> None:
        swap = self.routes.swap_in_of[swap_in_name]
        copy_start, copy_end = self.h2d.copy(max(triggered, self.swapped_out_at[swap.tensor]), swap.nbytes)
        # The copy starts once its trigger has ended, after the buffers the trigger freed as it ended.
        self._event(copy_start, ALLOC_AFTER_COPY, swap.nbytes, swap_in_name)
        self.arrival[swap_in_name] = copy_end
        for waiting in self.parked.pop(swap_in_name, []):
            self._enqueue(waiting)
        self.host_refs[swap.tensor] -= 1
        if self.host_refs[swap.tensor] == 0:
            self.host_events.append((copy_end, FREE, -swap.nbytes, swap.tensor))

    def _wake_successors(self, name: str, finish: float) -> None:
        for succ in self.structure.successors[name]:
            self.ready_at[succ] = max(self.ready_at[succ], finish)
            self.pending[succ] -= 1
            if self.pending[succ] == 0:
                self._enqueue(succ)

    def result(self, persistent_bytes: int, keep_timeline: bool) -> SimulationResult:
        d2h, h2d = self.d2h, self.h2d
        step_time = max([self.stream, d2h.free_at, h2d.free_at])
        transfer = sum(end - start for start, end in d2h.busy + h2d.busy)
        forward_end = step_time if self.forward_end is None else self.forward_end
        peak_device, timeline, at_peak = _peak(self.events, persistent_bytes, keep_timeline)
        peak_host, _, _ = _peak(self.host_events, 0, False)
        # Per level only where asked for: the planners replay a step hundreds of times for its peak and time.
        by_level = _by_level(self.events, persistent_bytes, self.op_end_times) if keep_timeline else []
        hidden = 1.0 if transfer == 0 else max(0.0, 1.0 - self.stall / transfer)
        return SimulationResult(
            peak_device_bytes=peak_device, peak_host_bytes=peak_host, step_time_s=step_time,
            compute_time_s=self.compute, stall_time_s=self.stall, transfer_time_s=transfer, hidden_share=hidden,
            swapped_bytes=self.plan.swapped_bytes,
            traffic_bytes=sum(swap.nbytes * (1 + len(swap.swap_ins)) for swap in self.plan.swaps),
            forward_time_s=forward_end, device_by_level=by_level,
            d2h_busy=d2h.busy, h2d_busy=h2d.busy, timeline=timeline, resident_at_peak=at_peak)


def _peak(events, base: int, keep: bool) -> tuple[int, list[tuple[float, int]], list[tuple[str, int]]]:
    """Peak usage, the usage after each change (if `keep`), and the largest buffers at the peak.
    One pass finds the peak; the buffers resident then are rebuilt once, not at every new high."""
    events = sorted(events)
    usage = peak = base
    peak_index = -1
    timeline = []
    for index, (time, _, delta, _) in enumerate(events):
        usage += delta
        if usage > peak:
            peak, peak_index = usage, index
        if keep:
            timeline.append((time, usage))
    live: dict[str, int] = {}
    for _, _, delta, buffer in events[:peak_index + 1]:
        if delta > 0:
            live[buffer] = delta
        else:
            live.pop(buffer, None)
    at_peak = sorted(live.items(), key=lambda item: (-item[1], item[0]))[:10]
    return peak, timeline, at_peak


def _by_level(events, base: int, op_end_times) -> list[tuple[int, int]]:
    """Device bytes in use when each op ends, the maximum per level."""
    usage, index, result = base, 0, {}
    events = sorted(events)
    for time, level in sorted(op_end_times):
        while index < len(events) and events[index][0] <= time:
            usage += events[index][2]
            index += 1
        result[level] = max(result.get(level, 0), usage)
    return sorted(result.items())


