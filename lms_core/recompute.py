"""Recompute: a third action for a tensor the backward pass reads late, beside keeping and swapping.

On today's GPUs the link has not kept pace with compute: at the batch sizes LMS is for, the bytes a
swap plan moves each way take longer than the step's compute, and no schedule of copies hides that.
Much of what is swapped is cheap to make again: batch-norm, ReLU and add outputs are memory-bound
element-wise ops that cost a few percent of the step. So a tensor can instead be freed after its
forward readers and made again in the backward pass, just before its first backward reader, from
tensors that are live then anyway (Chen et al. 2016's checkpointing, chosen per tensor as Capuchin
and Checkmate do).

**What is recomputed** (`Segment`): the tensor's producer and, where its inputs are not live at that
moment, their producers too (at most `MAX_SEGMENT_OPS` ops), back to *anchors*: tensors that are
live when the segment runs without any plan keeping them (small ones, variables' values, constants,
and tensors some backward op at or after that moment reads anyway). The segment's ops are cloned
into the backward pass; the clones' results are read by the tensor's backward readers only.

**What is refused** (`reason_not_to_recompute`): every op whose type is not on `RECOMPUTABLE_TYPES`,
a list of deterministic, stateless ops: memory-bound ones (element-wise math, bias adds, casts,
reshapes, pooling, padding, batch-norm in training mode, whose moving statistics are written by
separate ops that keep reading the original) and the forward convolutions and matrix products, whose
kernels give the same result for the same shapes (the planner weighs their time against a swap's).
So never a variable read (a clone could read a weight after the optimizer updated it), a random op
with hidden state, a collective, or an op inside control flow. Stateless random ops (a seeded dropout
mask) are deterministic and may be cloned; their seed is an anchor.

**When the clones run**: each clone waits, by a control edge, for a *trigger*, the backward op on
the first reader's chain of latest backward inputs one level before it (lms_core.planner.find_trigger,
the swap-ins' own rule): without it TensorFlow would run the clones as soon as their anchors exist,
in the forward pass, and nothing would be freed. lms_core.tf.gating proves on the partition graphs
TensorFlow executes that every clone waits for its trigger.

**Which tensors** (`plan_recompute`): at every moment the unswapped step holds more than the budget,
recompute is asked for the excess less a share of what the link could have off the device then
(lms_core.access_order.link_carry). The moment wanting the most is covered first, with the idle tensor
(forward readers done, backward readers not started) whose freeing costs the fewest extra seconds per
byte (`freeing`: its own segment and those it lengthens); the step is rewritten (`with_recomputes`)
and simulated again. What recompute cannot cover is left to the swap strategies, planned on the
rewritten step. Where swaps take the rest, the recomputes may not raise the floor no swap can go
under (`within_floor`): those holding memory at the floor's moment are dropped.

**Shared clones** (`room_to_share`, `entries_for`): two segments often clone the same op (a ReLU's
segment and its convolution output's both make that convolution again). A segment may read the
clone a segment triggered no later makes, instead of making it again, where the step has room to
hold that clone's result until the later segment would have made it: the budget alone, since where
the link could carry the excess the swaps' copies back use that room. Sharing saves compute and
holds memory longer, which can cost the swaps more: the planner plans each set of recomputes both
ways and keeps the faster (lms_core.planning).

**What it can gain at the most** (`Relief`): every recomputable tensor's idle stretch and its
producer's time per byte, from which lms_core.access_order.lower_bound_s bounds the step over both
actions: at each moment the bytes that must be off the device are split between the link and the
compute queue where that is fastest.
"""
from __future__ import annotations

import dataclasses
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from lms_core.driver import PEAK_TIE
from lms_core.graph import BACKWARD, FORWARD, Graph, Op, order_positions, split_tensor, tensor_name
from lms_core.passes.pipeline import analyze
from lms_core.plan import Recompute
from lms_core.planner import NEVER_SWAPPED_TYPES, SHAPE_ONLY_TYPES, find_trigger

