"""Which ops run inside TensorFlow v1 control flow (a while-loop frame or a cond branch).

TF2 steps use functional control flow (`StatelessIf`, `StatelessWhile`): their bodies are functions
the flat graph does not show, and the planner leaves the tensors those ops read or produce alone.
Graphs imported from TF1 code use v1 control flow instead, where a loop body or a branch is a set of
ordinary ops between `Enter`/`Switch` and `Exit`/`Merge`/`NextIteration`. A tensor there exists once
per iteration or only on the branch taken, and a control edge into or out of a frame is illegal, so
such ops are neither swapped, nor rerouted, nor used as swap-in triggers.

The region is over-approximated (any op both reachable from an entry and leading to an exit): a
missed swap costs memory, a wrong one could change numerics or fail to run.
"""
from __future__ import annotations

from lms_core.graph import Graph
from lms_core.passes import Pass

ENTRY_TYPES = frozenset({"Enter", "RefEnter", "Switch", "RefSwitch"})
EXIT_TYPES = frozenset({"Exit", "RefExit", "Merge", "RefMerge", "NextIteration", "RefNextIteration", "LoopCond"})
V1_CONTROL_FLOW_TYPES = ENTRY_TYPES | EXIT_TYPES


def mark_control_flow(graph: Graph) -> None:
    """Writes `Op.region`: the entry op (`"Enter while/Enter"`) of the v1 region an op runs in, or None."""
    flow = [name for name in graph.order if graph[name].type in V1_CONTROL_FLOW_TYPES]
    for op in graph.ops.values():
        op.region = None
    if not flow:
        return
    entries = {n for n in flow if graph[n].type in ENTRY_TYPES}
    exits = {n for n in flow if graph[n].type in EXIT_TYPES}
    inside = (_reachable(graph, entries, down=True) & _reachable(graph, exits, down=False)) | set(flow)
    # Label each op with the outermost region it is in (a predecessor's label, or its own when it
    # opens the region), for the plan's reasons.
    for name in graph.order:
        if name in inside:
            op = graph[name]
            op.region = next((graph[p].region for p in graph.predecessors(op) if graph[p].region),
                             f"{op.type} {name}")


def _reachable(graph: Graph, starts: set[str], down: bool) -> set[str]:
    seen: set[str] = set()
    stack = list(starts)
    while stack:
        name = stack.pop()
        for other in (graph.successors(name) if down else graph.predecessors(graph[name])):
            if other in graph.ops and other not in seen:
                seen.add(other)
                stack.append(other)
    return seen


MARK_CONTROL_FLOW = Pass("mark_control_flow", requires=frozenset(), ensures=frozenset({"region"}),
                         run=mark_control_flow)
