"""Categorized topological ordering (Le et al., ISMM 2019): a level per op.

An op's level is one more than the highest level among its predecessors (data and control), so
levels strictly increase along every edge; the categories then order the phases: no backward op
sits at or below the last level of the forward pass (a gradient op that needs only constants would
otherwise land at level 1 and make every distance to it meaningless). The distance between a
tensor's producer and a consumer is their level difference: how long, in steps of the schedule, the
tensor would otherwise stay in device memory.

The forward pass ends with the last forward op that does not wait for a later phase. The step's
output op is forward (it is the loss) but waits, through control edges, for every update; counting
it would open a gap of the whole backward pass's depth between the phases and stretch every
forward-to-backward distance by it.
"""
from __future__ import annotations

from lms_core.graph import BACKWARD, FORWARD, UPDATE, Graph
from lms_core.passes import Pass


def assign_levels(graph: Graph) -> None:
    ops = graph.ops
    later = set()  # backward and update ops, and everything that waits for one of them
    for name in graph.order:
        op = ops[name]
        if op.category in (BACKWARD, UPDATE) or any(p in later for p in graph.predecessors(op)):
            later.add(name)
    last_forward = -1
    for name in graph.order:
        op = ops[name]
        op.level = 1 + max((ops[p].level for p in graph.predecessors(op) if p in ops), default=-1)
        if op.category == FORWARD and name not in later:
            last_forward = max(last_forward, op.level)
    # Then push backward ops past the forward phase, re-propagating so every edge still climbs.
    for name in graph.order:
        op = ops[name]
        level = 1 + max((ops[p].level for p in graph.predecessors(op) if p in ops), default=-1)
        if op.category == BACKWARD:
            level = max(level, last_forward + 1)
        op.level = level


ASSIGN_LEVELS = Pass("assign_levels", requires=frozenset({"category"}), ensures=frozenset({"level"}),
                     run=assign_levels)
