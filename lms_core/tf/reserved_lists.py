"""Apply a plan's unset zero lists (lms_core.reserved_lists) to a GraphDef.

The `ZerosLike` node becomes a `TensorListReserve` under the same name, so the gradient loop reads
it unchanged; its element shape and length come from two new nodes that read the forward list
(`TensorListElementShape`, `TensorListLength`) and run as soon as it exists, as the `ZerosLike` did,
so the forward list is not kept any longer. On a GPU all three have kernels that keep the shape and
length in host memory. All carry `_grappler_do_not_remove`, a precaution like the AddN chains'.
"""
from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2

from lms_core.plan import ReservedList
from lms_core.reserved_lists import RESERVE_TYPE
from lms_core.tf.graphdef import KEEP_ATTR, graphdef_ref


def element_shape_name(entry: ReservedList) -> str:
    return f"{entry.op}/element_shape"


def length_name(entry: ReservedList) -> str:
    return f"{entry.op}/num_elements"


def apply_reserved_lists(nodes: dict[str, node_def_pb2.NodeDef], graph_def: graph_pb2.GraphDef,
                         entries: list[ReservedList]) -> None:
    """Rewrites each entry's `ZerosLike` in `graph_def` (whose nodes by name are `nodes`), in place."""
    for entry in entries:
        zeros = nodes[entry.op]
        source = graphdef_ref(entry.source)
        shape = _node(element_shape_name(entry), "TensorListElementShape", zeros.device, [source])
        shape.attr["shape_type"].type = tf.int32.as_datatype_enum
        length = _node(length_name(entry), "TensorListLength", zeros.device, [source])
        controls = [name for name in zeros.input if name.startswith("^")]
        reserve = _node(entry.op, RESERVE_TYPE, zeros.device, [shape.name, length.name, *controls])
        reserve.attr["element_dtype"].type = tf.as_dtype(entry.element_dtype).as_datatype_enum
        reserve.attr["shape_type"].type = tf.int32.as_datatype_enum
        zeros.CopyFrom(reserve)
        graph_def.node.extend([shape, length])
        nodes[shape.name], nodes[length.name] = shape, length


def _node(name: str, op: str, device: str, inputs: list[str]) -> node_def_pb2.NodeDef:
    node = node_def_pb2.NodeDef(name=name, op=op, device=device)
    node.input.extend(inputs)
    node.attr[KEEP_ATTR].b = True
    return node
