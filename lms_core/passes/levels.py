"""Categorized topological ordering (Le et al., ISMM 2019): a level per op.

An op's level is one more than the highest level among its predecessors (data and control), so
levels strictly increase along every edge; the categories then order the phases: no backward op
sits at or below the last forward level (a gradient op that needs only constants would otherwise
land at level 1 and make every distance to it meaningless). The distance between a tensor's producer and a consumer is their level difference: how
long, in steps of the schedule, the tensor would otherwise stay in device memory.
"""
from __future__ import annotations

from lms_core.graph import BACKWARD, FORWARD, Graph
from lms_core.passes import Pass


def assign_levels(graph: Graph) -> None:
    ops = graph.ops
    last_forward = -1
    # Forward first: their levels do not depend on anything later in the step.
    for name in graph.order:
        op = ops[name]
        op.level = 1 + max((ops[p].level for p in graph.predecessors(op) if p in ops and ops[p].level is not None),
                           default=-1)
        if op.category == FORWARD:
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
