"""Op categories: forward, backward, update, other (Le et al. ISMM 2019, "categorized" ordering).

From structure first, with one framework hint:
- forward: ops the step's outputs (the loss) depend on through data edges;
- backward: ops TensorFlow's gradient machinery made (the `gradient_tape/` or `gradients/` name scope
  of tf.GradientTape / tf.gradients, not any model's names), plus every op that lies between two of
  them (gradient sums such as `AddN` are created outside that scope). Without such a scope, every op
  that consumes forward tensors and leads to a variable update is backward;
- update: variable writes, collectives (Horovod allreduce, NCCL), everything after a collective, and
  every other op on the way to a write (optimizer arithmetic, batch-norm moving averages);
- other: inputs, constants, variable handles, and what belongs to none of the above.
"""
from __future__ import annotations

from lms_core.graph import BACKWARD, FORWARD, OTHER, UPDATE, Graph, split_tensor
from lms_core.passes import Pass

GRADIENT_SCOPES = ("gradient_tape", "gradients")
SOURCE_TYPES = {"Placeholder", "Const", "VarHandleOp", "VariableV2", "_Arg", "NoOp"}
VARIABLE_WRITE_TYPES = {"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "Assign", "AssignAdd",
                        "AssignSub", "ResourceScatterAdd", "ResourceScatterUpdate", "ResourceScatterSub"}
COLLECTIVE_PREFIXES = ("Horovod", "CollectiveReduce", "CollectiveGather", "CollectiveBcast", "NcclAllReduce")


def is_variable_write(op_type: str) -> bool:
    return op_type in VARIABLE_WRITE_TYPES or op_type.startswith("ResourceApply")


def is_collective(op_type: str) -> bool:
    return op_type.startswith(COLLECTIVE_PREFIXES)


def in_gradient_scope(name: str) -> bool:
    return any(part in GRADIENT_SCOPES for part in name.split("/")[:-1])


def categorize(graph: Graph) -> None:
    ops = graph.ops
    order = graph.order

    forward = _ancestors_by_data(graph, [split_tensor(t)[0] for t in graph.outputs])
    forward = {name for name in forward if ops[name].type not in SOURCE_TYPES}

    seeds = {name for name in order if in_gradient_scope(name) and name not in forward}
    if seeds:
        after_seed = _reachable(graph, seeds, forward_direction=True)
        before_seed = _reachable(graph, seeds, forward_direction=False)
        backward = (seeds | (after_seed & before_seed)) - forward
    else:
        # No gradient scope (a hand-built or renamed graph): backward is what consumes forward
        # tensors on the way to a variable write.
        writes = {n for n in order if is_variable_write(ops[n].type)}
        backward = (_reachable(graph, forward, True) & _reachable(graph, writes, False)) - forward - writes

    collectives = {n for n in order if is_collective(ops[n].type)}
    after_collectives = _reachable(graph, collectives, forward_direction=True)
    backward -= collectives | after_collectives
    writes = {n for n in order if is_variable_write(ops[n].type)}
    feeds_writes = {n for n in _reachable(graph, writes | collectives, forward_direction=False)
                    if ops[n].type not in SOURCE_TYPES}
    update = (collectives | after_collectives | writes | feeds_writes) - forward - backward

    for name in order:
        if name in forward:
            ops[name].category = FORWARD
        elif name in backward:
            ops[name].category = BACKWARD
        elif name in update:
            ops[name].category = UPDATE
        else:
            ops[name].category = OTHER


def _ancestors_by_data(graph: Graph, starts: list[str]) -> set[str]:
    seen, stack = set(), [s for s in starts if s in graph.ops]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        stack.extend(split_tensor(t)[0] for t in graph.ops[name].inputs)
    return seen


def _reachable(graph: Graph, starts: set[str], forward_direction: bool) -> set[str]:
    """Ops reachable from `starts` (excluded) along data and control edges, down or up."""
    seen: set[str] = set()
    stack = list(starts)
    while stack:
        name = stack.pop()
        nexts = graph.successors(name) if forward_direction else graph.predecessors(graph.ops[name])
        for other in nexts:
            if other in graph.ops and other not in seen:
                seen.add(other)
                stack.append(other)
    return seen


CATEGORIZE = Pass("categorize", requires=frozenset(), ensures=frozenset({"category"}), run=categorize)
