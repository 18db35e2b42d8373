"""Loop accumulators: what a forward loop keeps, per iteration, for its gradient loop (Meng et al. 2017).

A recurrent layer traced as a functional `While` (any Keras RNN on a CPU, any RNN with a custom cell)
hands its per-step activations to the backward pass as TensorLists: for every value the gradient
needs, the forward loop pushes one element per iteration onto a list (an "accumulator") that leaves
the loop as a variant output and is read by the gradient `While` only. They are the step's
long-lived activations, like any forward tensor a backward op reads late, and are swapped like one:
out to the host after the forward loop, back before their own gradient loop starts.

Grappler sizes a variant tensor as nothing, so the adapter records what each accumulator holds
(`lms_core.graph.TensorList`: element shape and dtype, and the trip count, which bounds the elements)
and its size is computed here: `length x element_bytes`, or nothing when every element is one buffer.
`unseen_bytes` is what the lists add to Grappler's peaks (docs/lms.md, "Recurrent loops").
"""
from __future__ import annotations

from dataclasses import dataclass

from lms_core.graph import BACKWARD, FORWARD, Graph, Op, TensorInfo, TensorList, once_per_graph, tensor_name
from lms_core.units import format_bytes

WHILE_TYPES = frozenset({"While", "StatelessWhile"})
# TensorFlow keeps int32 tensors of GPU ops in host memory (a loop counter's per-step values).
HOST_RESIDENT_ELEMENT_DTYPES = frozenset({"int32"})


def list_bytes(tensor_list: TensorList) -> int:
    """Bytes a list's elements hold: one buffer per element, or none of its own when all elements are
    one buffer that lives anyway (a variable's value, a loop-invariant tensor)."""
    return 0 if tensor_list.aliases else tensor_list.length * tensor_list.element_bytes


def list_record(tensor_list: TensorList) -> dict:
    """A list's facts as plain data, for a plan (lms_core.plan.Swap.tensor_list)."""
    return {"element_shape": list(tensor_list.element_shape), "element_dtype": tensor_list.element_dtype,
            "length": tensor_list.length}


@dataclass(frozen=True)
class Accumulator:
    """A forward loop's list that its gradient loop reads."""

    tensor: str  # the forward While's output, "op:index"
    forward_loop: str
    gradient_loops: tuple[str, ...]  # the backward While ops that read it
    tensor_list: TensorList
    nbytes: int


def is_accumulator(producer: Op, info: TensorInfo, far: list[Op]) -> bool:
    """Whether `producer`'s output `info`, read late by the backward ops `far`, is a forward loop's
    accumulator read by gradient loops only: the one kind of control-flow tensor that is swapped."""
    return (producer.type in WHILE_TYPES and producer.category == FORWARD and info.tensor_list is not None
            and bool(far) and all(c.type in WHILE_TYPES and c.category == BACKWARD for c in far))


def accumulator_reason(tensor_list: TensorList) -> str | None:
    """Why an accumulator is not swapped, or None when it may be."""
    if tensor_list.aliases:
        return (f"loop accumulator whose {tensor_list.length} elements are all one buffer ({tensor_list.aliases}): "
                f"parking it frees nothing, and its copy back would make {tensor_list.length} copies")
    if tensor_list.element_dtype in HOST_RESIDENT_ELEMENT_DTYPES:
        return (f"loop accumulator of {tensor_list.element_dtype} elements: TensorFlow keeps int32 tensors of "
                f"GPU ops in host memory already")
    return None


@once_per_graph
def accumulators(graph: Graph) -> tuple[Accumulator, ...]:
    """Every forward loop's sized list that a gradient loop reads, in graph order (categories needed)."""
    found = []
    for name in graph.order:
        producer = graph[name]
        if producer.type not in WHILE_TYPES or producer.category != FORWARD:
            continue
        for index, info in enumerate(producer.outputs):
            if info.tensor_list is None:
                continue
            tensor = tensor_name(name, index)
            readers = sorted({c for c, _ in graph.consumers(tensor)
                              if graph[c].type in WHILE_TYPES and graph[c].category == BACKWARD})
            if readers:
                found.append(Accumulator(tensor, name, tuple(readers), info.tensor_list,
                                         list_bytes(info.tensor_list)))
    return tuple(found)


