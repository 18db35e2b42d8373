"""Does every swap-in wait for its trigger in what TensorFlow really executes?

Grappler's memory estimate and our simulator both assume that a swapped value comes back to the
compute device when its trigger has run. Whether it does is decided by TensorFlow's partitioner and
executor: the step is split per device and every cross-device edge becomes a `_Send`/`_Recv` pair.
A `_Recv` has no inputs; it completes when its `_Send` has run, and a `_Send` runs when everything
it depends on, across devices, has run. So a swap-in is gated exactly when the trigger is an ancestor
of the `_Recv` that delivers the value to the compute device, following `_Recv` -> `_Send` pairs
(same `tensor_name`, `send_device` and `recv_device`) from partition to partition.

`verify_gating` runs the rewritten step once (weights and optimizer state restored afterwards) on
its device pair, reads the partition graphs TensorFlow reports for that run, and checks every
swap-in. `check_partitions` is the check alone, on given partition graphs. It also checks that the
executed graph honours the plan's control edges (the backward branches' order, lms_core.serialize):
each edge's later op must have the earlier one among its ancestors, and each gradient loop's zero
the plan defers (lms_core.deferred_zeros) its trigger; that each zero list the plan leaves unset
(lms_core.reserved_lists) ran as a `TensorListReserve`; and that every op a recompute clones into
the backward pass (lms_core.recompute) was executed, under its name, after its trigger.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.eager import context

from lms_core.plan import Plan
from lms_core.planner import device_id
from lms_core.report import Verification
from lms_core.reserved_lists import RESERVE_TYPE
from lms_core.tf.reimport import IMPORT_SCOPE

SEND, RECV = "_Send", "_Recv"


@dataclass
class SwapInGate:
    """The verdict on one swap-in."""

    swap_in: str
    trigger: str
    gated: bool
    recv: str | None = None  # the `_Recv` that delivers the value to the compute device
    reason: str = ""  # why it is not gated, or a note on one that is


@dataclass
class GatingReport:
    compute_device: str
    host_device: str
    gates: list[SwapInGate] = field(default_factory=list)
    edges_kept: int = 0  # the plan's control edges (lms_core.serialize) that the executed graph honours
    edges_checked: int = 0  # those whose two ops TensorFlow executed under their own names
    edges_broken: list[str] = field(default_factory=list)
    lists_unset: int = 0  # the plan's unset zero lists (lms_core.reserved_lists) executed as such
    lists_checked: int = 0  # those TensorFlow executed under their own names
    lists_changed: list[str] = field(default_factory=list)  # executed as something else, and as what
    zeros_deferred: int = 0  # the plan's deferred zeros (lms_core.deferred_zeros) that wait for their trigger
    zeros_checked: int = 0  # those whose two ops TensorFlow executed under their own names
    zeros_early: list[str] = field(default_factory=list)
    clones_gated: int = 0  # the recomputes' clones (lms_core.recompute) that wait for their trigger
    clones: int = 0  # every clone of the plan
    clones_early: list[str] = field(default_factory=list)  # those that do not, or were not executed, and why

    @property
    def gated(self) -> int:
        return sum(gate.gated for gate in self.gates)

    @property
    def ungated(self) -> list[SwapInGate]:
        return [gate for gate in self.gates if not gate.gated]

    @property
    def all_gated(self) -> bool:
        return not self.ungated and not self.clones_early

    def verification(self, traced_at: tuple[list[int], int] | None = None) -> Verification:
        """The report's verdict (lms_core.report); `traced_at` (input shape, batch) when the check
        ran on the step's structural twin rather than on the step itself."""
        return Verification(
            gated=self.gated, swap_ins=len(self.gates), ungated=tuple(g.swap_in for g in self.ungated),
            reasons={g.swap_in: g.reason for g in self.ungated}, edges_kept=self.edges_kept,
            edges_checked=self.edges_checked, edges_broken=tuple(self.edges_broken),
            lists_unset=self.lists_unset, lists_checked=self.lists_checked, lists_changed=tuple(self.lists_changed),
            zeros_deferred=self.zeros_deferred, zeros_checked=self.zeros_checked, zeros_early=tuple(self.zeros_early),
            clones_gated=self.clones_gated, clones=self.clones, clones_early=tuple(self.clones_early),
            compute_device=self.compute_device, host_device=self.host_device, traced_at=traced_at)


