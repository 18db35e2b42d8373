"""Allocation traces and buffer lifetimes: what an allocator or a planned pool is given.

A trace is the sequence of allocations and releases a step makes, in order; a lifetime is one buffer
from its allocation to its release, as positions in that sequence (and, when the trace comes from the
simulator, as op indices and predicted times). Training repeats the same trace every step, so the
lifetimes are known before the step runs (Zhang et al., arXiv 1903.06631).

From a simulation (`lms_core.simulator.simulate(..., keep_events=True)`) a trace is made the way
TensorFlow's runtime holds memory, not the way the simulator counts it: the simulator gives every op
output a buffer of its own, as Grappler's estimate does, while TensorFlow
- keeps variables in buffers of their own for the whole run: `ReadVariableOp` returns the variable's
  buffer, and an `AssignVariableOp` whose value nothing else holds adopts that value's buffer (the
  variable's old buffer is released);
- lets views share their input's buffer (`Identity`, `Reshape`, `Squeeze`, `ExpandDims`, ...): the
  buffer lives until the last reader of any of its views;
- lets an element-wise op write its output into an input's buffer when it is that buffer's last
  reader and the sizes match (`forward_input_or_allocate_output`: `Relu`, `ReluGrad`, `Sub`, `AddN`,
  ...), so the output allocates nothing;
- allocates a `Const` once, when the kernel is made, and the caller's inputs before the step.
Those are held across the step (`resident`) and allocated ahead of it, in graph order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence

# Ops whose output is a view of their first input: no allocation of their own (TensorFlow forwards
# the buffer; Grappler's estimate and the simulator still count one).
VIEW_OPS = frozenset({"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient", "PreventGradient",
                      "Snapshot", "EnsureShape", "Bitcast", "CheckNumerics", "DebugIdentity"})
VARIABLE_READS = frozenset({"ReadVariableOp"})
VARIABLE_ASSIGNS = frozenset({"AssignVariableOp"})  # adopts its value's buffer when nothing else reads it
HELD_OPS = frozenset({"Const", "HostConst"})  # made once with the kernel, kept with it
# Element-wise kernels that write into an input's buffer when nothing else holds it and it has the
# output's size (OpKernelContext::forward_input_or_allocate_output): cwise unary and binary ops,
# activations and their gradients, AddN, BiasAdd.
FORWARDING_OPS = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Sigmoid", "Tanh", "Softplus", "Neg", "Abs", "Sqrt", "Rsqrt", "Square",
    "Exp", "Log", "Log1p", "Reciprocal", "Inv", "Sign", "Floor", "Ceil", "Round",
    "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "LeakyReluGrad", "SigmoidGrad", "TanhGrad", "SoftplusGrad",
    "RsqrtGrad", "SqrtGrad", "ReciprocalGrad",
    "Add", "AddV2", "Sub", "Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum", "SquaredDifference",
    "Pow", "FloorDiv", "FloorMod", "AddN", "BiasAdd"})


@dataclass(frozen=True)
class TraceEvent:
    """An allocation (`alloc`) of `nbytes` for `buffer`, or its release."""

    buffer: Hashable  # unique per allocation within a trace
    nbytes: int
    alloc: bool
    label: str = ""  # the op that allocated or released it, for reports


@dataclass(frozen=True)
class Lifetime:
    """A buffer from its allocation to its release: positions in the trace ([start, end): the buffer
    is live after event `start` until event `end`), and where known the op index and time of each."""

    buffer: Hashable
    nbytes: int
    start: int
    end: int  # the trace's length when it is never released
    label: str = ""
    alloc_op: int | None = None  # index, in the order ops ran, of the op that allocated it
    free_op: int | None = None  # ... and of the op whose end released it
    alloc_time: float | None = None  # predicted seconds from the start of the step
    free_time: float | None = None

    def overlaps(self, other: "Lifetime") -> bool:
        return self.start < other.end and other.start < self.end


@dataclass(frozen=True)
class AllocationTrace:
    events: tuple[TraceEvent, ...]

    def __len__(self) -> int:
        return len(self.events)

    def live_peak(self, align: int = 1) -> int:
        """The most bytes live at once, each request rounded up to a multiple of `align`."""
        live = peak = 0
        held: dict[Hashable, int] = {}
        for event in self.events:
            size = -(-event.nbytes // align) * align
            if event.alloc:
                held[event.buffer] = size
                live += size
                peak = max(peak, live)
            elif event.buffer in held:
                live -= held.pop(event.buffer)
        return peak

    def lifetimes(self) -> list[Lifetime]:
        """One lifetime per allocation, in allocation order."""
        open_: dict[Hashable, int] = {}
        result: list[Lifetime | None] = []
        for index, event in enumerate(self.events):
            if event.alloc:
                open_[event.buffer] = len(result)
                result.append(Lifetime(event.buffer, event.nbytes, index, len(self.events), event.label))
            elif event.buffer in open_:
                slot = open_.pop(event.buffer)
                done = result[slot]
                result[slot] = Lifetime(done.buffer, done.nbytes, done.start, index, done.label)
        return [r for r in result if r is not None]

    def then(self, other: "AllocationTrace", tag: Hashable) -> "AllocationTrace":
        """This trace followed by `other`, whose buffers are renamed (tag, buffer) to stay distinct."""
        return AllocationTrace(self.events + tuple(TraceEvent((tag, e.buffer), e.nbytes, e.alloc, e.label)
                                                   for e in other.events))

    @staticmethod
    def from_lifetimes(lifetimes: Iterable[Lifetime]) -> "AllocationTrace":
        """The trace of these lifetimes: events at their positions; at one position releases come
        before allocations (a buffer released as another is allocated can hand it its memory)."""
        keyed = []
        for lifetime in lifetimes:
            keyed.append((lifetime.start, 1, TraceEvent(lifetime.buffer, lifetime.nbytes, True, lifetime.label)))
            keyed.append((lifetime.end, 0, TraceEvent(lifetime.buffer, lifetime.nbytes, False, lifetime.label)))
        keyed.sort(key=lambda item: (item[0], item[1]))
        return AllocationTrace(tuple(event for _, _, event in keyed))


@dataclass(frozen=True)
class Adopted:
    """A release in a step's trace: an `AssignVariableOp` (`op`) adopts the buffer of `value`, and the
    variable's buffer until then (the one held since before the step, or adopted a step earlier) is
    released."""

    variable: str
    value: str
    op: str


@dataclass(frozen=True)
class StepMemory:
    """A step's device memory as TensorFlow holds it, from a simulation."""

    resident: tuple[tuple[str, int, str], ...]  # (buffer, bytes, what) held from before the step: variables, ...
    step: AllocationTrace  # the step's allocations and releases in the simulated order (with Adopted releases)
    lifetimes: tuple[Lifetime, ...]  # the step's buffers: positions in `step`, op indices and times
    executed: tuple[str, ...]  # ops in the order they ran (the lifetimes' op indices refer to it)

    @property
    def resident_bytes(self) -> int:
        return sum(nbytes for _, nbytes, _ in self.resident)

    def trace(self, steps: int = 1) -> AllocationTrace:
        """The resident buffers allocated in order, then `steps` runs of the step (buffer ids
        (run, name)); a variable's adopted buffer is released when the next assignment replaces it."""
        events = [TraceEvent(("resident", name), nbytes, True, what) for name, nbytes, what in self.resident]
        holder = {name: ("resident", name) for name, _, _ in self.resident}
        for run in range(steps):
            for event in self.step.events:
                if isinstance(event.buffer, Adopted):
                    previous = holder.get(event.buffer.variable)
                    if previous is not None:
                        events.append(TraceEvent(previous, event.nbytes, False, event.label))
                    holder[event.buffer.variable] = (run, event.buffer.value)
                else:
                    events.append(TraceEvent((run, event.buffer), event.nbytes, event.alloc, event.label))
        return AllocationTrace(tuple(events))


