"""Trace a tf.function training step and describe its graph in the lms_core IR."""
from __future__ import annotations

import tensorflow as tf

from lms_core.graph import Graph, Op, TensorInfo


def trace(step, *input_specs: tf.TensorSpec):
    """The step's ConcreteFunction for these input shapes (forward, backward, updates and collectives
    all sit in its one flat graph)."""
    if hasattr(step, "get_concrete_function"):
        return step.get_concrete_function(*input_specs)
    return tf.function(step).get_concrete_function(*input_specs)


def tensor_info(tensor: tf.Tensor) -> TensorInfo:
    shape = None if tensor.shape.rank is None else tuple(tensor.shape.as_list())
    dtype = tensor.dtype
    nbytes = None
    if shape is not None and all(d is not None for d in shape) and dtype not in (tf.resource, tf.variant, tf.string):
        count = 1
        for d in shape:
            count *= d
        nbytes = count * dtype.size
    return TensorInfo(shape=shape, dtype=dtype.name, nbytes=nbytes)


def graph_ir(func_graph) -> Graph:
    """The IR of a FuncGraph: ops in graph order, shapes from TensorFlow's own shape inference, with
    the batch dimension resolved by the input specs."""
    ops = []
    for op in func_graph.get_operations():
        ops.append(Op(
            name=op.name, type=op.type, device=op.device,
            inputs=[t.name for t in op.inputs], control_inputs=[c.name for c in op.control_inputs],
            outputs=[tensor_info(t) for t in op.outputs]))
    return Graph(ops, outputs=[t.name for t in func_graph.outputs])
