"""Apply a plan's recomputes (lms_core.recompute) to a GraphDef.

Each entry's ops are copied under the clone names the plan gives them, attributes and device as the
original's: their inputs from inside the segment read the other clones, the rest read the anchors
(the original tensors). Every clone waits for the entry's trigger by a control input, and the
tensor's backward readers read its clone. Clones and triggers carry `_grappler_do_not_remove`:
Grappler's dependency optimizer would otherwise fold a clone into its original (the same op on the
same inputs), and the trigger must keep its name for the control edge to mean anything.
lms_core.tf.gating checks on the executed graph that every clone waits for its trigger.
"""
from __future__ import annotations

from tensorflow.core.framework import graph_pb2, node_def_pb2

from lms_core.plan import Recompute
from lms_core.tf.graphdef import KEEP_ATTR, graphdef_ref


def apply_recomputes(nodes: dict[str, node_def_pb2.NodeDef], graph_def: graph_pb2.GraphDef,
                     recomputes: list[Recompute]) -> None:
    """Adds each entry's clones to `graph_def` (whose nodes by name are `nodes`) and reroutes its
    backward readers, in place."""
    for entry in recomputes:
        clones = dict(zip(entry.ops, entry.clones))
        for name, clone in entry.made():
            # `add()` and a copy into it, not `append(node)`: append stores a copy, and the swaps and
            # edges applied after this must edit the node the GraphDef holds (a swap-in a clone
            # reads, planned on the step with the clones, was otherwise never read by it).
            node = graph_def.node.add()
            node.CopyFrom(_clone(nodes[name], clone, clones, entry.trigger))
            nodes[node.name] = node
        nodes[entry.trigger].attr[KEEP_ATTR].b = True
        original, clone = graphdef_ref(entry.tensor), graphdef_ref(_cloned(entry.tensor, clones))
        for consumer in entry.consumers:
            node = nodes[consumer]
            for position, name in enumerate(node.input):
                if name == original:
                    node.input[position] = clone


def _clone(original: node_def_pb2.NodeDef, name: str, clones: dict[str, str], trigger: str) -> node_def_pb2.NodeDef:
    node = node_def_pb2.NodeDef()
    node.CopyFrom(original)
    node.name = name
    del node.input[:]
    for source in original.input:
        if source.startswith("^"):
            continue  # the original's control inputs ran in the forward pass; the clone waits for the trigger
        node.input.append(graphdef_ref(_cloned(_tensor(source), clones)))
    node.input.append(f"^{trigger}")
    node.attr[KEEP_ATTR].b = True
    return node


def _tensor(graphdef_input: str) -> str:
    """`op` -> `op:0`, `op:2` -> `op:2`: a GraphDef input as a tensor name."""
    return graphdef_input if ":" in graphdef_input else f"{graphdef_input}:0"


def _cloned(tensor: str, clones: dict[str, str]) -> str:
    op, _, index = tensor.rpartition(":")
    return f"{clones[op]}:{index}" if op in clones else tensor