if TYPE_CHECKING:
    from lms_core.simulator import SimulationResult

#: Deterministic, stateless, memory-bound ops: cheap to run again, the same result every time.
MEMORY_BOUND_TYPES = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Sigmoid", "Tanh", "Softplus", "Softsign", "Gelu",
    "Identity", "Add", "AddV2", "Sub", "Mul", "RealDiv", "DivNoNan", "Maximum", "Minimum", "Neg", "Square",
    "SquaredDifference", "Sqrt", "Rsqrt", "Exp", "Log", "Erf", "BiasAdd", "Cast", "Reshape", "ExpandDims",
    "Squeeze", "FusedBatchNormV3", "SelectV2", "GreaterEqual", "Pad", "ConcatV2", "Transpose", "Slice",
    "StridedSlice", "MaxPool", "MaxPool3D", "AvgPool", "AvgPool3D", "UpSampling3D", "Tile",
    "StatelessRandomUniformV2", "StatelessRandomGetKeyCounter", "StatelessRandomBinomial",
})
#: Deterministic, stateless, compute-bound ops: their forward kernels give the same result each time
#: for the same shapes (cuDNN's and cuBLAS's forward algorithms, chosen once per shape), at the cost of
#: a forward pass's share of their time. The planner weighs that against what swapping would cost.
COMPUTE_BOUND_TYPES = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative", "MatMul", "BatchMatMulV2"})
RECOMPUTABLE_TYPES = MEMORY_BOUND_TYPES | COMPUTE_BOUND_TYPES
MAX_SEGMENT_OPS = 12  # ops cloned for one tensor at most: a longer chain is no longer cheap
NON_DATA_DTYPES = frozenset({"resource", "variant", "string"})


def clone_name(tensor: str, op: str) -> str:
    """The name of `op`'s clone in the backward pass, in the segment that makes `tensor` again. Each
    segment makes clones of its own, waiting for its own trigger, unless it reads those of a segment
    triggered no later (`entries_for`): a clone waiting for two triggers would run only after the
    later one, after the other segment's readers."""
    producer, index = split_tensor(tensor)
    return f"lms/recompute_{producer}_{index}/{op}"


def reason_not_to_recompute(op: Op, types: frozenset[str] = RECOMPUTABLE_TYPES) -> str | None:
    """Why `op` may not be cloned into the backward pass (with clones of `types` allowed), or None."""
    if op.type not in types:
        kind = "memory-bound " if types == MEMORY_BOUND_TYPES else ""
        return f"{op.type} is not on the list of deterministic, stateless {kind}ops"
    if op.region is not None:
        return f"inside v1 control flow ({op.region})"
    if op.category != FORWARD:
        return f"a {op.category} op"
    if any(t.dtype in NON_DATA_DTYPES or t.nbytes is None for t in op.outputs):
        return "an output of unknown size or a handle"
    return None


@dataclass(frozen=True)
class Segment:
    """A tensor that can be recomputed: the ops to clone (graph order, its producer last), the
    tensors they read from outside (live when they run), its backward readers and their trigger."""

    tensor: str
    nbytes: int
    ops: tuple[str, ...]
    anchors: tuple[str, ...]
    consumers: tuple[str, ...]  # the backward readers, which read the clone
    trigger: str
    seconds: float  # the clones' time by the cost model

    def entry(self) -> Recompute:
        return Recompute(tensor=self.tensor, nbytes=self.nbytes, ops=list(self.ops),
                         clones=[clone_name(self.tensor, op) for op in self.ops], anchors=list(self.anchors),
                         consumers=list(self.consumers), trigger=self.trigger, seconds=self.seconds)


