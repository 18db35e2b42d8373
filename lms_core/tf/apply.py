"""Apply a Plan to a GraphDef: add swap-out/swap-in Identity ops and reroute the far consumers.

Swap-out: an `Identity` on the host device reading the forward tensor, so the tensor is copied to
host memory and its device buffer can be freed once the near consumers are done. Swap-in: an
`Identity` on the compute device reading the swap-out, with a control input from its trigger so the
copy back waits until the backward pass is close to the consumers. Both carry
`_grappler_do_not_remove`, or Grappler's dependency optimizer folds them away as no-op Identities.
"""
from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2

from lms_core.plan import Plan

KEEP_ATTR = "_grappler_do_not_remove"


def graphdef_ref(tensor: str) -> str:
    """`op:0` -> `op`, `op:2` -> `op:2`: how GraphDef inputs name tensors."""
    op, _, index = tensor.rpartition(":")
    return op if index == "0" else tensor


def apply_plan(graph_def: graph_pb2.GraphDef, plan: Plan, compute_device: str, host_device: str) -> graph_pb2.GraphDef:
    """A new GraphDef with the plan's swaps; `graph_def` is left as it was."""
    result = graph_pb2.GraphDef()
    result.CopyFrom(graph_def)
    nodes = {node.name: node for node in result.node}
    added = []
    for swap in plan.swaps:
        source = graphdef_ref(swap.tensor)
        dtype = tf.as_dtype(swap.dtype).as_datatype_enum
        added.append(_identity(swap.swap_out, source, dtype, host_device, []))
        for swap_in in swap.swap_ins:
            added.append(_identity(swap_in.name, swap.swap_out, dtype, compute_device, [swap_in.trigger]))
            for consumer in swap_in.consumers:
                node = nodes[consumer]
                for position, name in enumerate(node.input):
                    if name == source:
                        node.input[position] = swap_in.name
            for waiter in swap_in.waiters:
                _add_control_input(nodes[waiter], swap_in.name)
        for waiter in swap.waiters:
            _add_control_input(nodes[waiter], swap.swap_out)
    result.node.extend(added)
    return result


def _identity(name: str, source: str, dtype: int, device: str, triggers: list[str]) -> node_def_pb2.NodeDef:
    node = node_def_pb2.NodeDef(name=name, op="Identity", device=device)
    node.input.append(source)
    node.input.extend(f"^{t}" for t in triggers)
    node.attr["T"].type = dtype
    node.attr[KEEP_ATTR].b = True
    return node


def _add_control_input(node: node_def_pb2.NodeDef, source: str) -> None:
    control = f"^{source}"
    if control not in node.input:
        node.input.append(control)  # control inputs follow the data inputs in a NodeDef
