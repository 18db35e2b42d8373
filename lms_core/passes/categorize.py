"""Op categories: forward, backward, update, other (Le et al. ISMM 2019, "categorized" ordering).

Derived from the graph's structure; names are only a hint that can add backward ops, never the sole
signal:
- forward: the ops the step's outputs (the loss) depend on through data edges;
- update: variable writes and collectives (Horovod allreduce, NCCL, collective ops), every op after a
  collective, and the optimizer's arithmetic: the ops on the way to a write that descend from a read
  of optimizer state (a variable the forward pass does not read: slots, the learning rate, the step
  counter, batch-norm moving statistics), or that lead to state writes only (moving averages);
- backward: the ops between the forward pass and the weight updates (they descend from forward ops
  and lead to a write of a variable the forward pass reads, or to a collective), plus, as a hint, the
  ops TensorFlow's gradient machinery puts under `gradient_tape/` or `gradients/` (which also covers
  gradients nobody consumes, and keeps a loss-scaled backward pass from looking like optimizer math);
- other: inputs, constants, variable handles, and what belongs to none of the above.

Without the hint the rule reproduces the hinted categories of every op that does data work on
ResNet-50, a 3D U-Net, a DenseNet block and a Transformer block (tests/test_lms_categories.py strips
the gradient scope from the names to check this).
"""
from __future__ import annotations

from lms_core.graph import BACKWARD, FORWARD, OTHER, UPDATE, Graph, split_tensor
from lms_core.passes import Pass

GRADIENT_SCOPES = ("gradient_tape", "gradients")
SOURCE_TYPES = {"Placeholder", "Const", "VarHandleOp", "VariableV2", "_Arg", "NoOp"}
VARIABLE_READ_TYPES = {"ReadVariableOp", "ResourceGather", "ResourceGatherNd"}
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
    is_source = lambda name: ops[name].type in SOURCE_TYPES  # noqa: E731

    forward = {n for n in _ancestors_by_data(graph, [split_tensor(t)[0] for t in graph.outputs]) if not is_source(n)}
    writes = {n for n in order if is_variable_write(ops[n].type)}
    collectives = {n for n in order if is_collective(ops[n].type)}
    reads = {n for n in order if ops[n].type in VARIABLE_READ_TYPES}
    # Weights are the variables the forward pass reads; the others are optimizer state.
    weights = {_handle(graph, n) for n in reads & forward}
    weight_writes = {n for n in writes if _handle(graph, n) in weights}
    state_reads = reads - forward

    leads_to_update = _reachable(graph, writes | collectives, forward_direction=False)
    leads_to_weights = _reachable(graph, weight_writes | collectives, forward_direction=False)
    hinted: set[str] = set()
    seeds = {n for n in order if in_gradient_scope(n) and n not in forward and not is_source(n)}
    if seeds:  # gradient ops nothing consumes, and every op between two gradient ops
        hinted = seeds | (_reachable(graph, seeds, True) & _reachable(graph, seeds, False))

    optimizer_math = (_reachable(graph, state_reads, forward_direction=True) | state_reads) & leads_to_update
    state_only = leads_to_update - leads_to_weights  # on the way to state writes alone (moving averages)
    update = writes | collectives | _reachable(graph, collectives, forward_direction=True)
    update |= (optimizer_math | state_only) - hinted
    update = {n for n in update if not is_source(n)} - forward

    backward = (_reachable(graph, forward, forward_direction=True) & leads_to_weights) | hinted
    backward = {n for n in backward if not is_source(n)} - forward - update

    for name in order:
        if name in forward:
            ops[name].category = FORWARD
        elif name in backward:
            ops[name].category = BACKWARD
        elif name in update:
            ops[name].category = UPDATE
        else:
            ops[name].category = OTHER


def _handle(graph: Graph, op_name: str) -> str | None:
    """The op producing the resource handle a variable read or write acts on (its first input)."""
    inputs = graph.ops[op_name].inputs
    return split_tensor(inputs[0])[0] if inputs else None


def _ancestors_by_data(graph: Graph, starts: list[str]) -> set[str]:
    seen, stack = set(), [s for s in starts if s in graph.ops]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        # Back edges included: a v1 loop body runs before the loop's exit, so the loss depends on it.
        stack.extend(split_tensor(t)[0] for t in graph.ops[name].inputs if split_tensor(t)[0] in graph.ops)
    return seen


def _reachable(graph: Graph, starts: set[str], forward_direction: bool) -> set[str]:
    """Ops reachable from `starts` (excluded unless reached again) along data and control edges."""
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