def backward_readers(graph: Graph, tensor: str) -> list[Op]:
    """The backward ops reading `tensor`'s data (shape-only readers keep the original), by level."""
    readers = {graph[c].name: graph[c] for c, _ in graph.consumers(tensor)
               if graph[c].category == BACKWARD and graph[c].type not in SHAPE_ONLY_TYPES}
    return sorted(readers.values(), key=lambda op: (op.level, op.name))


def find_segment(graph: Graph, tensor: str, costs: dict[str, float], min_tensor_bytes: int,
                 freed: frozenset[str] = frozenset(), types: frozenset[str] = RECOMPUTABLE_TYPES) -> Segment | str:
    """The segment that recomputes `tensor` for its backward readers, or why there is none. Tensors
    in `freed` (recomputed themselves) are no anchors: the segment makes them again too."""
    producer = graph[split_tensor(tensor)[0]]
    readers = backward_readers(graph, tensor)
    if not readers:
        return "no backward op reads it"
    first = readers[0]
    ops, anchors, pending = [], [], [producer.name]
    while pending:
        name = pending.pop()
        if name in ops:
            continue
        reason = reason_not_to_recompute(graph[name], types)
        if reason is not None:
            return f"{name}: {reason}"
        ops.append(name)
        if len(ops) > MAX_SEGMENT_OPS:
            return f"more than {MAX_SEGMENT_OPS} ops to make it again"
        for source in graph[name].inputs:
            if source not in freed and _is_anchor(graph, source, first.level, min_tensor_bytes):
                anchors.append(source)
            else:
                pending.append(split_tensor(source)[0])
    trigger = find_trigger(graph, first, first.level - 1)
    if trigger is None:
        return f"no backward op runs before {first.name} to start it"
    ops.sort(key=order_positions(graph).__getitem__)
    return Segment(tensor, graph.tensor(tensor).nbytes, tuple(ops), tuple(dict.fromkeys(anchors)),
                   tuple(op.name for op in readers), trigger.name, sum(costs.get(op, 0.0) for op in ops))


def _is_anchor(graph: Graph, tensor: str, level: int, min_tensor_bytes: int) -> bool:
    """Whether `tensor` is live at `level` of the backward pass whatever a plan does: small, a
    variable's value or a constant, or read by a backward op at or after that level."""
    producer = graph[split_tensor(tensor)[0]]
    info = graph.tensor(tensor)
    if producer.type in NEVER_SWAPPED_TYPES or info.nbytes is None or info.nbytes < min_tensor_bytes:
        return True
    return any(graph[c].category == BACKWARD and graph[c].level >= level for c, _ in graph.consumers(tensor))


def with_recomputes(graph: Graph, recomputes: list[Recompute]) -> Graph:
    """`graph` with each entry's ops cloned (every clone waiting for the entry's trigger) and its
    backward readers reading the clone of the tensor: a new IR, analysed when `graph` was."""
    if not recomputes:
        return graph
    added: list[Op] = []
    rerouted: dict[tuple[str, str], str] = {}
    for entry in recomputes:
        clones = dict(zip(entry.ops, entry.clones))
        for name, clone in entry.made():
            op = graph[name]
            inputs = [_cloned(source, clones) for source in op.inputs]
            added.append(Op(clone, op.type, op.device, inputs, [entry.trigger], list(op.outputs)))
        for consumer in entry.consumers:
            rerouted[(consumer, entry.tensor)] = _cloned(entry.tensor, clones)
    ops = []
    for op in graph.ops.values():
        inputs = [rerouted.get((op.name, source), source) for source in op.inputs]
        ops.append(Op(op.name, op.type, op.device, inputs, list(op.control_inputs), list(op.outputs)))
    rewritten = Graph(ops + added, graph.outputs)
    return analyze(rewritten) if graph.analyses else rewritten


def by_trigger(graph: Graph, freed: dict[str, Segment]) -> list[Segment]:
    """The freed tensors' segments in the order their clones run: by their trigger's backward level."""
    return sorted(freed.values(), key=lambda segment: (graph[segment.trigger].level, segment.tensor))


