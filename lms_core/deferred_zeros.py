"""Gradient loops' zero initial values, made just before their loop (a lifetime-aware rewrite).

A gradient `While` starts some of its loop variables at zero: the sum of a weight's gradient over
the steps (TensorFlow's while_v2 makes `zeros(VariableShape(w))`), and the gradient of a forward loop
output that nothing downstream read, such as the encoder outputs an attention decoder's loop passes on
unchanged (`zeros(shape)` of a constant shape: at batch 6104 of the Seq2Seq recipe, five of them
hold 6.03 GiB, one per decoder loop). A `Fill` of constants depends on nothing the step computes,
so TensorFlow's executor, Grappler's scheduler and the simulator all make it when the step starts,
and it holds its bytes through the whole forward pass. A control edge from the gradient loop's
latest backward input (the op that lets the loop start, lms_core.planner's trigger rule) makes it
when that loop is about to need it. The values are the same; only when they exist changes.

`plan_deferred_zeros` finds them on the IR; the planner plans on the IR with the edges added
(lms_core.serialize's `with_control_edges`), lms_core.tf.apply adds them to the GraphDef, and
lms_core.tf.gating checks that each zero waits for its trigger in the partitions TensorFlow runs.
"""
from __future__ import annotations

from lms_core.graph import BACKWARD, Graph, tensor_name
from lms_core.loops import WHILE_TYPES
from lms_core.plan import ControlEdge
from lms_core.planner import constant_ops, latest_backward_input, no_trigger_ops

FILL_TYPES = frozenset({"Fill"})
# Inputs that make a zero no later than the step's start: a variable's shape needs only its handle.
SHAPE_OF_VARIABLE_TYPES = frozenset({"VariableShape"})


def plan_deferred_zeros(graph: Graph, min_bytes: int = 1) -> list[ControlEdge]:
    """For every `Fill` of at least `min_bytes` whose inputs are constants or variables' shapes and
    whose readers are one gradient loop, the edge that makes it wait for that loop's trigger; in
    graph order. `graph` needs categories and levels."""
    constants = constant_ops(graph)
    zeros = {}  # Fill -> the gradient loop that reads it
    for name in graph.order:
        op = graph[name]
        if op.type not in FILL_TYPES or op.region is not None or (op.outputs[0].nbytes or 0) < min_bytes:
            continue
        if not all(p in constants or graph[p].type in SHAPE_OF_VARIABLE_TYPES for p in graph.predecessors(op)):
            continue
        readers = {reader for reader, _ in graph.consumers(tensor_name(name, 0))}
        if len(readers) == 1:
            (loop,) = readers
            if graph[loop].type in WHILE_TYPES and graph[loop].category == BACKWARD:
                zeros[name] = loop
    # The trigger is found as a swap-in's is, but none of the zeros may be one: each is deferred itself.
    removed = no_trigger_ops(graph) | set(zeros)
    edges = []
    for name, loop in zeros.items():
        trigger = latest_backward_input(graph, loop, removed)
        if trigger is not None:
            edges.append(ControlEdge(before=trigger, after=name))
    return edges
