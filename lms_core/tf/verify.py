"""Do a plan's swaps survive TensorFlow's own graph optimization? (Whether they are gated in what
TensorFlow executes is lms_core.tf.gating's question.)

Grappler runs before every function call (constant folding, arithmetic and dependency optimizers,
remapping). A swap-out or swap-in `Identity` looks like a no-op to it; the rewrite marks them with
`_grappler_do_not_remove`, and this check runs Grappler's default configuration offline on the
rewritten graph and lists what, if anything, did not survive.
"""
from __future__ import annotations

from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
from tensorflow.python.grappler import tf_optimizer


def grappler_losses(rewritten) -> list[str]:
    """Swap ops, trigger control inputs and rerouted consumer inputs of `rewritten` (a
    lms_core.tf.rewrite result) that Grappler's default optimization removed; [] when all survive.
    A consumer Grappler fused away is no loss; a consumer that reads the original tensor again is."""
    concrete = rewritten.concrete
    metagraph = meta_graph_pb2.MetaGraphDef(graph_def=rewritten.graph_def)
    fetches = [t.name.rpartition(":")[0] for t in concrete.graph.outputs]
    fetches += sorted(op.name for op in concrete.graph.control_outputs)
    metagraph.collection_def["train_op"].node_list.value.extend(fetches)
    optimized = {n.name: n for n in tf_optimizer.OptimizeGraph(config_pb2.ConfigProto(), metagraph).node}
    lost = []
    for swap in rewritten.plan.swaps:
        if swap.swap_out not in optimized:
            lost.append(f"{swap.swap_out}: removed")
        for swap_in in swap.swap_ins:
            gate = optimized.get(swap_in.name)
            if gate is None:
                lost.append(f"{swap_in.name}: removed")
            else:
                if not gate.input or gate.input[0] != swap.swap_out:
                    lost.append(f"{swap_in.name}: no longer reads {swap.swap_out}")
                if f"^{swap_in.trigger}" not in gate.input:
                    lost.append(f"{swap_in.name}: lost its control input from {swap_in.trigger}")
            if swap_in.arrival:
                arrival = optimized.get(swap_in.arrival)
                if arrival is None:
                    lost.append(f"{swap_in.arrival}: removed")
                elif not arrival.input or arrival.input[0] != swap_in.name:
                    lost.append(f"{swap_in.arrival}: no longer reads {swap_in.name}")
            for consumer in swap_in.consumers:
                if consumer in optimized and swap_in.name not in optimized[consumer].input:
                    lost.append(f"{consumer}: no longer reads {swap_in.name}")
    lost += [f"{edge.after}: no longer waits for {edge.before}" for edge in rewritten.plan.control_edges
             if edge.after in optimized and edge.before in optimized
             and not _waits_for(optimized, edge.after, edge.before)]
    return lost


def _waits_for(nodes: dict, after: str, before: str) -> bool:
    """Whether `after` runs after `before` in `nodes` (a control or data path), which is what the edge
    ensures: Grappler may drop a control edge that another path already implies."""
    seen, stack = {after}, [after]
    while stack:
        for reference in nodes[stack.pop()].input:
            source = reference.lstrip("^").split(":")[0]
            if source == before:
                return True
            if source in nodes and source not in seen:
                seen.add(source)
                stack.append(source)
    return False