def step_memory(graph, result, as_runtime: bool = True, inputs_resident: bool = True,
                scratch: dict[str, int] | None = None) -> StepMemory:
    """`result`: a SimulationResult of `graph` made with `keep_events=True`. With `as_runtime`, the
    buffers are TensorFlow's (module docstring), allocated and released at the simulated instants;
    without it, every event is the simulator's own (each op output a buffer of its own).
    `scratch` (op name -> bytes) adds the kernels' temporaries, which no graph shows (the profiler
    measures them: lms_core.tf.allocations.RecordedTrace.scratch_by_op): allocated as the op's outputs
    are, released before anything the op releases as it ends."""
    if result.memory_events is None:
        raise ValueError("the simulation kept no memory events: simulate(..., keep_events=True)")
    owners = _runtime_owners(graph, inputs_resident) if as_runtime else _Owners()
    released_by = {e.buffer: e.op_index for e in result.memory_events if e.nbytes < 0}
    sharing: dict[str, set[str]] = {}  # live step buffer -> the simulator's buffers (tensors) in it
    events: list[TraceEvent] = []
    info: dict[str, list] = {}  # step buffer -> [bytes, start, end, alloc op, free op, t0, t1]
    temporaries = _scratch_points(result, scratch or {})
    for position, event in enumerate(result.memory_events):
        for op_index, name, nbytes in temporaries.get(position, ()):
            buffer = f"scratch of {name}"
            info[buffer] = [nbytes, len(events), len(events) + 1, op_index, op_index, event.time, event.time]
            events += [TraceEvent(buffer, nbytes, True, name), TraceEvent(buffer, nbytes, False, name)]
        owner = owners.owner(event.buffer)
        if owner in owners.kept:
            continue  # a variable, a constant, an input, or a view of one: held across the step
        if event.nbytes > 0:
            if as_runtime and owner == event.buffer:
                owner = _forwarded(graph, owners, event, sharing, info, released_by) or owner
            if owner in sharing:  # a view of, or an output forwarded into, a live buffer
                sharing[owner].add(event.buffer)
                continue
            info[owner] = [event.nbytes, len(events), None, event.op_index, None, event.time, None]
            sharing[owner] = {event.buffer}
            events.append(TraceEvent(owner, event.nbytes, True, owner))
            continue
        if owner not in sharing:
            continue
        sharing[owner].discard(event.buffer)
        if sharing[owner]:
            continue  # another view still reads it
        del sharing[owner]
        record = info[owner]
        record[2], record[4], record[6] = len(events), event.op_index, event.time
        adoption = owners.adopted.get(event.buffer)
        if adoption is not None:  # the variable takes the buffer; its former one goes
            variable, op = adoption
            events.append(TraceEvent(Adopted(variable, owner, op), owners.nbytes[variable], False, op))
            record[2] = record[4] = record[6] = None
        else:
            events.append(TraceEvent(owner, record[0], False, owner))
    end = len(events)
    lifetimes = tuple(Lifetime(buffer, n, start, end if stop is None else stop, buffer, aop, fop, t0, t1)
                      for buffer, (n, start, stop, aop, fop, t0, t1) in info.items())
    executed = tuple(name for name, _, _ in result.executed)
    return StepMemory(tuple(owners.resident), AllocationTrace(tuple(events)), lifetimes, executed)


