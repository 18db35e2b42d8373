"""What a functional `While`'s TensorList outputs hold, read from the graph TensorFlow traced.

`tf.GradientTape` over a `while_loop` (TensorFlow's while_v2) adds, for every value the gradient
loop needs, an accumulator: an `EmptyTensorList(element_shape, max_num_elements)` fed into the
forward `While` as an extra loop variable, a `TensorListPushBack` of the value in the loop body each
iteration, and the loop's output at the same index read by the gradient `While`. `max_num_elements`
is the loop's `maximum_iterations`, and the body pushes once per iteration, so the list holds at
most that many elements; Keras's RNN loops run exactly to it (their condition is `time < steps`
and their `maximum_iterations` is `steps`). Without a static maximum the list is left unsized.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

from lms_core.graph import TensorList
from lms_core.loops import WHILE_TYPES

ACCUMULATOR_SOURCE = "EmptyTensorList"
PUSH = "TensorListPushBack"
PASS_THROUGH_TYPES = {"Identity"}
# The value of a resource variable read is the variable's own buffer: every push of it is that buffer.
VARIABLE_READ_TYPES = {"ReadVariableOp"}


def loop_lists(op: tf.Operation) -> dict[int, TensorList]:
    """For a `While` op, its outputs that are accumulators of a known size, by output index."""
    if op.type not in WHILE_TYPES:
        return {}
    body = _function_graph(op, "body")
    pushed = _pushed_values(body) if body is not None else {}
    lists = {}
    for index, source in enumerate(op.inputs):
        if source.dtype != tf.variant or source.op.type != ACCUMULATOR_SOURCE or index not in pushed:
            continue
        length = static_int(source.op.inputs[1])
        value = pushed[index]
        shape = _static_shape(source.op.inputs[0], value)
        if length is None or length < 0 or shape is None:
            continue
        dtype = tf.as_dtype(source.op.get_attr("element_dtype"))
        lists[index] = TensorList(element_shape=shape, element_dtype=dtype.name,
                                  element_bytes=int(np.prod(shape, dtype=np.int64)) * dtype.size, length=length,
                                  aliases=_aliases(value, body))
    return lists


def zeros_list(op: tf.Operation) -> TensorList | None:
    """For a `ZerosLike` of a TensorList (the gradient a loop accumulates for a list it reads, such as
    an RNN's unstacked input, which the gradient loop fills step by step): a list of fresh zero
    elements, shaped as the list it copies."""
    if op.type != "ZerosLike" or op.inputs[0].dtype != tf.variant:
        return None
    source = list_of(op.inputs[0])
    if source is None:
        return None
    return TensorList(source.element_shape, source.element_dtype, source.element_bytes, source.length)


def list_of(tensor: tf.Tensor) -> TensorList | None:
    """What a list made outside any loop holds, where the graph says: a `TensorListFromTensor` of a
    dense tensor (its slices along the first axis, sharing the tensor's buffer), followed through a
    loop that passes it on unchanged."""
    op = tensor.op
    if op.type in WHILE_TYPES:
        body = _function_graph(op, "body")
        index = tensor.value_index
        if body is None or index >= len(body.outputs) or _passed_through(body.outputs[index]) is not body.inputs[index]:
            return None
        return list_of(op.inputs[index])
    if op.type == "TensorListFromTensor":
        dense = op.inputs[0]
        if dense.shape.rank is None or dense.shape.rank < 1 or not dense.shape.is_fully_defined():
            return None
        shape = tuple(dense.shape.as_list())
        return TensorList(shape[1:], dense.dtype.name, int(np.prod(shape[1:], dtype=np.int64)) * dense.dtype.size,
                          shape[0], aliases=f"slices of {dense.name}")
    return None


def static_int(tensor: tf.Tensor) -> int | None:
    """A scalar int known when the graph is built: a constant, or the Max/Min of one (Keras's RNN
    passes `reduce_max(steps)` as `maximum_iterations`)."""
    value = tensor_util.constant_value(tensor)
    if value is None and tensor.op.type in ("Max", "Min") and tensor.op.inputs:
        inner = tensor_util.constant_value(tensor.op.inputs[0])
        if inner is not None and np.size(inner):
            value = np.max(inner) if tensor.op.type == "Max" else np.min(inner)
    return None if value is None or np.ndim(value) != 0 else int(value)


def _function_graph(op: tf.Operation, attr: str):
    """The FuncGraph of a functional op's `attr` (the loop body), or None where TensorFlow does not
    keep it with the graph."""
    try:
        return op.graph._get_function(op.get_attr(attr).name).graph  # noqa: SLF001 (no public accessor)
    except (AttributeError, KeyError, ValueError):
        return None


def _pushed_values(body) -> dict[int, tf.Tensor]:
    """Loop-variable index -> the value the body pushes onto that list each iteration."""
    arguments = {id(t): i for i, t in enumerate(body.inputs)}
    pushed = {}
    for op in body.get_operations():
        if op.type == PUSH and id(op.inputs[0]) in arguments:
            pushed[arguments[id(op.inputs[0])]] = op.inputs[1]
    return pushed


def _static_shape(element_shape: tf.Tensor, value: tf.Tensor) -> tuple[int, ...] | None:
    """The element shape, from the list's declared shape or else from the pushed value's."""
    declared = tensor_util.constant_value(element_shape)
    if declared is not None and np.ndim(declared) == 1 and all(d >= 0 for d in declared):
        return tuple(int(d) for d in declared)
    if value.shape.rank is not None and value.shape.is_fully_defined():
        return tuple(value.shape.as_list())
    return None


def _aliases(value: tf.Tensor, body) -> str | None:
    """What every element is, when all are one buffer: a variable's value (a read inside the body
    returns the variable's buffer), or a loop variable the body passes on unchanged."""
    while value.op.type in PASS_THROUGH_TYPES:
        value = value.op.inputs[0]
    if value.op.type in VARIABLE_READ_TYPES:
        return f"the value of a variable read by {value.op.name}"
    for index, argument in enumerate(body.inputs):
        if argument is value and index < len(body.outputs) and _passed_through(body.outputs[index]) is value:
            return f"loop-invariant loop variable {index}"
    return None


def _passed_through(tensor: tf.Tensor) -> tf.Tensor:
    while tensor.op.type in PASS_THROUGH_TYPES:
        tensor = tensor.op.inputs[0]
    return tensor