def entries_for(graph: Graph, costs: dict[str, float], freed: dict[str, Segment],
                shares: frozenset[tuple[str, str]] = frozenset()) -> list[Recompute]:
    """The freed tensors' entries, by their triggers' backward level. Where (tensor, op) is in
    `shares`, the tensor's segment reads the clone of `op` that a segment triggered no later makes,
    instead of making it again; its own clones that then feed nothing of it are not made."""
    made: dict[str, str] = {}  # op -> the clone that makes it
    entries = []
    for segment in by_trigger(graph, freed):
        entry = segment.entry()
        reused = {op: made[op] for op in entry.ops if (entry.tensor, op) in shares and op in made}
        if reused:
            entry = _reading(graph, costs, entry, reused)
        for op, clone in zip(entry.ops, entry.clones):
            made.setdefault(op, clone)
        entries.append(entry)
    return entries


def _reading(graph: Graph, costs: dict[str, float], entry: Recompute, reused: dict[str, str]) -> Recompute:
    """`entry` reading the clones `reused` (op -> another entry's clone) instead of making them: its
    ops are those its tensor still needs, its anchors what the clones it makes read from outside."""
    needed = _needed(graph, split_tensor(entry.tensor)[0], set(entry.ops), set(reused))
    own = dict(zip(entry.ops, entry.clones))
    ops = [op for op in entry.ops if op in needed]
    made = [op for op in ops if op not in reused]
    anchors = [source for op in made for source in graph[op].inputs if split_tensor(source)[0] not in ops]
    return dataclasses.replace(entry, ops=ops, clones=[reused.get(op, own[op]) for op in ops],
                               shared=[reused[op] for op in ops if op in reused],
                               anchors=list(dict.fromkeys(anchors)), seconds=sum(costs.get(op, 0.0) for op in made))


def _needed(graph: Graph, producer: str, ops: set[str], shared: set[str]) -> set[str]:
    """The ops of a segment that its tensor's producer needs, where `shared` ones are read, not made."""
    needed, pending = set(), [producer]
    while pending:
        name = pending.pop()
        if name in needed:
            continue
        needed.add(name)
        if name not in shared:
            pending.extend(split_tensor(source)[0] for source in graph[name].inputs if split_tensor(source)[0] in ops)
    return needed


def room_to_share(graph: Graph, costs: dict[str, float], freed: dict[str, Segment], schedule,
                  wanted: list[float]) -> frozenset[tuple[str, str]]:
    """The (tensor, op) pairs whose segment may read another's clone of op: a segment triggered no
    later makes it, and holding that clone until this segment's own would run fits at every moment
    between (`wanted`, bytes over the aim per moment of `schedule`, a replay with no clone shared,
    stays at or under 0). The costliest op first."""
    left = list(wanted)
    first: dict[str, str] = {}
    pairs = []
    for segment in by_trigger(graph, freed):
        for op in segment.ops:
            if op in first:
                pairs.append((costs.get(op, 0.0), segment.tensor, op, first[op]))
            else:
                first[op] = segment.tensor
    shares = set()
    for _, tensor, op, owner in sorted(pairs, reverse=True):
        held = clone_name(owner, op)
        readers = [reader for index in range(len(graph[op].outputs))
                   for reader, _ in schedule.graph.consumers(tensor_name(held, index))]
        done = max((schedule.end.get(r, 0.0) for r in readers), default=schedule.end.get(held, 0.0))
        needed = schedule.start.get(clone_name(tensor, op), 0.0)
        nbytes = sum(info.nbytes or 0 for info in graph[op].outputs)
        # At the instant its last reader ends the clone is in that instant's high already.
        span = range(bisect_right(schedule.times, done), bisect_left(schedule.times, needed))
        if all(left[i] + nbytes <= 0 for i in span):
            shares.add((tensor, op))
            for i in span:
                left[i] += nbytes
    return frozenset(shares)