def executed_partitions(rewritten, *inputs) -> list[graph_pb2.GraphDef]:
    """Runs a fresh instantiation of `rewritten` once on `inputs` and returns the partition graphs
    TensorFlow executed (it reports them only when a function is first instantiated). Every variable
    the step touches gets its value back afterwards. With several ranks the step runs collectives,
    so every rank must call this together."""
    function = rewritten.instantiate()
    variables = rewritten.variables
    saved = [v.numpy() for v in variables]
    context.context().export_run_metadata()  # drop anything collected before
    context.enable_run_metadata()
    try:
        outputs = rewritten.call_with(function, *inputs)
        for output in tf.nest.flatten(outputs):
            output.numpy()  # wait for the step
        metadata = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
        for variable, value in zip(variables, saved):
            variable.assign(value)
    return [partition for function_graph in metadata.function_graphs for partition in function_graph.partition_graphs]


def verify_gating(rewritten, *inputs) -> GatingReport:
    """Runs the step once on its device pair and checks every swap-in of its plan."""
    partitions = executed_partitions(rewritten, *inputs)
    return check_partitions(partitions, rewritten.plan, rewritten.compute_device, rewritten.host_device)


def check_partitions(partitions: list[graph_pb2.GraphDef], plan: Plan, compute_device: str, host_device: str,
                     scope: str = IMPORT_SCOPE) -> GatingReport:
    """The verdict on every swap-in of `plan`, from the partition graphs of one executed step whose
    ops were imported under `scope`."""
    graph = PartitionedGraph(partitions)
    report = GatingReport(compute_device, host_device)
    # A swap-in's trigger may be a recompute's clone: each with the clones its segment makes after it.
    segment_from = {}
    for entry in plan.recomputes:
        made = [clone for _, clone in entry.made()]
        segment_from.update({clone: made[position:] for position, clone in enumerate(made)})
    for swap in plan.swaps:
        for swap_in in swap.swap_ins:
            report.gates.append(graph.gate(swap_in, compute_device, scope, segment_from.get(swap_in.trigger)))
    report.edges_kept, report.edges_checked, report.edges_broken = graph.honoured(plan.control_edges, scope)
    report.zeros_deferred, report.zeros_checked, report.zeros_early = graph.honoured(plan.deferred_zeros, scope)
    report.clones_gated, report.clones, report.clones_early = graph.clones_gated(plan.recomputes, scope)
    for entry in plan.reserved_lists:
        node = graph.nodes.get(f"{scope}/{entry.op}")
        if node is not None:
            report.lists_checked += 1
            if node.op == RESERVE_TYPE:
                report.lists_unset += 1
            else:
                report.lists_changed.append(f"{entry.op} ran as {node.op}")
    return report


#: What the type of an op Grappler's remapper made of several has in it: its own fusions (`_FusedConv2D`,
#: `_FusedMatMul`, `_FusedBatchNormEx`) and oneDNN's (`_MklNativeConv2DWithBias`, `_MklNativeFusedConv2D`).
FUSED_MARKS = ("Fused", "WithBias")


