"""Gradient loops' zero lists, left unset until the loop fills them (a lifetime-aware rewrite).

When a forward loop reads a list (an RNN layer reads its input unstacked into a TensorList, one
element per time step), TensorFlow's while_v2 gradient gives the gradient loop a zero list to add
that list's gradient into: `ZerosLike(list)`, one fresh buffer of zeros per element. It depends on
the forward list only, so the executor makes it as soon as the forward loop ends, and it holds the
whole input's size from then until its gradient loop, through the rest of the forward pass and the
backward pass above that layer. On a Seq2Seq step with chunked recurrent layers these lists were
3.52 GiB of 14.40 GiB (batch 4096, docs/lms.md "Recurrent loops").

The gradient loop only adds into that list: each iteration sums the list with a list whose one set
element is that step's gradient (`AddN` of two TensorLists). TensorFlow adds an unset element as
the other operand (`TensorListBinaryAdd`: an element of dtype DT_INVALID is skipped), and stacks an
unset element as zeros. So a `TensorListReserve` of the same element shape and length, whose
elements are all unset, gives the same sums bit for bit and holds no element until the loop sets
it: the list's bytes appear while its own gradient loop runs, one loop's at a time. The reserve
reads its shape and length from the forward list at once (`TensorListElementShape`,
`TensorListLength`), so the forward list is freed when it was before.

In the IR the three ops are one: the `ZerosLike` becomes a `TensorListReserve` reading the same list
and holding no bytes, and the gradient loop's output at the list's place (the filled list, which
the stack of the input's gradient reads) holds them from the loop's start. lms_core.tf.apply makes
the same change to the GraphDef TensorFlow runs; lms_core.tf.gating checks it there.
"""
from __future__ import annotations

from lms_core.graph import BACKWARD, Graph, Op, TensorInfo, tensor_name
from lms_core.loops import WHILE_TYPES, list_bytes
from lms_core.passes.pipeline import analyze
from lms_core.plan import ReservedList

ZEROS_TYPE = "ZerosLike"
RESERVE_TYPE = "TensorListReserve"


def plan_reserved_lists(graph: Graph) -> list[ReservedList]:
    """Every zero list of known size that one gradient loop reads, and nothing else does, in graph
    order: a `ZerosLike` of a TensorList outside any v1 loop frame."""
    entries = []
    for name in graph.order:
        op = graph[name]
        if op.type != ZEROS_TYPE or op.region is not None or not op.outputs:
            continue
        info = op.outputs[0]
        if info.tensor_list is None or info.tensor_list.aliases or not info.nbytes:
            continue
        readers = graph.consumers(tensor_name(name, 0))
        if len(readers) != 1:
            continue
        [(loop, index)] = readers
        if graph[loop].type not in WHILE_TYPES or graph[loop].category != BACKWARD:
            continue
        entries.append(ReservedList(op=name, source=op.inputs[0], element_dtype=info.tensor_list.element_dtype,
                                    nbytes=list_bytes(info.tensor_list), gradient_loop=loop, loop_index=index))
    return entries


def with_reserved_lists(graph: Graph, entries: list[ReservedList]) -> Graph:
    """`graph` with each entry's zero list made unset: a new IR, analysed when `graph` was. Entries
    already applied (or whose op this graph lacks) are left alone, so `graph` itself comes back when
    none is left."""
    pending = {entry.op: entry for entry in entries
               if entry.op in graph.ops and graph[entry.op].type == ZEROS_TYPE}
    if not pending:
        return graph
    filled = {(entry.gradient_loop, entry.loop_index): graph[entry.op].outputs[0] for entry in pending.values()}
    ops = []
    for op in graph.ops.values():  # in the original order, which breaks the schedulers' ties
        outputs = list(op.outputs)
        if op.name in pending:
            zeros = outputs[0]
            # The reserve's list holds no element buffer: unsized, as Grappler sees every variant.
            outputs[0] = TensorInfo(zeros.shape, zeros.dtype, None)
            ops.append(Op(op.name, RESERVE_TYPE, op.device, list(op.inputs), list(op.control_inputs), outputs))
            continue
        for (loop, index), zeros in filled.items():
            if loop == op.name and index < len(outputs):
                # The loop sets every element: what leaves it holds the zero list's bytes.
                outputs[index] = TensorInfo(outputs[index].shape, outputs[index].dtype, zeros.nbytes, zeros.tensor_list)
        ops.append(Op(op.name, op.type, op.device, list(op.inputs), list(op.control_inputs), outputs))
    rewritten = Graph(ops, graph.outputs)
    return analyze(rewritten) if graph.analyses else rewritten