def clone_costs(costs: dict[str, float], recomputes: list[Recompute]) -> dict[str, float]:
    """`costs` with each clone costing what its original does."""
    cloned = dict(costs)
    for entry in recomputes:
        cloned.update({clone: costs.get(op, 0.0) for op, clone in zip(entry.ops, entry.clones)})
    return cloned


def _cloned(tensor: str, clones: dict[str, str]) -> str:
    op, index = split_tensor(tensor)
    return tensor_name(clones[op], index) if op in clones else tensor


def candidate_segments(graph: Graph, costs: dict[str, float], min_tensor_bytes: int,
                       freed: frozenset[str] = frozenset(), types: frozenset[str] = RECOMPUTABLE_TYPES
                       ) -> list[Segment]:
    """Every forward tensor of at least `min_tensor_bytes` that backward ops read and that can be
    recomputed (`freed`: tensors recomputed already, which are no anchors), in graph order."""
    segments = []
    for name in graph.order:
        op = graph[name]
        if op.category != FORWARD or op.type not in types:
            continue
        for index, info in enumerate(op.outputs):
            if info.nbytes is None or info.nbytes < min_tensor_bytes:
                continue
            found = find_segment(graph, tensor_name(name, index), costs, min_tensor_bytes, freed, types)
            if isinstance(found, Segment):
                segments.append(found)
    return segments


def idle_window(schedule_start: dict[str, float], schedule_end: dict[str, float], graph: Graph,
                segment: Segment) -> tuple[float, float]:
    """When `segment`'s tensor could be off the device in a simulated step: from the end of its
    producer and of every reader other than its backward readers, to the start of the first of those."""
    producer = split_tensor(segment.tensor)[0]
    near = [c for c, _ in graph.consumers(segment.tensor) if c not in segment.consumers]
    done = max((schedule_end.get(op, float("inf")) for op in (producer, *near)), default=0.0)
    return done, min(schedule_start.get(op, float("inf")) for op in segment.consumers)


#: Rounds of "simulate, take what is idle at the peak, rewrite" at most.
MAX_ROUNDS = 12


@dataclass(frozen=True)
class RecomputePlan:
    """The tensors recomputed, the step they are recomputed in (the IR with the clones) and its
    op costs (the clones cost what their originals do)."""

    recomputes: list[Recompute]
    graph: Graph
    costs: dict[str, float]
    segments: tuple[Segment, ...] = ()  # the freed tensors' segments
    shares: frozenset[tuple[str, str]] = frozenset()  # (tensor, op): where a clone could be shared (not applied)

    def sharing_clones(self, graph: Graph, costs: dict[str, float]) -> "RecomputePlan":
        """This plan with its clones shared where `shares` has room (`graph`, `costs`: the step as
        traced and its costs, which this plan was made on)."""
        entries = entries_for(graph, costs, {segment.tensor: segment for segment in self.segments}, self.shares)
        return RecomputePlan(entries, with_recomputes(graph, entries), clone_costs(costs, entries), self.segments)