def _scratch_points(result, scratch: dict[str, int]) -> dict[int, list[tuple[int, str, int]]]:
    """Where each op's temporaries go in the simulator's events: before the first event after its
    last output's allocation (its outputs exist, nothing it releases is released yet)."""
    if not scratch:
        return {}
    last_alloc: dict[int, int] = {}
    first: dict[int, int] = {}
    for position, event in enumerate(result.memory_events):
        first.setdefault(event.op_index, position)
        if event.nbytes > 0 and event.buffer.rpartition(":")[0] == result.executed[event.op_index][0]:
            last_alloc[event.op_index] = position
    points: dict[int, list[tuple[int, str, int]]] = {}
    for op_index, (name, _, _) in enumerate(result.executed):
        nbytes = scratch.get(name, 0)
        if nbytes <= 0:
            continue
        position = last_alloc[op_index] + 1 if op_index in last_alloc else first.get(op_index, len(result.memory_events))
        points.setdefault(position, []).append((op_index, name, nbytes))
    return points


def _forwarded(graph, owners: "_Owners", event, sharing: dict[str, set[str]], info: dict[str, list],
               released_by: dict[str, int]) -> str | None:
    """The live buffer an element-wise op writes its output into, as TensorFlow's
    forward_input_or_allocate_output does: an input buffer of the same size that this op is the last
    to read (every tensor in it is released as this op ends), and that no variable adopts."""
    producer = event.buffer.rpartition(":")[0]
    op = graph.ops.get(producer)
    if op is None or op.type not in FORWARDING_OPS:
        return None
    for tensor in op.inputs:
        candidate = owners.owner(tensor)
        held = sharing.get(candidate)
        if held is None or info[candidate][0] != event.nbytes or any(t in owners.adopted for t in held):
            continue
        if all(released_by.get(t) == event.op_index for t in held):
            owners.root[event.buffer] = candidate
            return candidate
    return None


