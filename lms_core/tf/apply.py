"""Apply a Plan to a GraphDef: add swap-out and swap-in ops, reroute the far consumers, and add the
control edges that order the backward branches (`Plan.control_edges`); first the rewrites that
change how the step computes (AddN chains, lms_core.tf.add_chains; unset zero lists,
lms_core.tf.reserved_lists; the recomputes' clones, lms_core.tf.recompute).

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
- A loop accumulator (a TensorList) is read by its gradient `While` through an `Identity` on the
  compute device (`on_device_name`): TensorFlow lowers the loop and puts each loop variable's Enter
  on its input's device, so fed from the host the list would stay there and cross to the device and
  back every iteration. The Identity forwards the list (no copy), and Grappler sizes a variant as
  nothing, so it costs no memory in the estimate either.
- Arrival (`SwapIn.arrival`, sync modes 2 and 3 only): a one-element `Slice` of the swap-in's value
  on the compute device. It reads the value, so it runs once the value is there, and allocates 4
  bytes; the waiters wait for it. (An `Identity` would forward the buffer on a GPU, but Grappler's
  memory estimate counts its output as new memory: 1.7 GiB too much on the 3D U-Net at 192^3. A
  `Shape` needs no data, and Grappler pins it to the host.) A loop accumulator (a TensorList) has
  no elements to slice: its arrival is a `TensorListLength`, which reads the list on the device.

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
from lms_core.tf.add_chains import apply_add_chains
from lms_core.tf.graphdef import KEEP_ATTR, graphdef_ref
from lms_core.tf.recompute import apply_recomputes
from lms_core.tf.reserved_lists import apply_reserved_lists


class Placement(enum.Enum):
    GATED_ON_HOST = "gated-on-host"  # the swap-in waits for its trigger on the host: the copy back does too
    UNGATED_ON_COMPUTE = "ungated-on-compute"  # negative control: the copy back happens in the forward pass


def apply_plan(graph_def: graph_pb2.GraphDef, plan: Plan, compute_device: str, host_device: str,
               placement: Placement = Placement.GATED_ON_HOST) -> graph_pb2.GraphDef:
    """A new GraphDef with the plan's AddN chains and swaps; `graph_def` is left as it was."""
    result = graph_pb2.GraphDef()
    result.CopyFrom(graph_def)
    nodes = {node.name: node for node in result.node}
    # First the AddN chains (lms_core.add_chains): the plan's swaps and edges may name their adds.
    apply_add_chains(nodes, result, plan.add_chains)
    apply_reserved_lists(nodes, result, plan.reserved_lists)
    # Then the recomputes' clones (lms_core.recompute): the swaps were planned on the step with them.
    apply_recomputes(nodes, result, plan.recomputes)
    swap_in_device = host_device if placement is Placement.GATED_ON_HOST else compute_device
    # The backward branches' order (lms_core.serialize) and the gradient loops' zeros made just
    # before their loop (lms_core.deferred_zeros).
    for edge in [*plan.control_edges, *plan.deferred_zeros]:
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
            read_from = swap_in.name
            if swap.tensor_list is not None:
                # TensorFlow lowers the gradient loop into Enter/Merge/Switch per loop variable and
                # puts each Enter on its input's device: fed from the host, the list's loop variable
                # would live there, and what is left of the list would cross to the device and back on
                # every iteration. Read through an Identity on the device, it crosses once.
                read_from = on_device_name(swap_in.name)
                added.append(_identity(read_from, swap_in.name, dtype, compute_device))
            for consumer in swap_in.consumers:
                node = nodes[consumer]
                for position, name in enumerate(node.input):
                    if name == source:
                        node.input[position] = read_from
            if swap_in.arrival:
                arrive = _list_arrival if swap.tensor_list is not None else _arrival
                added.extend(arrive(swap_in.arrival, swap_in.name, dtype, swap.shape, compute_device))
                for waiter in swap_in.waiters:
                    _add_control_input(nodes[waiter], swap_in.arrival)
        for waiter in swap.waiters:
            _add_control_input(nodes[waiter], swap.swap_out)
    result.node.extend(added)
    return result


def on_device_name(swap_in: str) -> str:
    """The compute-side Identity a loop accumulator's gradient loop reads its swap-in through."""
    return f"{swap_in}/on_device"


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


def _list_arrival(name: str, source: str, dtype: int, shape: list[int], device: str) -> list[node_def_pb2.NodeDef]:
    """For a loop accumulator (a TensorList, which has no elements to slice): `TensorListLength` on
    `device`, which reads the list there and allocates one int32."""
    node = node_def_pb2.NodeDef(name=name, op="TensorListLength", device=device)
    node.input.append(source)
    node.attr[KEEP_ATTR].b = True
    return [node]


def _int32_const(name: str, values: list[int], device: str) -> node_def_pb2.NodeDef:
    node = node_def_pb2.NodeDef(name=name, op="Const", device=device)
    node.attr["dtype"].type = tf.int32.as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(values, dtype=tf.int32, shape=[len(values)]))
    return node


def _add_control_input(node: node_def_pb2.NodeDef, source: str) -> None:
    control = f"^{source}"
    if control not in node.input:
        node.input.append(control)  # control inputs follow the data inputs in a NodeDef
