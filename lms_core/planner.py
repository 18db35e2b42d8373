"""Which tensors to park in host memory, and when each comes back (TFLMS v2 vocabulary).

A forward tensor (or, with `lms.swap_backward`, a backward one) is a candidate when a backward op
consumes it at least `swapout_threshold` levels after its producer. Its far consumers are grouped
(`swapin_groupby`); each group gets one swap-in whose copy starts when a trigger op has run: the
backward op `swapin_ahead` levels before the group's first consumer, found by walking back along the
consumer's latest backward inputs (the path that actually runs just before it). Near consumers keep
reading the original tensor, and a swap whose copy would come back before the original's last near
read is not made: both copies would be resident at once, and the swap would cost memory.

Control flow is left alone, with one exception: a forward loop's accumulators (the TensorLists a
`While` fills for its gradient loop, lms_core.loops) are swapped whole, from outside both loops.
"""
from __future__ import annotations

from lms_core.config import LMSConfig
from lms_core.graph import BACKWARD, FORWARD, Graph, Op, once_per_graph, tensor_name
from lms_core.loops import WHILE_TYPES, accumulator_reason, is_accumulator, list_record
from lms_core.passes.pipeline import PLANNER_REQUIRES
from lms_core.plan import ControlEdge, Plan, Skip, Swap, SwapIn

# Never swapped, whatever their size: variables are already resident and updated in place,
# constants and shape metadata are tiny or live on the host.
NEVER_SWAPPED_TYPES = {"Const", "ReadVariableOp", "VarHandleOp", "Placeholder", "_Arg", "Shape", "ShapeN",
                       "Size", "Rank", "VariableV2"}
# Tensors produced or consumed by these are left alone: their bodies are functions or frames the
# rewrite does not see into, and rerouting into them is where a rewrite could change numerics.
CONTROL_FLOW_TYPES = {"If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase", "Switch", "Merge",
                      "Enter", "Exit", "NextIteration", "LoopCond", "RefSwitch", "RefMerge", "RefEnter"}
NON_DATA_DTYPES = {"resource", "variant", "string"}
# TensorFlow keeps int32 tensors of GPU ops in host memory (shapes, indices, labels): nothing to gain.
HOST_RESIDENT_DTYPES = {"int32"}
# Consumers that read only a tensor's metadata: they keep reading the original (Grappler folds them
# to constants when shapes are static), so they neither need a swap-in nor decide when one happens.
SHAPE_ONLY_TYPES = {"Shape", "ShapeN", "Size", "Rank"}


def device_kind(device: str) -> str:
    """`/job:w/replica:0/task:0/device:GPU:1` -> `GPU`; '' when unplaced."""
    return device_id(device)[0]


def device_id(device: str) -> tuple[str, str]:
    """`/job:w/replica:0/task:0/device:GPU:1` -> (`GPU`, `1`); the index is '' when not given
    (`/gpu`), and both are '' when unplaced."""
    text = device.upper()
    for kind in ("GPU", "TPU", "CPU"):
        at = text.rfind(f"{kind}:")
        if at >= 0:
            return kind, text[at + len(kind) + 1:].split("/")[0]
        if text.endswith(f"/{kind}") or text.endswith(f":{kind}"):
            return kind, ""
    return "", ""


def on_other_device(device: str, compute_device: str) -> bool:
    """Whether an op placed on `device` is known to run elsewhere than `compute_device`. Unplaced ops
    run where the step runs; a missing index matches any index of the same kind."""
    (kind, index), (compute_kind, compute_index) = device_id(device), device_id(compute_device)
    if not kind or not compute_kind:
        return False
    return kind != compute_kind or bool(index and compute_index and index != compute_index)


def plan_swaps(graph: Graph, config: LMSConfig, compute_device: str = "", data_inputs: frozenset[str] = frozenset(),
               control_edges: list[ControlEdge] = ()) -> Plan:
    """Requires `category`, `level` and `region` on every op (lms_core.passes.pipeline.analyze).
    `data_inputs` names the step's input placeholders (the batch): they live from the first forward op
    to the last backward one, so they are candidates like forward activations. `control_edges` is the
    order already imposed on `graph` (lms_core.serialize), recorded in the plan."""
    missing = PLANNER_REQUIRES - graph.analyses
    if missing:
        raise ValueError(f"the planner needs {', '.join(sorted(missing))} on every op: analyse the graph first "
                         f"(lms_core.passes.pipeline.analyze)")
    swaps, skipped, small = [], [], 0
    for name in graph.order:
        producer = graph[name]
        phase = swap_phase(producer, name in data_inputs, config)
        if phase is None:
            continue
        for index, info in enumerate(producer.outputs):
            tensor = tensor_name(name, index)
            consumers = [(graph[c], slot) for c, slot in graph.consumers(tensor)]
            far = sorted({c.name: c for c, _ in consumers
                          if c.category == BACKWARD and c.type not in SHAPE_ONLY_TYPES
                          and c.level - producer.level >= config.swapout_threshold}.values(),
                         key=lambda c: (c.level, c.name))
            if not far:
                continue
            reason = reason_not_to_swap(producer, info, far, config, compute_device)
            if reason is None and info.nbytes < config.min_tensor_bytes:
                small += 1  # counted, not listed: a step has thousands
                continue
            if reason is None:
                try:
                    swap_ins = _plan_swap_ins(graph, producer, index, far, config)
                except _CannotSwap as cannot:
                    reason = cannot.reason
            if reason is None:
                reason = _early_swap_in(consumers, far, producer, swap_ins)
            if reason is not None:
                skipped.append(Skip(tensor, info.nbytes, reason))
                continue
            far_names = {c.name for c in far}
            near = [c for c, _ in consumers if c.name not in far_names and c.type not in SHAPE_ONLY_TYPES]
            waiters = sorted({c.name for c in near if c.category == phase}) if config.sync_mode in (1, 3) else []
            swaps.append(Swap(
                tensor=tensor, producer_type=producer.type, shape=list(info.shape), dtype=info.dtype,
                nbytes=info.nbytes, producer_level=producer.level, swap_out=f"lms/swapout_{name}_{index}",
                swap_ins=swap_ins, waiters=waiters,
                tensor_list=None if info.tensor_list is None else list_record(info.tensor_list)))
    return Plan(settings=dict(config.settings(), strategy="distance"), swaps=swaps, skipped=skipped, skipped_small=small,
                control_edges=list(control_edges), ops=len(graph),
                levels=1 + max((op.level for op in graph.ops.values()), default=-1))