@once_per_graph
def gradient_lists(graph: Graph) -> tuple[tuple[str, int], ...]:
    """(tensor, bytes) of every other sized list a gradient loop reads: the zero lists it fills with
    the gradient of a list the forward loop read (an RNN's unstacked input). Made before the backward
    pass starts and never swapped (a control-flow reader that is not a forward loop's accumulator)."""
    found = []
    for name in graph.order:
        producer = graph[name]
        if producer.type in WHILE_TYPES:
            continue
        for index, info in enumerate(producer.outputs):
            tensor = tensor_name(name, index)
            if info.tensor_list is not None and info.nbytes and any(
                    graph[c].type in WHILE_TYPES and graph[c].category == BACKWARD for c, _ in graph.consumers(tensor)):
                found.append((tensor, info.nbytes))
    return tuple(found)


@once_per_graph
def filled_lists(graph: Graph) -> tuple[tuple[str, int], ...]:
    """(gradient loop, bytes) of every list a gradient loop fills in place of a zero list left unset
    (lms_core.reserved_lists): a backward `While`'s sized output, in graph order (categories needed)."""
    found = []
    for name in graph.order:
        op = graph[name]
        if op.type in WHILE_TYPES and op.category == BACKWARD:
            found.extend((name, info.nbytes) for info in op.outputs if info.tensor_list is not None and info.nbytes)
    return tuple(found)


@dataclass(frozen=True)
class UnseenBytes:
    """What loop accumulators add to a peak that Grappler's estimate cannot see (it sizes a variant
    as nothing), without and with a plan. Every forward loop has ended before the first gradient loop
    starts, so without swaps all accumulators are on the device together; with swaps, those not
    swapped stay, and the swapped ones come back one gradient loop at a time (the largest set counts).
    The zero lists the gradient loops fill are all there from the forward pass on, unless the rewrite
    leaves them unset (lms_core.reserved_lists): then each holds its bytes only while its own loop
    fills it, counted with that loop's swapped accumulators. Added to the estimate's peak as if that
    peak fell where they are all live: at the start of the backward pass, where a recurrent step's
    activations peak."""

    baseline_bytes: int
    lms_bytes: int
    host_bytes: int  # the swapped accumulators, parked on the host
    count: int  # accumulators in the step
    swapped: int
    gradient_list_bytes: int = 0  # the zero lists the gradient loops fill (made up front without LMS)
    unset_list_bytes: int = 0  # of those, the ones the rewrite leaves unset until their loop fills them

    def describe(self) -> str:
        others = (f", and {format_bytes(self.gradient_list_bytes)} of zero lists the gradient loops fill"
                  if self.gradient_list_bytes else "")
        if self.unset_list_bytes:
            others += (f" ({format_bytes(self.unset_list_bytes)} of them left unset with LMS, each counted only "
                       f"while its own loop fills it)")
        return (f"the peaks include {format_bytes(self.baseline_bytes)} without LMS and {format_bytes(self.lms_bytes)} with it "
                f"of {self.count} loop accumulator(s) (TensorLists sized from element shape x trip count; "
                f"Grappler sizes them as 0), {self.swapped} swapped{others}")


def unseen_bytes(graph: Graph, swapped_tensors: set[str]) -> UnseenBytes:
    """The share of the peaks of the lists Grappler cannot size (the accumulators, given the tensors a
    plan swaps, and the gradient loops' zero lists). `graph` is the one the plan was made on: its
    unset zero lists (lms_core.reserved_lists) are the sized outputs of their gradient loops."""
    found = accumulators(graph)
    kept = sum(a.nbytes for a in found if a.tensor not in swapped_tensors)
    per_loop: dict[str, int] = {}  # what is on the device for a gradient loop only, while it runs
    swapped_bytes = 0
    for a in found:
        if a.tensor in swapped_tensors:
            first = a.gradient_loops[0]
            per_loop[first] = per_loop.get(first, 0) + a.nbytes
            swapped_bytes += a.nbytes
    for loop, nbytes in filled_lists(graph):
        per_loop[loop] = per_loop.get(loop, 0) + nbytes
    up_front = sum(nbytes for _, nbytes in gradient_lists(graph))
    unset = sum(nbytes for _, nbytes in filled_lists(graph))
    return UnseenBytes(baseline_bytes=sum(a.nbytes for a in found) + up_front + unset,
                       lms_bytes=kept + up_front + max(per_loop.values(), default=0),
                       host_bytes=swapped_bytes, count=len(found),
                       swapped=sum(a.tensor in swapped_tensors for a in found),
                       gradient_list_bytes=up_front + unset, unset_list_bytes=unset)