def plan_recompute(graph: Graph, settings: dict, costs: dict[str, float], link, budget_bytes: int,
                   min_tensor_bytes: int, types: frozenset[str] = RECOMPUTABLE_TYPES,
                   floor_check: FloorCheck | None = None, link_share: float = 0.0) -> RecomputePlan:
    """Recomputes chosen to bring the unswapped step within `budget_bytes`, as far as recompute can,
    less what the link carries: at every moment the step holds more, recompute is asked for the
    excess less `link_share` of what swaps could have off the device then without slowing the step
    (lms_core.access_order.link_carry; 0 asks recompute for all of it). Each round the step is
    simulated and `_cover` takes idle tensors where the most is still wanted; the step is rewritten
    and simulated again, until nothing is wanted or nothing more can be freed. Each freed tensor is
    made again from the nearest tensors that are not freed: a tensor freed later extends the
    segments that read it, and one that would make a segment longer than MAX_SEGMENT_OPS, or reach an
    op not of `types`, is passed over. `settings` go into the plan the step is simulated with
    (LMSConfig.settings()). With `floor_check`, the recomputes are then kept within its limit
    (`within_floor`)."""
    from lms_core.access_order import Schedule, link_carry
    from lms_core.plan import Plan
    from lms_core.simulator import simulate

    floor = max(1, min_tensor_bytes)
    freed: dict[str, Segment] = {}
    current, current_costs = graph, costs
    for _ in range(MAX_ROUNDS):
        schedule = Schedule(current, simulate(current, Plan(settings=settings), current_costs, link, keep_events=True))
        # Within PEAK_TIE of the budget counts as within it: a few bytes over are no reason to free megabytes.
        wanted = [usage - budget_bytes * (1 + PEAK_TIE) - link_share * link_carry(schedule, moment, link)
                  for moment, usage in zip(schedule.times, schedule.usage)]
        more = _cover(graph, costs, floor, types, schedule, wanted, freed)
        if len(more) == len(freed):
            break  # nothing wanted, or nothing more recompute can free where it is: the rest is for the swaps
        freed = more
        entries = entries_for(graph, costs, freed)
        current, current_costs = with_recomputes(graph, entries), clone_costs(costs, entries)
    if floor_check is not None and freed:
        freed = within_floor(graph, settings, costs, link, freed, floor_check, floor, types)
        entries = entries_for(graph, costs, freed)
        current, current_costs = with_recomputes(graph, entries), clone_costs(costs, entries)
    shares = frozenset()
    if freed:
        # Room by the budget alone: where the link could carry the excess, the swaps' copies back use the room.
        if schedule.graph is not current:  # the floor check or the last round changed the step
            schedule = Schedule(current, simulate(current, Plan(settings=settings), current_costs, link,
                                                  keep_events=True))
        room = [usage - budget_bytes * (1 + PEAK_TIE) for usage in schedule.usage]
        shares = room_to_share(graph, costs, freed, schedule, room)
    return RecomputePlan(entries_for(graph, costs, freed), current, current_costs, tuple(freed.values()), shares)


def _cover(graph: Graph, costs: dict[str, float], min_tensor_bytes: int, types: frozenset[str], schedule,
           wanted: list[float], freed: dict[str, Segment]) -> dict[str, Segment]:
    """`freed` and the tensors that cover `wanted` (bytes per moment of `schedule`, a replay of
    `graph` with `freed` made again) as far as tensors idle there can: the moment wanting the most
    first, and there the tensor whose freeing costs the fewest extra seconds of recompute per byte
    (its own segment, and the segments it lengthens: `freeing`). Freed, a tensor covers its bytes
    over its whole idle stretch."""
    left = list(wanted)
    idle = {segment.tensor: (segment.nbytes, idle_window(schedule.start, schedule.end, schedule.graph, segment))
            for segment in candidate_segments(graph, costs, min_tensor_bytes, frozenset(freed), types)
            if segment.tensor not in freed}
    refused: set[str] = set()
    while left:
        index = max(range(len(left)), key=left.__getitem__)
        if left[index] <= 0:
            break
        moment, best = schedule.times[index], None
        for tensor, (nbytes, (done, needed)) in idle.items():
            if tensor in freed or tensor in refused or not done <= moment < needed:
                continue
            changed = freeing(graph, costs, min_tensor_bytes, types, freed, tensor)
            if changed is None:
                refused.add(tensor)  # some segment could no longer make its tensor again
                continue
            extra = sum(s.seconds for s in changed.values()) - sum(freed[t].seconds for t in changed if t in freed)
            if best is None or (extra / nbytes, tensor) < best[0]:
                best = ((extra / nbytes, tensor), tensor, changed)
        if best is None:
            left[index] = 0.0  # nothing idle to free here: the swaps must
            continue
        _, tensor, changed = best
        freed = {**freed, **changed}
        nbytes, (done, needed) = idle[tensor]
        for moment_index in range(bisect_left(schedule.times, done), bisect_left(schedule.times, needed)):
            left[moment_index] -= nbytes
    return freed


