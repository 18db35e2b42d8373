"""The floor: memory no plan can go below at a size, from the traced step's own shapes.

Whatever is swapped, the op running at any moment needs all its inputs and its outputs on the device
together, and the weights and the optimizer's state (momentum, Adam's moments) stay there for the
whole step. So the floor at a size is the largest single op's working set (its distinct input and
output tensors, by the traced graph's shapes) plus the bytes of every model and optimizer variable.
Inputs that are variable reads (`ReadVariableOp`) are the weights themselves and are not counted
twice. Weight gradients and the allocator's fragmentation come on top of it in any real plan. One
way below it: a kernel that writes its output into an input's buffer (TensorFlow's AddN and some
element-wise gradients may) needs one tensor less than its inputs and outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

from lms_core.graph import Graph, split_tensor

VARIABLE_READS = frozenset({"ReadVariableOp"})
"""Ops whose output is a variable's value. (Captured variable handles are placeholders of resource
type, which have no size; the batch's placeholders do have one, and count.)"""


@dataclass
class Floor:
    op: str  # the op with the largest working set
    op_type: str
    working_set_bytes: int  # that op's distinct inputs and outputs
    weights_bytes: int  # every model variable (weights, batch-norm statistics)
    optimizer_bytes: int  # every optimizer variable (slots, step counter, learning rate)

    @property
    def total_bytes(self) -> int:
        return self.working_set_bytes + self.weights_bytes + self.optimizer_bytes

    def to_dict(self) -> dict:
        return {"op": self.op, "op_type": self.op_type, "working_set_bytes": self.working_set_bytes,
                "weights_bytes": self.weights_bytes, "optimizer_bytes": self.optimizer_bytes,
                "total_bytes": self.total_bytes}


def working_set(graph: Graph, name: str) -> int:
    """Bytes of op `name`'s distinct input tensors and its outputs. Variable reads are left out
    (counted with the weights)."""
    op = graph.ops[name]
    total = sum(t.nbytes or 0 for t in op.outputs)
    for tensor in dict.fromkeys(op.inputs):
        producer = graph.ops.get(split_tensor(tensor)[0])
        if producer is None or producer.type in VARIABLE_READS:
            continue
        total += graph.tensor(tensor).nbytes or 0
    return total


def largest_working_set(graph: Graph) -> tuple[str, int]:
    """(op name, bytes) of the op whose inputs and outputs together are largest; ties go to the
    first op in the graph's order, so the answer is deterministic."""
    best, best_bytes = "", -1
    for name in graph.order:
        if graph.ops[name].type in VARIABLE_READS:
            continue
        size = working_set(graph, name)
        if size > best_bytes:
            best, best_bytes = name, size
    return best, max(0, best_bytes)


def variables_bytes(variables) -> int:
    """Bytes of Keras or TensorFlow variables, from their shapes and dtypes (nothing is read)."""
    import tensorflow as tf

    total = 0
    for variable in variables:
        count = 1
        for dim in variable.shape:
            count *= int(dim)
        total += count * tf.as_dtype(variable.dtype).size
    return total


def step_floor(graph: Graph, weights_bytes: int, optimizer_bytes: int) -> Floor:
    name, size = largest_working_set(graph)
    return Floor(name, graph.ops[name].type if name else "", size, weights_bytes, optimizer_bytes)
