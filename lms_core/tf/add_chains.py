"""Apply a plan's AddN chains (lms_core.add_chains) to a GraphDef.

The AddN's node becomes the chain's last `AddV2`, so it keeps its name and its readers; the adds
before it are new nodes on the AddN's device. Every node of a chain carries
`_grappler_do_not_remove`, a precaution: Grappler's arithmetic optimizer can fold a tree of adds
into one AddN (`AddOpsRewriteStage`), which would undo the chain, and it leaves preserved nodes
alone. (On the test's small graph it kept the chain with or without the attribute.)
"""
from __future__ import annotations

from tensorflow.core.framework import graph_pb2, node_def_pb2

from lms_core.plan import AddChain
from lms_core.tf.graphdef import KEEP_ATTR, graphdef_ref


def apply_add_chains(nodes: dict[str, node_def_pb2.NodeDef], graph_def: graph_pb2.GraphDef,
                     chains: list[AddChain]) -> None:
    """Rewrites each chain's AddN in `graph_def` (whose nodes by name are `nodes`), in place."""
    for chain in chains:
        add_n = nodes[chain.op]
        controls = [name for name in add_n.input if name.startswith("^")]
        partial = graphdef_ref(chain.inputs[0])
        for step, (name, term) in enumerate(zip(chain.adds, chain.inputs[1:])):
            node = graph_def.node.add()  # not append(): it stores a copy, and swaps and edges edit `nodes`
            node.CopyFrom(_add(name, partial, graphdef_ref(term), add_n, controls if step == 0 else []))
            nodes[name] = node
            partial = name
        last = _add(chain.op, partial, graphdef_ref(chain.inputs[-1]), add_n, [])
        add_n.CopyFrom(last)


def _add(name: str, left: str, right: str, add_n: node_def_pb2.NodeDef, controls: list[str]) -> node_def_pb2.NodeDef:
    node = node_def_pb2.NodeDef(name=name, op="AddV2", device=add_n.device)
    node.input.extend([left, right, *controls])
    node.attr["T"].CopyFrom(add_n.attr["T"])
    node.attr[KEEP_ATTR].b = True
    return node