def freeing(graph: Graph, costs: dict[str, float], min_tensor_bytes: int, types: frozenset[str],
            freed: dict[str, Segment], tensor: str) -> dict[str, Segment] | None:
    """The segments that freeing `tensor` besides `freed` makes or changes: its own, and those of the
    freed tensors that read it as an anchor (they now make it again first); None where one of them
    could no longer be made."""
    names = frozenset(freed) | {tensor}
    changed = {}
    for name in (tensor, *(t for t, segment in freed.items() if tensor in segment.anchors)):
        found = find_segment(graph, name, costs, min_tensor_bytes, names, types)
        if not isinstance(found, Segment):
            return None
        changed[name] = found
    return changed


@dataclass(frozen=True)
class FloorCheck:
    """What recomputes must not do: raise the swaps' floor (lms_core.access_order.schedule_floor) of
    the step over `limit_bytes`. `floor_of(step, unswapped)` is that floor and the buffers it counts
    at its moment, for a step and its unswapped replay (the caller knows which tensors may be swapped)."""

    floor_of: Callable[[Graph, "SimulationResult"], tuple[int, frozenset[str]]]
    limit_bytes: int


#: Rounds of "find the floor, drop the recomputes holding memory at it" at most.
MAX_FLOOR_ROUNDS = 8


def within_floor(graph: Graph, settings: dict, costs: dict[str, float], link, freed: dict[str, Segment],
                 floor_check: FloorCheck, min_tensor_bytes: int, types: frozenset[str]) -> dict[str, Segment]:
    """`freed` less the recomputes that raise the swaps' floor over `floor_check.limit_bytes`: those
    holding memory at the floor's moment (`held_by`), dropped round by round (the floor then moves)
    until it is within the limit; where the rounds run out, the set with the lowest floor seen.

    Why: a clone lives in the backward pass where the memory is tightest, and a segment of several
    ops holds each op's result at once, and its anchors until it runs. Recomputing can so set a floor
    no swap can go under: on ResNet-50 at batch 1024 (h100, pcie5, simulated) the recomputes chosen
    at the unswapped peak raised it from 15.41 to 18.48 GiB (a ReLU made again beside its anchor, the
    previous block's output), on the 3D U-Net at 384^3 from 17.60 to 23.72 GiB (an instance norm's
    chain of clones). A tensor no longer recomputed is left to the swaps."""
    from lms_core.plan import Plan
    from lms_core.simulator import simulate

    best, best_floor = freed, None
    for _ in range(MAX_FLOOR_ROUNDS):
        entries = entries_for(graph, costs, freed)
        step = with_recomputes(graph, entries)
        unswapped = simulate(step, Plan(settings=settings), clone_costs(costs, entries), link, keep_events=True)
        floor, resident = floor_check.floor_of(step, unswapped)
        if best_floor is None or floor < best_floor:
            best, best_floor = freed, floor
        if floor <= floor_check.limit_bytes * (1 + PEAK_TIE):  # a few small tensors more are no raise
            return freed
        holding = held_by(entries, resident)
        kept = segments_for(graph, costs, min_tensor_bytes, [t for t in freed if t not in holding], types)
        if not holding or kept is None:
            break
        freed = kept
    return best


def held_by(entries: list[Recompute], resident: frozenset[str]) -> set[str]:
    """The recomputed tensors (of `entries`) that hold one of the `resident` buffers: a clone's result;
    where no clone's result is resident, an anchor (kept on the device for the clones to read; one
    that some op reads then anyway would stay, so only where no clone is to blame)."""
    producers = {split_tensor(buffer)[0] for buffer in resident}
    cloned = {entry.tensor for entry in entries if producers & set(entry.clones)}
    return cloned or {entry.tensor for entry in entries if resident & set(entry.anchors)}