class _CannotSwap(Exception):
    """A tensor that qualifies cannot be swapped; `reason` says why (it goes into `Plan.skipped`)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _early_swap_in(consumers, far: list[Op], producer: Op, swap_ins: list[SwapIn]) -> str | None:
    """Why not to swap when a copy would come back while the original is still on the device (it
    has a reader at that level or later): two copies at once, more memory than without the swap."""
    far_names = {c.name for c in far}
    near = [c for c, _ in consumers if c.name not in far_names and c.type not in SHAPE_ONLY_TYPES]
    last_near = max((c.level for c in near), default=producer.level)
    early = next((s for s in swap_ins if s.trigger_level <= last_near), None)
    if early is None:
        return None
    return (f"its swap-in would start at level {early.trigger_level}, while the original is still read at "
            f"level {last_near}: both copies would be on the device at once (a smaller lms.swapin_ahead brings "
            f"it back later)")


def swap_phase(producer: Op, is_data_input: bool, config: LMSConfig) -> str | None:
    """The pass whose tensors `producer` makes, if they may be swapped: the forward pass's (the
    batch counts as forward), the backward pass's with `lms.swap_backward`, or None."""
    if producer.category == FORWARD or is_data_input:
        return FORWARD
    if producer.category == BACKWARD and config.swap_backward:
        return BACKWARD
    return None


def reason_not_to_swap(producer: Op, info, far: list[Op], config: LMSConfig, compute_device: str) -> str | None:
    """Why a tensor with far backward readers is not a swap candidate, or None when it is (its size
    is judged apart: a tensor under lms.min_tensor_bytes is counted, not listed)."""
    if producer.type in NEVER_SWAPPED_TYPES and producer.category == FORWARD:
        return f"{producer.type} output: variables, constants and shape metadata are never swapped"
    if producer.region is not None:
        return f"produced inside v1 control flow ({producer.region}); a tensor there exists per iteration or branch"
    if is_accumulator(producer, info, far):
        # A forward loop's list read by gradient loops only (lms_core.loops): swapped whole, from
        # outside both loops, like any activation.
        reason = accumulator_reason(info.tensor_list)
        if reason is not None:
            return reason
    else:
        if producer.type in CONTROL_FLOW_TYPES:
            return f"produced by control flow ({producer.type}); the rewrite does not reach into its branches or loop"
        flow_consumer = next((c for c in far if c.type in CONTROL_FLOW_TYPES or c.region is not None), None)
        if flow_consumer is not None:
            return f"consumed by control flow ({flow_consumer.type} {flow_consumer.name})"
        if info.dtype in NON_DATA_DTYPES:
            return f"{info.dtype} tensors hold handles, not data"
    if info.nbytes is None:
        return f"unknown size (shape {_shape_text(info.shape)}, dtype {info.dtype})"
    if on_other_device(producer.device, compute_device):
        return f"already off the compute device (on {producer.device})"
    if config.include_types and producer.type not in config.include_types:
        return f"op type {producer.type} not in lms.include_types"
    if producer.type in config.exclude_types:
        return f"op type {producer.type} in lms.exclude_types"
    if config.include_scopes and not any(producer.name.startswith(s) for s in config.include_scopes):
        return "outside lms.include_scopes"
    scope = next((s for s in config.exclude_scopes if producer.name.startswith(s)), None)
    if scope is not None:
        return f"in lms.exclude_scopes ({scope})"
    if info.dtype in HOST_RESIDENT_DTYPES and info.nbytes >= config.min_tensor_bytes:
        return f"{info.dtype}: TensorFlow keeps int32 tensors of GPU ops in host memory already"
    return None


