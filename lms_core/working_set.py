"""An op's working set: the bytes that must be on the device together while it runs.

An op needs its distinct input tensors and its outputs at once. Two exceptions: an input that is a
variable read (`ReadVariableOp`) is the weight itself, counted with the variables, not per op; and
an op that only aliases its input (a `Reshape`, an `Identity`: TensorFlow's kernel hands the input's
buffer on as the output) needs no buffer for its output, so the tensor counts once.
"""
from __future__ import annotations

from lms_core.graph import Graph, split_tensor

VARIABLE_READS = frozenset({"ReadVariableOp"})
"""Ops whose output is a variable's value. (Captured variable handles are placeholders of resource
type, which have no size; the batch's placeholders do have one, and count.)"""

ALIASING_TYPES = frozenset({"Reshape", "Identity", "Squeeze", "ExpandDims", "StopGradient", "PreventGradient",
                            "EnsureShape", "Snapshot"})
"""Ops whose output is their first input's buffer: TensorFlow's kernels for these forward the input
tensor (`ctx->set_output(0, input)` or `CopyFrom` with a new shape), allocating nothing. (`Snapshot`
copies only when the input's buffer is shared, which the floor's single-op view cannot see.)"""


def working_set(graph: Graph, name: str) -> int:
    """Bytes of op `name`'s distinct input tensors and of its outputs, the output of an aliasing op
    left out (it is its input's buffer). Variable reads are left out (counted with the weights)."""
    op = graph.ops[name]
    total = 0 if op.type in ALIASING_TYPES else sum(t.nbytes or 0 for t in op.outputs)
    for tensor in dict.fromkeys(op.inputs):
        producer = graph.ops.get(split_tensor(tensor)[0])
        if producer is None or producer.type in VARIABLE_READS:
            continue
        total += graph.tensor(tensor).nbytes or 0
    return total


def largest_working_set(graph: Graph, leave_out: frozenset[str] = frozenset()) -> tuple[str, int]:
    """(op name, bytes) of the op whose working set is largest, ops in `leave_out` not considered;
    ties go to the first op in the graph's order, so the answer is deterministic."""
    best, best_bytes = "", -1
    for name in graph.order:
        if graph.ops[name].type in VARIABLE_READS or name in leave_out:
            continue
        size = working_set(graph, name)
        if size > best_bytes:
            best, best_bytes = name, size
    return best, max(0, best_bytes)