@dataclass(frozen=True)
class Relief:
    """What recompute could take off the device at each moment of the unswapped schedule, and the
    least compute that costs: each recomputable tensor's idle stretch (its forward readers done, its
    backward readers not started), and the time per byte of its producer, which a recompute runs
    again at the least. Sorted by that time per byte: the cheapest first."""

    tensors: tuple[tuple[float, float, float, int], ...]  # (seconds per byte, idle from, idle until, bytes)

    def cost_curve(self, moment: float) -> tuple[list[int], list[float]]:
        """Cumulative bytes and seconds of the tensors idle at `moment`, the cheapest per byte first."""
        freed, seconds = [0], [0.0]
        for per_byte, start, end, nbytes in self.tensors:
            if start <= moment < end:
                freed.append(freed[-1] + nbytes)
                seconds.append(seconds[-1] + per_byte * nbytes)
        return freed, seconds

    def least(self, moment: float, forced: int, step_s: Callable[[float, float], float]) -> float:
        """The least of `step_s(r, cost of recomputing r bytes)` over r from 0 to what is idle at
        `moment` (at most `forced`). The cost is the cheapest bytes' first (a convex, piecewise-linear
        curve) and `step_s` is convex in r for a convex cost: a ternary search finds the least."""
        freed, seconds = self.cost_curve(moment)
        high = min(forced, freed[-1])
        if high <= 0:
            return step_s(0.0, 0.0)  # nothing idle then: swaps alone

        def at(r: float) -> float:
            i = min(max(bisect_left(freed, r), 1), len(freed) - 1)
            share = (r - freed[i - 1]) / (freed[i] - freed[i - 1]) if freed[i] > freed[i - 1] else 0.0
            return step_s(r, seconds[i - 1] + share * (seconds[i] - seconds[i - 1]))

        low, top = 0.0, float(high)
        for _ in range(RELIEF_SEARCH_STEPS):
            third = (top - low) / 3
            if at(low + third) <= at(top - third):
                top -= third
            else:
                low += third
        return min(at(0.0), at((low + top) / 2), at(float(high)))


#: Ternary-search steps per moment of `Relief.least`: (2/3)^60 of the bytes is below one byte.
RELIEF_SEARCH_STEPS = 60


def recompute_relief(graph: Graph, start: dict[str, float], end: dict[str, float], costs: dict[str, float],
                     min_tensor_bytes: int, types: frozenset[str] = RECOMPUTABLE_TYPES) -> Relief:
    """The Relief of `graph`'s unswapped schedule (`start` and `end` of each op): every tensor that
    can be recomputed (candidate_segments), idle from its producer's and forward readers' end to its
    first backward reader's start, at its producer's time over all its bytes recomputed."""
    segments = candidate_segments(graph, costs, max(1, min_tensor_bytes), types=types)
    produced: dict[str, int] = {}
    for segment in segments:
        producer = split_tensor(segment.tensor)[0]
        produced[producer] = produced.get(producer, 0) + segment.nbytes
    tensors = []
    for segment in segments:
        producer = split_tensor(segment.tensor)[0]
        done, needed = idle_window(start, end, graph, segment)
        if done < needed:
            tensors.append((costs.get(producer, 0.0) / produced[producer], done, needed, segment.nbytes))
    return Relief(tuple(sorted(tensors)))


def segments_for(graph: Graph, costs: dict[str, float], min_tensor_bytes: int, tensors: list[str],
                 types: frozenset[str]) -> dict[str, Segment] | None:
    """Each of `tensors` with the segment that makes it again when all of them are freed; None when
    one of them cannot be."""
    freed = frozenset(tensors)
    segments = {}
    for tensor in tensors:
        found = find_segment(graph, tensor, costs, min_tensor_bytes, freed, types)
        if not isinstance(found, Segment):
            return None
        segments[tensor] = found
    return segments
