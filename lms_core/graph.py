"""A framework-neutral graph IR of one training step: ops, the tensors they produce, and the edges.

Tensors are named as TensorFlow names them, `op_name:index`. Analyses (categories, levels) are written
onto ops by passes (lms_core.passes) and read by the planner; the IR itself knows nothing of either.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, TypeVar

# Categories written by lms_core.passes.categorize.
FORWARD = "forward"
BACKWARD = "backward"
UPDATE = "update"
OTHER = "other"  # inputs, constants, variable handles, and ops that belong to no pass

# TensorFlow's v1 while loops close a cycle through NextIteration -> Merge. Edges out of these ops are
# back edges: every traversal and the topological order ignore them, as TensorFlow's executor does.
BACK_EDGE_SOURCE_TYPES = frozenset({"NextIteration", "RefNextIteration"})


@dataclass(frozen=True)
class TensorList:
    """What a TensorList (a variant tensor) holds, as far as the graph says: how many elements at
    most, of which shape and dtype, and whether they are all one buffer. Recorded by the framework
    adapter for the lists a loop fills (lms_core.loops sizes them); Grappler sees a variant as 0 bytes."""

    element_shape: tuple[int, ...]
    element_dtype: str
    element_bytes: int  # one element's bytes (shape x dtype size)
    length: int  # the elements it holds after the loop: the loop's trip count for an accumulator
    # Set when every element is the same buffer (a variable's value, a loop-invariant tensor): the
    # list then holds no memory of its own, and copying it elsewhere would make `length` copies.
    aliases: str | None = None


@dataclass
class TensorInfo:
    """One output of an op. `shape` has None for unknown dimensions; `nbytes` is None when any
    dimension or the element size is unknown. A TensorList filled by a loop carries `tensor_list`,
    and its `nbytes` is what its elements hold (lms_core.loops.list_bytes)."""

    shape: tuple[int | None, ...] | None
    dtype: str
    nbytes: int | None
    tensor_list: TensorList | None = None


@dataclass
class Op:
    name: str
    type: str
    device: str = ""
    inputs: list[str] = field(default_factory=list)  # data inputs, as "op:index"
    control_inputs: list[str] = field(default_factory=list)  # op names
    outputs: list[TensorInfo] = field(default_factory=list)
    # Written by passes:
    category: str | None = None
    level: int | None = None
    region: str | None = None  # the v1 control-flow op whose frame or branch this op runs in, if any


def tensor_name(op: str, index: int) -> str:
    return f"{op}:{index}"


def split_tensor(name: str) -> tuple[str, int]:
    op, _, index = name.rpartition(":")
    return op, int(index)


class Graph:
    """Ops in a topological order, with consumer maps built once."""

    def __init__(self, ops: Iterable[Op], outputs: list[str]):
        self.ops: dict[str, Op] = {op.name: op for op in ops}
        self.outputs = list(outputs)  # the step's fetched tensors (the loss, ...)
        self.analyses: set[str] = set()  # the annotations passes have written (lms_core.passes.run_passes)
        self._data_consumers: dict[str, list[tuple[str, int]]] = {}  # tensor -> [(consumer op, input slot)]
        self._control_consumers: dict[str, list[str]] = {}
        for op in self.ops.values():
            for slot, tensor in enumerate(op.inputs):
                self._data_consumers.setdefault(tensor, []).append((op.name, slot))
            for source in op.control_inputs:
                self._control_consumers.setdefault(source, []).append(op.name)
        self.order = self._topological_order()

    def fingerprint(self) -> str:
        """sha256 of what the step computes, in graph order: each op's name, type, inputs, control
        inputs (as a set: TensorFlow's automatic control dependencies come in no fixed order from one
        trace to the next) and output shapes and dtypes, not the analyses passes wrote. Equal
        fingerprints: the same step."""
        import hashlib

        digest = hashlib.sha256()
        for op in self.ops.values():
            outputs = ";".join(f"{t.shape}{t.dtype}" for t in op.outputs)
            digest.update(f"{op.name}|{op.type}|{','.join(op.inputs)}|{','.join(sorted(op.control_inputs))}|{outputs}\n"
                          .encode())
        return digest.hexdigest()

    def __len__(self) -> int:
        return len(self.ops)

    def __getitem__(self, name: str) -> Op:
        return self.ops[name]

    def consumers(self, tensor: str) -> list[tuple[str, int]]:
        return self._data_consumers.get(tensor, [])

    def control_consumers(self, op: str) -> list[str]:
        return self._control_consumers.get(op, [])

    def is_back_edge_source(self, name: str) -> bool:
        op = self.ops.get(name)
        return op is not None and op.type in BACK_EDGE_SOURCE_TYPES

    def data_predecessors(self, op: Op) -> Iterator[str]:
        for tensor in op.inputs:
            name = split_tensor(tensor)[0]
            if not self.is_back_edge_source(name):
                yield name

    def predecessors(self, op: Op) -> Iterator[str]:
        yield from self.data_predecessors(op)
        yield from (name for name in op.control_inputs if not self.is_back_edge_source(name))

    def successors(self, name: str) -> Iterator[str]:
        op = self.ops[name]
        if op.type in BACK_EDGE_SOURCE_TYPES:
            return
        for index in range(len(op.outputs)):
            for consumer, _ in self.consumers(tensor_name(name, index)):
                yield consumer
        yield from self.control_consumers(name)

    def tensor(self, name: str) -> TensorInfo:
        op, index = split_tensor(name)
        return self.ops[op].outputs[index]

    def _topological_order(self) -> list[str]:
        """Kahn's algorithm, ties broken by the order ops were given (stable and deterministic)."""
        indegree = {name: 0 for name in self.ops}
        for op in self.ops.values():
            for pred in self.predecessors(op):
                if pred in self.ops:
                    indegree[op.name] += 1
        position = {name: i for i, name in enumerate(self.ops)}
        import heapq

        ready = [(position[n], n) for n, d in indegree.items() if d == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            _, name = heapq.heappop(ready)
            order.append(name)
            for succ in self.successors(name):
                indegree[succ] -= 1
                if indegree[succ] == 0:
                    heapq.heappush(ready, (position[succ], succ))
        if len(order) != len(self.ops):
            stuck = sorted(n for n, d in indegree.items() if d > 0)[:5]
            raise ValueError(f"the graph has a cycle (ops never ready: {', '.join(stuck)}, ...)")
        return order


Derived = TypeVar("Derived")


def once_per_graph(derive: Callable[["Graph"], Derived]) -> Callable[["Graph"], Derived]:
    """Computes `derive(graph)` once per graph object and remembers it while the graph lives. For facts
    that do not depend on a plan (the auto-tuner plans and simulates one graph dozens of times); the
    graph must not be edited afterwards, which holds once the passes have written their analyses."""
    results: "weakref.WeakKeyDictionary[Graph, Derived]" = weakref.WeakKeyDictionary()

    @functools.wraps(derive)
    def cached(graph: "Graph") -> Derived:
        if graph not in results:
            results[graph] = derive(graph)
        return results[graph]

    return cached


@once_per_graph
def order_positions(graph: Graph) -> dict[str, int]:
    """Each op's place in `graph.order` (asked for per tensor by the planners: built once per graph)."""
    return {name: position for position, name in enumerate(graph.order)}