def constant_ops(graph: Graph) -> frozenset[str]:
    """Ops computed from constants alone (the gradient seed `ones -> Tile -> ...`, shape arithmetic).
    Grappler folds them into constants and drops control edges on them, so they cannot be triggers."""
    constant: set[str] = set()
    for name in graph.order:
        op = graph[name]
        preds = list(graph.predecessors(op))
        if op.type == "Const" or (preds and all(p in constant for p in preds)):
            constant.add(name)
    return frozenset(constant)


# Ops TensorFlow's oneDNN graph pass fuses into their neighbour on a CPU (a bias gradient into the
# weight gradient: _MklConv2DBackpropFilterWithBias, _MklFusedMatMulGrad), where the gating check runs.
FUSED_ON_CPU_TYPES = frozenset({"BiasAddGrad"})


def fused_on_cpu(graph: Graph) -> frozenset[str]:
    """Ops no executed node is named after on the CPU the plan is checked on (FUSED_ON_CPU_TYPES):
    a swap-in gated by one could not be shown to wait for it."""
    return frozenset(name for name, op in graph.ops.items() if op.type in FUSED_ON_CPU_TYPES)


def transpose_pairs(graph: Graph) -> frozenset[str]:
    """Transposes that read or feed another Transpose. Grappler's arithmetic optimizer folds such a
    pair into one Transpose, or removes both where they cancel (stacked Keras RNNs: the gradient of
    one layer's batch-to-time transpose meets the next layer's time-to-batch one), so neither may be a
    trigger: a swap-in gated by it would no longer wait for anything."""
    pairs: set[str] = set()
    for op in graph.ops.values():
        if op.type == "Transpose" and op.inputs:
            source = graph.ops.get(op.inputs[0].rpartition(":")[0])
            if source is not None and source.type == "Transpose":
                pairs.update((op.name, source.name))
    return frozenset(pairs)


def _plan_swap_ins(graph: Graph, producer: Op, index: int, far: list[Op], config: LMSConfig) -> list[SwapIn]:
    """One swap-in per group of far consumers; raises _CannotSwap when a group has no trigger."""
    groups: list[list[Op]] = []
    for consumer in far:
        if groups and consumer.level - groups[-1][0].level <= config.swapin_groupby:
            groups[-1].append(consumer)
        else:
            groups.append([consumer])
    swap_ins = []
    for number, group in enumerate(groups):
        first = group[0]
        target = first.level - max(1, config.swapin_ahead)
        trigger = find_trigger(graph, first, target)
        if trigger is None:
            raise _CannotSwap(f"no backward op that depends on data runs before {first.name} to start its swap-in")
        waiters = []
        if config.sync_mode in (2, 3):
            # The trigger's backward successors wait for the copy, so it is done before they start.
            waiters = sorted({s for s in graph.successors(trigger.name) if graph[s].category == BACKWARD})
        swap_ins.append(SwapIn(
            name=f"lms/swapin_{producer.name}_{index}_{number}",
            arrival=f"lms/arrive_{producer.name}_{index}_{number}" if waiters else None,
            trigger=trigger.name, trigger_level=trigger.level,
            consumers=[c.name for c in group], consumer_levels=[c.level for c in group], waiters=waiters))
    return swap_ins


def find_trigger(graph: Graph, consumer: Op, target_level: int) -> Op | None:
    """Walks back from `consumer` along its latest backward input (data or control) that is neither a
    folded constant nor inside v1 control flow (a control edge out of a loop frame is illegal), until
    at or below `target_level`. Levels fall strictly along the walk, so the
    trigger can never depend on the swap-in it starts (no cycle)."""
    latest = latest_backward_inputs(graph)
    current = consumer.name
    while graph[current].level > target_level and latest[current] is not None:
        current = latest[current]
    return None if current == consumer.name else graph[current]


@once_per_graph
def latest_backward_inputs(graph: Graph) -> dict[str, str | None]:
    """For every op, the input `find_trigger` steps back to (`latest_backward_input`).
    Found once per graph, so a walk back over hundreds of levels costs one lookup per level."""
    removed = no_trigger_ops(graph)
    return {name: latest_backward_input(graph, name, removed) for name in graph.order}


def no_trigger_ops(graph: Graph) -> frozenset[str]:
    """Ops no executed op keeps the name of: folded constants, transpose pairs Grappler removes, and
    ops fused on a CPU."""
    return constant_ops(graph) | transpose_pairs(graph) | fused_on_cpu(graph)


def latest_backward_input(graph: Graph, name: str, removed: frozenset[str] | set[str]) -> str | None:
    """`name`'s backward predecessor of the highest level (then name) that is not in `removed`, nor
    inside v1 control flow, nor a functional loop; None if none."""
    # A functional loop is no trigger: TensorFlow lowers it to v1 control flow before running
    # it, and no executed op keeps its name (a gradient loop, walking back from the next one).
    backward = [graph[p] for p in graph.predecessors(graph[name])
                if graph[p].category == BACKWARD and p not in removed and graph[p].region is None
                and graph[p].type not in WHILE_TYPES]
    return max(backward, key=lambda op: (op.level, op.name)).name if backward else None


def _shape_text(shape) -> str:
    return "unknown" if shape is None else "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
