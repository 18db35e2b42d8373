"""Order the backward pass where a scheduler of ready ops would hold more memory than it needs: run
its branches one after another where they join (TFLMS v2's `serialization`, placed by structure
instead of by level), and run each convolution's filter gradient before its input gradient.

Where the forward pass forks (a ResNet block's main path and its shortcut; the three terms of a
batch-norm gradient), the backward pass computes one gradient per branch and sums them at a join
(`AddN`, `Add`). A scheduler that runs whatever is ready (TensorFlow's executor, Grappler's) works
on all branches at once, and every branch's temporaries are resident together: on ResNet-50 at
batch 512 the peak held the backward chains of two batch norms at once, eight 1.53 GiB
temporaries. Running the branches in turn, the heavier first, keeps one branch's temporaries at a
time, plus the finished branches' results. It is enforced with control edges: every op that starts
a branch (one with no predecessor inside it) waits for the op that finished the branch before.

A branch of a join's input is the backward ops that input depends on and no other input of the join
does (its exclusive ancestors, within the backward ops downstream of the forward pass). No branch
start can be an ancestor of the op it is made to wait for, and each edge is checked against the edges
added before it, so the result has no cycle.
"""
from __future__ import annotations

from lms_core.graph import BACKWARD, FORWARD, Graph, Op, split_tensor
from lms_core.passes.pipeline import analyze
from lms_core.plan import ControlEdge
from lms_core.planner import SHAPE_ONLY_TYPES

JOIN_TYPES = frozenset({"AddN", "AddV2", "Add"})
# A convolution's two gradients read the same output gradient; the filter gradient also reads the
# layer's input (often swapped back in for it), the input gradient allocates a tensor as large as it.
FILTER_GRADIENTS = frozenset({"Conv2DBackpropFilter", "Conv3DBackpropFilterV2", "Conv3DBackpropFilter",
                              "DepthwiseConv2dNativeBackpropFilter"})
INPUT_GRADIENTS = frozenset({"Conv2DBackpropInput", "Conv3DBackpropInputV2", "Conv3DBackpropInput",
                             "DepthwiseConv2dNativeBackpropInput"})


def order_edges(graph: Graph, min_bytes: int = 1) -> list[ControlEdge]:
    """Every control edge that orders the backward pass: the branches of each join, then each
    convolution's filter gradient before its input gradient. `graph` carries categories."""
    region = backward_region(graph)
    preds = {name: [p for p in graph.predecessors(graph[name]) if p in region] for name in region}
    edges = branch_edges(graph, min_bytes, region, preds)
    return edges + filter_gradients_first(graph, region, preds)


def filter_gradients_first(graph: Graph, region: set[str], preds: dict[str, list[str]]) -> list[ControlEdge]:
    """A convolution's input gradient waits for its filter gradient (the two read the same output
    gradient): the filter gradient releases the layer's input, which may have been swapped back in
    for it, before the input gradient allocates a tensor as large. A scheduler of ready ops is free
    to run them either way: TensorFlow's executor and Grappler's do not agree."""
    edges = []
    for name in (n for n in graph.order if n in region and graph[n].type in INPUT_GRADIENTS):
        gradient = graph[name].inputs[-1]  # the output gradient is the last input of both
        sibling = next((c for c, _ in graph.consumers(gradient)
                        if c in region and graph[c].type in FILTER_GRADIENTS and graph[c].inputs[-1] == gradient), None)
        if sibling is not None and name not in _ancestors(sibling, preds):
            edges.append(ControlEdge(before=sibling, after=name))
            preds[name].append(sibling)
    return edges


def branch_edges(graph: Graph, min_bytes: int = 1, region: set[str] | None = None,
                 preds: dict[str, list[str]] | None = None) -> list[ControlEdge]:
    """The control edges that serialize the branches of every backward join of at least two inputs
    of `min_bytes` or more. `graph` carries categories; `preds` (backward predecessors within the
    region) gains the edges as they are made."""
    region = backward_region(graph) if region is None else region
    if preds is None:
        preds = {name: [p for p in graph.predecessors(graph[name]) if p in region] for name in region}
    edges: list[ControlEdge] = []
    for join in (n for n in graph.order if n in region and graph[n].type in JOIN_TYPES):
        producers = list(dict.fromkeys(
            split_tensor(t)[0] for t in graph[join].inputs
            if split_tensor(t)[0] in region and (graph.tensor(t).nbytes or 0) >= min_bytes))
        if len(producers) < 2:
            continue
        ancestors = {p: _ancestors(p, preds) for p in producers}
        exclusive = {p: ancestors[p] - set().union(*(ancestors[q] for q in producers if q != p)) for p in producers}
        weight = {p: sum(info.nbytes or 0 for n in exclusive[p] for info in graph[n].outputs) for p in producers}
        ordered = sorted(producers, key=lambda p: (-weight[p], p))
        for finished, following in zip(ordered, ordered[1:]):
            before = _ancestors(finished, preds)
            for start in sorted(n for n in exclusive[following] if not any(p in exclusive[following] for p in preds[n])):
                if start not in before:  # else the edge would close a cycle through edges added earlier
                    edges.append(ControlEdge(before=finished, after=start))
                    preds[start].append(finished)
    return edges


def backward_region(graph: Graph) -> set[str]:
    """Backward ops that depend on the forward pass (not shape or constant arithmetic, which Grappler
    folds away, and which may run early without holding anything)."""
    region: set[str] = set()
    for name in graph.order:
        op = graph[name]
        if op.category != BACKWARD or op.type in SHAPE_ONLY_TYPES:
            continue
        if any(p in region or graph[p].category == FORWARD for p in graph.predecessors(op)):
            region.add(name)
    return region


def with_control_edges(graph: Graph, edges: list[ControlEdge]) -> Graph:
    """A new, analysed IR of `graph` with `edges` added as control inputs."""
    added: dict[str, list[str]] = {}
    for edge in edges:
        added.setdefault(edge.after, []).append(edge.before)
    ops = []
    for op in graph.ops.values():  # in the original order, which breaks the schedulers' ties
        name = op.name
        controls = list(op.control_inputs) + [c for c in added.get(name, []) if c not in op.control_inputs]
        ops.append(Op(op.name, op.type, op.device, list(op.inputs), controls, list(op.outputs)))
    return analyze(Graph(ops, graph.outputs))


def _ancestors(start: str, preds: dict[str, list[str]]) -> set[str]:
    seen = {start}
    stack = [start]
    while stack:
        for p in preds[stack.pop()]:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen
