"""Trace a tf.function training step and describe its graph in the lms_core IR."""
from __future__ import annotations

import tensorflow as tf

from lms_core.graph import Graph, Op, TensorInfo
from lms_core.loops import list_bytes
from lms_core.tf.loops import loop_lists, zeros_list


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
    the batch dimension resolved by the input specs; only the ops TensorFlow runs
    (`ops_tensorflow_runs`). A `While`'s accumulators and the zero lists a
    gradient loop fills (lms_core.tf.loops) carry what they hold and the bytes of it, which
    TensorFlow's shapes cannot say."""
    ops = []
    runs = ops_tensorflow_runs(func_graph)
    for op in func_graph.get_operations():
        if op.name not in runs:
            continue
        outputs = [tensor_info(t) for t in op.outputs]
        lists = loop_lists(op)
        zeros = zeros_list(op)
        if zeros is not None:
            lists[0] = zeros
        for index, tensor_list in lists.items():
            outputs[index] = TensorInfo(shape=outputs[index].shape, dtype=outputs[index].dtype,
                                        nbytes=list_bytes(tensor_list), tensor_list=tensor_list)
        ops.append(Op(
            name=op.name, type=op.type, device=op.device,
            inputs=[t.name for t in op.inputs], control_inputs=[c.name for c in op.control_inputs],
            outputs=outputs))
    return Graph(ops, outputs=[t.name for t in func_graph.outputs])


# Ops a function keeps whatever reads them: TensorFlow's PruneFunctionBody seeds its reachability with
# them (v1 control flow, stateful ops); the function's inputs are fed whether read or not.
V1_CONTROL_FLOW_TYPES = frozenset({"Switch", "Merge", "Enter", "Exit", "NextIteration", "LoopCond", "RefSwitch",
                                   "RefMerge", "RefEnter", "RefExit", "RefNextIteration"})


def ops_tensorflow_runs(func_graph) -> set[str]:
    """Names of the ops a call of this function runs: those its outputs, control outputs, stateful
    ops and v1 control flow depend on. TensorFlow prunes the rest from the function body before
    running it (PruneFunctionBody), and Grappler's estimate schedules only the fetches' fan-in.
    Keras leaves such ops in every RNN: the cell is called once outside the loop to learn its output
    structure. Replayed, they would sit between the ops that do run and change which buffers are
    live together (issue 18: at the Seq2Seq recipe's loss, two of four vocabulary-sized buffers)."""
    seeds = [t.op for t in func_graph.outputs] + list(func_graph.control_outputs)
    seeds += [op for op in func_graph.get_operations()
              if op.type == "Placeholder" or op.type in V1_CONTROL_FLOW_TYPES or op.op_def.is_stateful]
    runs: set[str] = set()
    while seeds:
        op = seeds.pop()
        if op.name in runs:
            continue
        runs.add(op.name)
        seeds.extend(t.op for t in op.inputs)
        seeds.extend(op.control_inputs)
    return runs
