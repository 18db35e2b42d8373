"""Floor-lowering rewrite: an AddN as a chain of two-input adds.

No plan of swaps can go below the largest op's working set: whatever is parked in host memory, the
op running needs its inputs and outputs on the device together (launcher/bench/floor.py). On
ResNet-50 at large batches that op is an AddN of three stem-sized batch-norm gradient terms: four
tensors of 3.95 GiB live at once at batch 1321. Summed as `((x1 + x2) + x3)`, in the order the
terms are produced, each add needs three tensors, and each term can be freed once it is added; the
AddN's readers read the last add, which keeps the AddN's name.

Which AddNs: those whose working set is larger than that of every op the rewrite leaves alone, the
ones that set the floor. An AddN below that bound is kept: it is one kernel reading each input once,
where a chain of n - 1 adds reads and writes the partial sum n - 2 more times, and chaining it would
lower nothing that bounds a plan.

`with_add_chains` applies the chains to the IR (for the planner, the simulator and the floor), and
lms_core.tf.apply applies the same entries to the GraphDef TensorFlow runs.
"""
from __future__ import annotations

from lms_core.graph import Graph, Op, TensorInfo, order_positions, split_tensor
from lms_core.passes.pipeline import analyze
from lms_core.plan import AddChain
from lms_core.working_set import largest_working_set, working_set

CHAIN_ADD_TYPE = "AddV2"
MIN_CHAINED_INPUTS = 3  # an AddN of two inputs already is one two-input add


def chain_add_name(add_n: str, step: int) -> str:
    """The name of the chain's `step`-th add (from 0) before its last, which keeps the AddN's name."""
    return f"lms/addchain_{add_n}_{step}"


def chainable(graph: Graph, op: Op) -> bool:
    """An AddN of at least three inputs of known size, outside v1 control flow (a frame's ops must
    stay in it, and the rewrite does not reach into loops)."""
    return (op.type == "AddN" and len(op.inputs) >= MIN_CHAINED_INPUTS and op.region is None
            and op.outputs[0].nbytes is not None)


def plan_add_chains(graph: Graph) -> list[AddChain]:
    """The chains for every chainable AddN whose working set is above the largest working set of
    the ops the rewrite leaves alone, in graph order."""
    candidates = [name for name in graph.order if chainable(graph, graph[name])]
    _, bound = largest_working_set(graph, leave_out=frozenset(candidates))
    return [add_chain(graph, name) for name in candidates if working_set(graph, name) > bound]


def add_chain(graph: Graph, name: str) -> AddChain:
    """The chain for AddN `name`: its inputs in the order they are produced (a stable sort by the
    producer's place in the topological order, so each add runs as soon as its term exists)."""
    op = graph[name]
    position = order_positions(graph)
    inputs = sorted(op.inputs, key=lambda tensor: position[split_tensor(tensor)[0]])
    output = op.outputs[0]
    steps = [inputs[:2]] + [[None, tensor] for tensor in inputs[2:]]
    chain_bytes = max(len(set(pair)) * output.nbytes + output.nbytes for pair in steps)
    return AddChain(op=name, inputs=inputs, adds=[chain_add_name(name, step) for step in range(len(inputs) - 2)],
                    dtype=output.dtype, nbytes=output.nbytes, working_set_bytes=working_set(graph, name),
                    chain_working_set_bytes=chain_bytes)


def chain_ops(add_n: Op, chain: AddChain) -> list[Op]:
    """The chain's adds as IR ops: the first adds the first two inputs and waits for the AddN's
    control inputs; every later one adds the next input to the partial sum; the last is `add_n`."""
    names = chain.adds + [add_n.name]
    ops, partial = [], chain.inputs[0]
    for step, (name, term) in enumerate(zip(names, chain.inputs[1:])):
        output = TensorInfo(add_n.outputs[0].shape, add_n.outputs[0].dtype, add_n.outputs[0].nbytes)
        ops.append(Op(name, CHAIN_ADD_TYPE, add_n.device, [partial, term],
                      list(add_n.control_inputs) if step == 0 else [], [output]))
        partial = f"{name}:0"
    return ops


def with_add_chains(graph: Graph, chains: list[AddChain]) -> Graph:
    """`graph` with each chain's AddN replaced by its adds: a new IR, analysed when `graph` was.
    Chains already applied are left as they are, so `graph` itself comes back when none is left."""
    pending = {chain.op: chain for chain in chains if graph.ops[chain.op].type == "AddN"}
    if not pending:
        return graph
    ops = []
    for op in graph.ops.values():  # in the original order, which breaks the schedulers' ties
        if op.name in pending:
            ops.extend(chain_ops(op, pending[op.name]))
        else:
            ops.append(Op(op.name, op.type, op.device, list(op.inputs), list(op.control_inputs), list(op.outputs)))
    rewritten = Graph(ops, graph.outputs)
    return analyze(rewritten) if graph.analyses else rewritten
