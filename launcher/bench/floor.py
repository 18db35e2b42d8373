"""The floor: memory no plan can go below at a size, from the traced step's own shapes.

Whatever is swapped, the op running at any moment needs all its inputs and its outputs on the device
together, and the weights and the optimizer's state (momentum, Adam's moments) stay there for the
whole step. So the floor at a size is the largest single op's working set (its distinct input and
output tensors, by the traced graph's shapes; lms_core.working_set) plus the bytes of every model
and optimizer variable. Inputs that are variable reads (`ReadVariableOp`) are the weights themselves
and are not counted twice; an op that only aliases its input (a `Reshape`) counts the tensor once.
Weight gradients and the allocator's fragmentation come on top of it in any real plan.

It is a floor for plans of swaps on the graph as traced. Rewriting the op that sets it lowers it:
`floor_after_rewrites` is the floor of the step with the floor-lowering rewrites a plan can make
(lms_core.add_chains: the AddNs that set it computed as chains of two-input adds). One way below
both: a kernel that writes its output into an input's buffer (TensorFlow's element-wise kernels may)
needs one tensor less than its inputs and outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

from lms_core.add_chains import plan_add_chains, with_add_chains
from lms_core.graph import Graph
from lms_core.working_set import VARIABLE_READS, largest_working_set, working_set

__all__ = ["Floor", "VARIABLE_READS", "floor_after_rewrites", "largest_working_set", "step_floor", "variables_bytes",
           "working_set"]


@dataclass
class Floor:
    op: str  # the op with the largest working set
    op_type: str
    working_set_bytes: int  # that op's distinct inputs and outputs
    weights_bytes: int  # every model variable (weights, batch-norm statistics)
    optimizer_bytes: int  # every optimizer variable (slots, step counter, learning rate)
    add_chains: int = 0  # AddNs computed as chains of adds in the graph this is the floor of

    @property
    def total_bytes(self) -> int:
        return self.working_set_bytes + self.weights_bytes + self.optimizer_bytes

    def to_dict(self) -> dict:
        return {"op": self.op, "op_type": self.op_type, "working_set_bytes": self.working_set_bytes,
                "weights_bytes": self.weights_bytes, "optimizer_bytes": self.optimizer_bytes,
                "add_chains": self.add_chains, "total_bytes": self.total_bytes}


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


def step_floor(graph: Graph, weights_bytes: int, optimizer_bytes: int, add_chains: int = 0) -> Floor:
    name, size = largest_working_set(graph)
    return Floor(name, graph.ops[name].type if name else "", size, weights_bytes, optimizer_bytes, add_chains)


def floor_after_rewrites(graph: Graph, weights_bytes: int, optimizer_bytes: int) -> Floor:
    """The floor of `graph` with the floor-lowering rewrites applied (lms_core.add_chains)."""
    chains = plan_add_chains(graph)
    return step_floor(with_add_chains(graph, chains), weights_bytes, optimizer_bytes, len(chains))
