"""Apply a Plan to a GraphDef: add swap-out and swap-in ops, reroute the far consumers, and add the
control edges that order the backward branches (`Plan.control_edges`).

Where the ops sit decides whether anything is saved. With the compute device different from the
host, TensorFlow partitions the step per device and turns every cross-device edge into a
`_Send`/`_Recv` pair; a `_Recv` has no inputs, so the executor starts it with the step and it
completes as soon as its `_Send` has run. So:

- Swap-out: an `Identity` on the host reading the forward tensor. The device buffer is freed once
  the copy to the host and the near consumers are done.
- Swap-in (`SwapIn.name`): an `Identity` on the host reading the swap-out, with a control input from
  the trigger. The far consumers read it. The host `_Send` that ships its value to the compute device
  runs only after it, so the copy back waits for the trigger (the control edge crosses devices as a
  small control `_Send`/`_Recv`); TensorFlow makes one `_Recv` per swap-in on the compute device,
  and all of that swap-in's consumers read it.
- Arrival (`SwapIn.arrival`, sync modes 2 and 3 only): a one-element `Slice` of the swap-in's value
  on the compute device. It reads the value, so it runs once the value is there, and allocates 4
  bytes; the waiters wait for it. (An `Identity` would forward the buffer on a GPU, but Grappler's
  memory estimate counts its output as new memory: 1.7 GiB too much on the 3D U-Net at 192^3. A
  `Shape` needs no data, and Grappler pins it to the host.)

All added ops carry `_grappler_do_not_remove`, or Grappler's dependency optimizer folds them away
as no-op Identities. So do the triggers and the ends of the plan's control edges: Grappler rewrites some backward ops away (its arithmetic
optimizer turns `Add(x, Neg(y))` into `Sub(x, y)`, which removed 9 of 582 triggers of a small
ResNet-50), and a swap-in whose trigger is gone waits for nothing. `lms_core.tf.gating` proves the
placement on the partition graphs TensorFlow executes.

`Placement.UNGATED_ON_COMPUTE` builds the earlier, wrong placement (the swap-in on the compute device,
reading a `_Recv` that completes right after the swap-out, in the forward pass): kept only so the
gating check can be shown to fail on it.
"""
from __future__ import annotations

import enum

import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2

from lms_core.plan import Plan

KEEP_ATTR = "_grappler_do_not_remove"


class Placement(enum.Enum):
    GATED_ON_HOST = "gated-on-host"  # the swap-in waits for its trigger on the host: the copy back does too
    UNGATED_ON_COMPUTE = "ungated-on-compute"  # negative control: the copy back happens in the forward pass


def graphdef_ref(tensor: str) -> str:
    """`op:0` -> `op`, `op:2` -> `op:2`: how GraphDef inputs name tensors."""
    op, _, index = tensor.rpartition(":")
    return op if index == "0" else tensor


def apply_plan(graph_def: graph_pb2.GraphDef, plan: Plan, compute_device: str, host_device: str,
               placement: Placement = Placement.GATED_ON_HOST) -> graph_pb2.GraphDef:
    """A new GraphDef with the plan's swaps; `graph_def` is left as it was."""
    result = graph_pb2.GraphDef()
    result.CopyFrom(graph_def)
    nodes = {node.name: node for node in result.node}
    swap_in_device = host_device if placement is Placement.GATED_ON_HOST else compute_device
    for edge in plan.control_edges:  # the backward branches' order (lms_core.serialize)
        _add_control_input(nodes[edge.after], edge.before)
        for end in (edge.before, edge.after):  # a folded end would take the order with it
            nodes[end].attr[KEEP_ATTR].b = True
    added = []
    for swap in plan.swaps:
        source = graphdef_ref(swap.tensor)
        dtype = tf.as_dtype(swap.dtype).as_datatype_enum
        added.append(_identity(swap.swap_out, source, dtype, host_device))
        for swap_in in swap.swap_ins:
            nodes[swap_in.trigger].attr[KEEP_ATTR].b = True
            added.append(_identity(swap_in.name, swap.swap_out, dtype, swap_in_device, controls=[swap_in.trigger]))
            for consumer in swap_in.consumers:
                node = nodes[consumer]
                for position, name in enumerate(node.input):
                    if name == source:
                        node.input[position] = swap_in.name
            if swap_in.arrival:
                added.extend(_arrival(swap_in.arrival, swap_in.name, dtype, swap.shape, compute_device))
                for waiter in swap_in.waiters:
                    _add_control_input(nodes[waiter], swap_in.arrival)
        for waiter in swap.waiters:
            _add_control_input(nodes[waiter], swap.swap_out)
    result.node.extend(added)
    return result


def host_ops(plan: Plan, placement: Placement = Placement.GATED_ON_HOST) -> set[str]:
    """The ops `apply_plan` puts on the host device."""
    names = {swap.swap_out for swap in plan.swaps}
    if placement is Placement.GATED_ON_HOST:
        names |= {swap_in.name for swap in plan.swaps for swap_in in swap.swap_ins}
    return names


def _identity(name: str, source: str, dtype: int, device: str, controls: list[str] = ()) -> node_def_pb2.NodeDef:
    node = node_def_pb2.NodeDef(name=name, op="Identity", device=device)
    node.input.append(source)
    node.input.extend(f"^{c}" for c in controls)
    node.attr["T"].type = dtype
    node.attr[KEEP_ATTR].b = True
    return node


def _arrival(name: str, source: str, dtype: int, shape: list[int], device: str) -> list[node_def_pb2.NodeDef]:
    """`Slice(source, begin=0..., size=1...)` on `device`, and its two constant inputs."""
    begin, size = f"{name}/begin", f"{name}/size"
    nodes = [_int32_const(begin, [0] * len(shape), device), _int32_const(size, [min(1, d) for d in shape], device)]
    node = node_def_pb2.NodeDef(name=name, op="Slice", device=device)
    node.input.extend([source, begin, size])
    node.attr["T"].type = dtype
    node.attr["Index"].type = tf.int32.as_datatype_enum
    node.attr[KEEP_ATTR].b = True
    return nodes + [node]


def _int32_const(name: str, values: list[int], device: str) -> node_def_pb2.NodeDef:
    node = node_def_pb2.NodeDef(name=name, op="Const", device=device)
    node.attr["dtype"].type = tf.int32.as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(values, dtype=tf.int32, shape=[len(values)]))
    return node


def _add_control_input(node: node_def_pb2.NodeDef, source: str) -> None:
    control = f"^{source}"
    if control not in node.input:
        node.input.append(control)  # control inputs follow the data inputs in a NodeDef