class PartitionedGraph:
    """The nodes of all partitions by name, and every `_Send` by the edge it carries."""

    def __init__(self, partitions: list[graph_pb2.GraphDef]):
        self.nodes = {node.name: node for partition in partitions for node in partition.node}
        self.sends = {_edge(node): node.name for node in self.nodes.values() if node.op == SEND}
        self.readers: dict[str, list] = {}  # op -> the nodes whose data inputs read its outputs
        for node in self.nodes.values():
            for reference in node.input:
                if not reference.startswith("^"):
                    self.readers.setdefault(_op_name(reference), []).append(node)
        self.recvs_of: dict[str, list[str]] = {}  # op -> the _Recvs that deliver its value elsewhere
        for node in self.nodes.values():
            if node.op == RECV and _edge(node) in self.sends:
                sent = self.nodes[self.sends[_edge(node)]].input[0]
                if not sent.startswith("^"):
                    self.recvs_of.setdefault(_op_name(sent), []).append(node.name)

    def gate(self, swap_in, compute_device: str, scope: str, clones: list[str] | None = None) -> SwapInGate:
        """The verdict on `swap_in`. Where its trigger is a recompute's clone (`clones`: it and the
        later clones of its segment), the op that ran it is the trigger: itself, or the fused op the
        remapper made of it (`fused_into`)."""
        trigger = (self.fused_into(clones, scope) if clones else None) or f"{scope}/{swap_in.trigger}"

        def verdict(gated: bool, reason: str = "", recv: str | None = None) -> SwapInGate:
            return SwapInGate(swap_in.name, swap_in.trigger, gated, recv, reason)

        name = f"{scope}/{swap_in.name}"
        if name not in self.nodes:
            return verdict(False, f"the swap-in {name} is not among the executed ops")
        recv = self.delivering_recv(name, compute_device)
        if recv is None and not self.readers_of(name) and not _same_device(self.nodes[name].device, compute_device):
            # Grappler removed every op that read it (an LSTM's gradient through its zero initial
            # state): the value never comes back, so it cannot come back early.
            return verdict(True, "nothing reads the value in the executed graph: no copy is made")
        if recv is None:
            return verdict(False, "the value is not received from another device: nothing is copied back")
        if trigger not in self.nodes:
            return verdict(False, f"the trigger {trigger} is not among the executed ops (fused or pruned by Grappler)",
                           recv)
        # Every read of the value must happen on the compute device, through a _Recv that waits for
        # the trigger. (Which op reads it may change: Grappler reassociates products, for one.)
        swap_in_node = self.nodes[name]
        if not _same_device(swap_in_node.device, compute_device):
            local = next((n.name for n in self.readers_of(name) if n.op != SEND), None)
            if local is not None:
                return verdict(False, f"{local} reads the value on {swap_in_node.device}, not on the compute device", recv)
            recvs = self.recvs_of.get(name, [])
        else:
            recvs = [recv]
        for each in recvs:
            if not _same_device(self.nodes[each].device, compute_device):
                return verdict(False, f"{each} brings the value to {self.nodes[each].device}, not to the compute device",
                               recv)
            if not self.depends_on(each, trigger):
                return verdict(False, f"{each} does not depend on the trigger: the copy back can happen any time "
                                      f"after the swap-out", recv)
        return verdict(True, recv=recv)

    def honoured(self, edges, scope: str) -> tuple[int, int, list[str]]:
        """Of the control edges (`before`, `after`) whose two ops were executed under their names: how
        many the executed graph honours (`after` has `before` among its ancestors), how many were
        checked, and the ones it does not."""
        kept, checked, broken = 0, 0, []
        for edge in edges:
            before, after = f"{scope}/{edge.before}", f"{scope}/{edge.after}"
            if before in self.nodes and after in self.nodes:
                checked += 1
                if self.depends_on(after, before):
                    kept += 1
                else:
                    broken.append(f"{edge.after} does not wait for {edge.before}")
        return kept, checked, broken

    def clones_gated(self, recomputes, scope: str) -> tuple[int, int, list[str]]:
        """Of the recomputes' clones: how many were executed after their trigger (it is among their
        ancestors), how many there are, and why each other one is not. A clone Grappler's remapper
        fused into a later clone of its segment (a convolution and its bias add, run as one
        `_FusedConv2D`, or with oneDNN `_MklNativeConv2DWithBias`, under the bias add's name) is
        checked as that fused op. A clone Grappler folded away or renamed otherwise fails the check:
        then nothing proves it runs in the backward pass."""
        gated, count, early = 0, 0, []
        for entry in recomputes:
            trigger = f"{scope}/{entry.trigger}"
            made = [clone for _, clone in entry.made()]  # a shared clone is checked with the entry making it
            for position, clone in enumerate(made):
                count += 1
                name = self.fused_into(made[position:], scope)
                if name is None:
                    early.append(f"{clone} is not among the executed ops")
                elif trigger not in self.nodes:
                    early.append(f"{clone}: its trigger {entry.trigger} is not among the executed ops")
                elif not self.depends_on(name, trigger):
                    early.append(f"{clone} does not wait for {entry.trigger}: it can run in the forward pass")
                else:
                    gated += 1
        return gated, count, early

    def fused_into(self, clones: list[str], scope: str) -> str | None:
        """The executed op that runs `clones[0]`: itself, or where Grappler fused it away, the first
        later clone of its segment that was executed as a fused op (its type says so: FUSED_MARKS)."""
        first = f"{scope}/{clones[0]}"
        if first in self.nodes:
            return first
        return next((f"{scope}/{c}" for c in clones[1:] if f"{scope}/{c}" in self.nodes
                     and any(mark in self.nodes[f"{scope}/{c}"].op for mark in FUSED_MARKS)), None)

    def readers_of(self, name: str) -> list:
        """The ops whose data inputs include `name`'s outputs (in its own partition)."""
        return list({id(n): n for n in self.readers.get(name, [])}.values())  # each once, in order

    def delivering_recv(self, swap_in: str, compute_device: str) -> str | None:
        """The `_Recv` through which the swap-in's value reaches the compute device: the one its own
        `_Send` feeds when it sits on another device (the host), or the one it reads, up its data
        inputs, when it sits on the compute device itself (the placement the check must reject)."""
        node = self.nodes[swap_in]
        if not _same_device(node.device, compute_device):
            on_compute = [r for r in self.recvs_of.get(swap_in, []) if _same_device(self.nodes[r].device, compute_device)]
            return on_compute[0] if on_compute else None
        seen = set()
        while node.op != RECV:
            data = [i for i in node.input if not i.startswith("^")]
            if not data or node.name in seen:
                return None
            seen.add(node.name)
            source = self.nodes.get(_op_name(data[0]))
            if source is None or source.device != node.device:
                return None
            node = source
        return node.name

    def ancestors(self, name: str, stop_at: str | None = None) -> set[str]:
        """Every op that must have run before `name` can complete, across devices (nearest first; the
        walk ends early once it reaches `stop_at`)."""
        seen: set[str] = set()
        queue = deque([name])
        while queue:
            node = self.nodes[queue.popleft()]
            sources = [_op_name(i) for i in node.input]
            if node.op == RECV and _edge(node) in self.sends:
                sources.append(self.sends[_edge(node)])
            for source in sources:
                if source not in seen and source in self.nodes:
                    seen.add(source)
                    if source == stop_at:
                        return seen
                    queue.append(source)
        return seen

    def depends_on(self, name: str, ancestor: str) -> bool:
        """Whether `ancestor` must have run before `name` can complete. A gated swap-in's trigger is a
        few hops up from its _Recv, so the walk is short where the answer is yes."""
        return ancestor in self.ancestors(name, stop_at=ancestor)


def _same_device(placed: str, device: str) -> bool:
    """`/job:localhost/replica:0/task:0/device:CPU:1` is `/device:CPU:1`."""
    return device_id(placed) == device_id(device)


def _edge(node) -> tuple[bytes, bytes, bytes]:
    return node.attr["tensor_name"].s, node.attr["send_device"].s, node.attr["recv_device"].s


def _op_name(reference: str) -> str:
    """`^op`, `op:1`, `op` -> `op`."""
    return reference.lstrip("^").split(":")[0]