@dataclass
class _Owners:
    """Which buffer each simulator buffer is in TensorFlow's runtime."""

    root: dict[str, str] = field(default_factory=dict)  # tensor -> the buffer it shares
    kept: set[str] = field(default_factory=set)  # buffers held across the step (allocated before it)
    resident: list[tuple[str, int, str]] = field(default_factory=list)  # those, in graph order
    nbytes: dict[str, int] = field(default_factory=dict)  # bytes of the kept buffers
    adopted: dict[str, tuple[str, str]] = field(default_factory=dict)  # step buffer -> (variable, assign op)

    def owner(self, tensor: str) -> str:
        while tensor in self.root:
            tensor = self.root[tensor]
        return tensor

    def keep(self, buffer: str, nbytes: int, what: str) -> None:
        if buffer not in self.kept:
            self.kept.add(buffer)
            self.nbytes[buffer] = nbytes
            self.resident.append((buffer, nbytes, what))


def _runtime_owners(graph, inputs_resident: bool) -> _Owners:
    owners = _Owners()
    for name in graph.order:
        op = graph[name]
        outputs = [f"{name}:{i}" for i in range(len(op.outputs))]
        if op.type in VARIABLE_READS and op.inputs:
            handle = owners.owner(op.inputs[0])
            variable = f"variable {handle}"
            owners.keep(variable, op.outputs[0].nbytes or 0, handle)
            owners.root[outputs[0]] = variable
        elif op.type in VIEW_OPS and op.inputs:
            sources = op.inputs if op.type == "IdentityN" else [op.inputs[0]] * len(outputs)
            for tensor, source in zip(outputs, sources):
                owners.root[tensor] = owners.owner(source)
        elif op.type in HELD_OPS or (inputs_resident and op.type == "Placeholder"):
            for tensor, info in zip(outputs, op.outputs):
                if info.nbytes:
                    owners.keep(tensor, info.nbytes, name)
        elif op.type in VARIABLE_ASSIGNS and len(op.inputs) >= 2:
            value, variable = owners.owner(op.inputs[1]), f"variable {owners.owner(op.inputs[0])}"
            readers = [c for c, _ in graph.consumers(op.inputs[1])]
            if value not in owners.kept and variable in owners.kept and readers == [name] and value == op.inputs[1]:
                owners.adopted[value] = (variable, name)
    return owners


def executed_graph(graph):
    """The step's IR with the barriers TensorFlow's Grappler takes out before the executor runs it:
    `IdentityN` ops (their readers read the inputs instead; their control readers wait for the
    inputs' producers). Keras's optimizer passes every gradient through one `IdentityN`
    (`sgd/IdentityN`); kept, it holds each weight gradient until the last one is computed (on
    ResNet-50 at 32x32, batch 8: 89 MiB of a 367 MiB simulated peak), while the graph TensorFlow
    executes has none (its partition graphs, checked in TensorFlow 2.18). Categories and levels are
    analysed again on the result."""
    from lms_core.graph import Graph, Op, split_tensor
    from lms_core.passes.pipeline import analyze

    removed = {name for name in graph.order if graph[name].type == "IdentityN"}
    if not removed:
        return graph
    source = {f"{name}:{i}": tensor for name in removed for i, tensor in enumerate(graph[name].inputs)}

    def read(tensor: str) -> str:
        while tensor in source:
            tensor = source[tensor]
        return tensor

    def waits(name: str) -> list[str]:
        if name not in removed:
            return [name]
        op = graph[name]
        return [w for t in op.inputs for w in waits(split_tensor(read(t))[0])] + \
            [w for c in op.control_inputs for w in waits(c)]

    ops = [Op(op.name, op.type, op.device, [read(t) for t in op.inputs],
              list(dict.fromkeys(w for c in op.control_inputs for w in waits(c))), op.outputs)
           for op in graph.ops.values() if op.name not in removed]
    return analyze(Graph(ops, [read(t) for t in graph.outputs]))


def peak_live(lifetimes: Sequence[Lifetime], align: int = 1) -> int:
    """The most bytes live at once over `lifetimes` (half-open intervals), each rounded up to `align`:
    the lower bound of any placement of them."""
    points = []
    for lifetime in lifetimes:
        size = -(-lifetime.nbytes // align) * align
        points.append((lifetime.start, 1, size))
        points.append((lifetime.end, 0, -size))
    live = peak = 0
    for _, _, delta in sorted(points):
        live += delta
        peak = max(peak, live)
    return peak


__all__ = ["TraceEvent", "Lifetime", "AllocationTrace", "Adopted", "StepMemory", "step_memory", "peak_live", "VIEW_OPS",
           "FORWARDING_OPS", "executed_graph"]
