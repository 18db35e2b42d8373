"""Swap-ins must wait for their triggers in what TensorFlow really executes.

Every test here runs the rewritten step on split devices (compute /device:CPU:1, host /device:CPU:0),
so TensorFlow partitions it per device with _Send/_Recv pairs as it would for a GPU, and reads what
TensorFlow reports: the partition graphs of the run, or the executor's timeline from its profiler.
The negative control is the placement the project had before (swap-in on the compute device), which
TensorFlow runs as soon as the swap-out is done: the check must fail on it.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import pytest
import tensorflow as tf

import lms_core.tf as lms_tf
from lms_core.config import LMSConfig
from lms_core.tf.gating import PartitionedGraph, check_partitions, executed_partitions, verify_gating
from lms_core.tf.op_profile import profiled
from lms_core.tf.reimport import IMPORT_SCOPE
from tests.fixtures import COMPUTE, HOST
from benchmarks.architectures import ARCHITECTURES, conv_relu_step, training_step

SWAP_ALL = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, swapin_ahead=1, min_tensor_bytes=0)


def rewritten_on_split_devices(name: str, config: LMSConfig = SWAP_ALL, placement=lms_tf.Placement.GATED_ON_HOST):
    _, _, step, specs, batch = training_step(ARCHITECTURES[name], device=COMPUTE)
    rewritten = lms_tf.rewrite(step, *specs, config=config, compute_device=COMPUTE, host_device=HOST,
                               placement=placement)
    return rewritten, batch


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_swap_in_is_gated_and_the_old_placement_is_not(name):
    gated, batch = rewritten_on_split_devices(name)
    report = verify_gating(gated, *batch)
    swap_ins = sum(len(s.swap_ins) for s in gated.plan.swaps)
    assert swap_ins > 0
    assert (report.gated, len(report.gates)) == (swap_ins, swap_ins), report.verification().first_failure()
    assert report.verification().describe().startswith(f"swap-ins gated: {swap_ins}/{swap_ins}")
    # Each swap-in is delivered by a _Recv of its own (a _Recv shared by two swap-ins would bring
    # the value back once, at the earlier trigger), except where Grappler removed every reader of
    # the value: then nothing is copied back at all (2 of the LSTM's 205, 3 of the Transformer's 35).
    delivered = [gate.recv for gate in report.gates if gate.recv is not None]
    assert len(set(delivered)) == len(delivered) > 0
    assert all(gate.reason.startswith("nothing reads the value") for gate in report.gates if gate.recv is None)

    ungated, batch = rewritten_on_split_devices(name, placement=lms_tf.Placement.UNGATED_ON_COMPUTE)
    before = verify_gating(ungated, *batch)
    assert (before.gated, len(before.gates)) == (0, swap_ins)
    verdict = before.verification()
    assert "does not depend on the trigger" in verdict.first_failure()
    assert list(verdict.ungated) == [s.name for swap in ungated.plan.swaps for s in swap.swap_ins]


def test_verification_restores_every_variable():
    """The check runs a real training step (weights and the optimizer's state change), then puts every
    variable the step touches back, bit for bit."""
    rewritten, batch = rewritten_on_split_devices("densenet_block")
    variables = rewritten.variables
    values = [v.numpy() for v in variables]
    verify_gating(rewritten, *batch)
    assert len(variables) > 10  # the weights, the momentum slots, the step counter
    for variable, value in zip(variables, values):
        assert (variable.numpy() == value).all(), variable.name
    rewritten(*batch)  # and a step does change them: the restore above was not vacuous
    assert any((variable.numpy() != value).any() for variable, value in zip(variables, values))


def test_with_one_device_nothing_is_copied_so_nothing_is_gated():
    """Compute and host the same device: no partitioning, no _Recv; the check says so rather than
    passing a swap that moves nothing."""
    _, _, step, specs, batch = training_step(ARCHITECTURES["densenet_block"], device=COMPUTE)
    rewritten = lms_tf.rewrite(step, *specs, config=SWAP_ALL, compute_device=COMPUTE, host_device=COMPUTE)
    report = verify_gating(rewritten, *batch)
    assert report.gated == 0 and report.gates
    assert "not received from another device" in report.verification().first_failure()


def test_sync_mode_3_waiters_wait_until_the_value_is_on_the_compute_device():
    """Sync mode 2/3 waiters must depend on the _Recv that brings the value to the compute device,
    not only on a host op; sync mode 1/3 forward waiters on the swap-out having reached the host."""
    config = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, swapin_ahead=2, sync_mode=3, min_tensor_bytes=0)
    rewritten, batch = rewritten_on_split_devices("densenet_block", config)
    graph = PartitionedGraph(executed_partitions(rewritten, *batch))
    checked_in = checked_out = 0
    for swap in rewritten.plan.swaps:
        for swap_in in swap.swap_ins:
            recv = graph.delivering_recv(f"{IMPORT_SCOPE}/{swap_in.name}", COMPUTE)
            for waiter in swap_in.waiters:
                if f"{IMPORT_SCOPE}/{waiter}" in graph.nodes:
                    assert recv in graph.ancestors(f"{IMPORT_SCOPE}/{waiter}"), waiter
                    checked_in += 1
        for waiter in swap.waiters:
            if f"{IMPORT_SCOPE}/{waiter}" in graph.nodes:
                assert f"{IMPORT_SCOPE}/{swap.swap_out}" in graph.ancestors(f"{IMPORT_SCOPE}/{waiter}"), waiter
                checked_out += 1
    assert checked_in > 5 and checked_out > 5


def test_swapin_groupby_0_gives_each_consumer_level_its_own_gated_copy():
    """A tensor read at several backward levels (the ReLU output feeds the next convolution's
    filter gradient and its own ReluGrad) gets one swap-in per level, each with its own trigger
    and its own _Recv, so each copy comes back at its own time."""
    step, specs = conv_relu_step((8, 8, 2), batch=2, blocks=3)
    config = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, swapin_ahead=1, swapin_groupby=0,
                       min_tensor_bytes=0, include_types=["Relu"])
    rewritten = lms_tf.rewrite(step, *specs, config=config, compute_device=COMPUTE, host_device=HOST)
    several = [swap for swap in rewritten.plan.swaps if len(swap.swap_ins) > 1]
    assert several
    with tf.device(COMPUTE):
        batch = (tf.random.uniform(specs[0].shape), tf.zeros(specs[1].shape, tf.int32))
    report = verify_gating(rewritten, *batch)
    assert report.all_gated, report.verification().first_failure()
    by_name = {gate.swap_in: gate for gate in report.gates}
    for swap in several:
        gates = [by_name[s.name] for s in swap.swap_ins]
        assert len({g.recv for g in gates}) == len(gates)
        assert len({s.trigger for s in swap.swap_ins}) == len(gates)


def test_the_check_names_what_is_wrong_on_hand_built_partitions():
    """The check alone, on executed partitions edited by hand: a consumer moved to the host (it reads
    the swap-in there, with no copy), and a trigger the executed graph lacks."""
    rewritten, batch = rewritten_on_split_devices("densenet_block")
    partitions = executed_partitions(rewritten, *batch)
    swap_in = rewritten.plan.swaps[0].swap_ins[0]
    graph = PartitionedGraph(partitions)
    recv = graph.delivering_recv(f"{IMPORT_SCOPE}/{swap_in.name}", COMPUTE)
    reader = next(n for n in graph.readers_of(recv))
    host = next(p for p in partitions if any(n.name == f"{IMPORT_SCOPE}/{swap_in.name}" for n in p.node))
    moved = host.node.add()
    moved.CopyFrom(reader)
    moved.name, moved.device = moved.name + "_on_host", host.node[0].device
    moved.input[:] = [f"{IMPORT_SCOPE}/{swap_in.name}" if i == recv else i for i in moved.input]
    report = check_partitions(partitions, rewritten.plan, COMPUTE, HOST)
    first = next(g for g in report.gates if g.swap_in == swap_in.name)
    assert not first.gated and first.reason.startswith(f"{moved.name} reads the value on")
    for partition in partitions:
        kept = [n for n in partition.node if n.name != f"{IMPORT_SCOPE}/{swap_in.trigger}"]
        del partition.node[:]
        partition.node.extend(kept)
    report = check_partitions(partitions, rewritten.plan, COMPUTE, HOST)
    first = next(g for g in report.gates if g.swap_in == swap_in.name)
    assert "is not among the executed ops" in first.reason


def test_a_trigger_the_remapper_fused_into_a_later_clone_is_checked_as_that_fused_op():
    """A swap-in may be triggered by a recompute's clone. Where Grappler's remapper fused that clone
    (a convolution) into a later clone of its segment (its bias add, as one `_FusedConv2D` under the
    bias add's name), the fused op is what ran it: the swap-in is gated when its copy waits for that
    op, and not when it does not. Hand-edited partitions: the trigger renamed away, a fused op in its
    place carrying its edges."""
    import dataclasses

    from lms_core.plan import Recompute

    rewritten, batch = rewritten_on_split_devices("densenet_block")
    partitions = executed_partitions(rewritten, *batch)
    swap_in = rewritten.plan.swaps[0].swap_ins[0]
    conv, bias = swap_in.trigger, swap_in.trigger + "_bias"
    entry = Recompute(tensor="t:0", nbytes=1, ops=["c", "b"], clones=[conv, bias], anchors=[], consumers=[],
                      trigger="x", seconds=0.0)
    plan = dataclasses.replace(rewritten.plan, recomputes=[entry])
    old_name, new_name = f"{IMPORT_SCOPE}/{conv}", f"{IMPORT_SCOPE}/{bias}"

    def renamed(reference: str) -> str:
        name = reference.lstrip("^").split(":")[0]
        return reference.replace(old_name, new_name, 1) if name == old_name else reference

    for partition in partitions:
        for node in partition.node:
            if node.name == old_name:
                node.name, node.op = new_name, "_FusedConv2D"
            node.input[:] = [renamed(i) for i in node.input]
    gate = next(g for g in check_partitions(partitions, plan, COMPUTE, HOST).gates if g.swap_in == swap_in.name)
    assert gate.gated, gate.reason
    unfused = dataclasses.replace(plan, recomputes=[])
    gate = next(g for g in check_partitions(partitions, unfused, COMPUTE, HOST).gates if g.swap_in == swap_in.name)
    assert not gate.gated and "is not among the executed ops" in gate.reason
    for partition in partitions:  # the fused op without the trigger's edges: the copy can come back any time
        for node in partition.node:
            node.input[:] = [i for i in node.input if i != f"^{IMPORT_SCOPE}/{bias}"]
    gate = next(g for g in check_partitions(partitions, plan, COMPUTE, HOST).gates if g.swap_in == swap_in.name)
    assert not gate.gated and "does not depend on the trigger" in gate.reason


@pytest.mark.parametrize("name", ["resnet50", "lstm"])
def test_the_executor_runs_each_swap_in_after_its_trigger_and_each_consumer_after_its_swap_in(name):
    """From TensorFlow's profiler (every op the executor ran, on one clock): the gated swap-in on the
    host starts after its trigger has ended, and every far consumer starts after the swap-in has ended."""
    rewritten, batch = rewritten_on_split_devices(name)
    rewritten(*batch)  # first call: instantiation, kernel set-up
    spans = executed_timeline(lambda: float(rewritten(*batch)))

    def span(op: str):
        runs = spans.get(f"{IMPORT_SCOPE}/{op}")
        return runs[0] if runs and len(runs) == 1 else None

    def trigger_done(trigger: str) -> int:
        """When the trigger had ended. The profiler leaves out a few ops (4 of ResNet-50's 49 `Neg`s,
        whose input Grappler merged with another's); for those, the earliest op the partitioner
        made for the trigger's cross-device control edge (`<trigger>/_N`, which can start only after
        the trigger has ended) stands in for it."""
        own = span(trigger)
        if own is not None:
            return own.end_ps
        prefix = f"{IMPORT_SCOPE}/{trigger}/_"
        plumbing = [run.start_ps for name, runs in spans.items() if name.startswith(prefix) for run in runs]
        assert plumbing, f"no event for the trigger {trigger} or its control edge"
        return min(plumbing)

    ordered = unread = 0
    for swap in rewritten.plan.swaps:
        for swap_in in swap.swap_ins:
            gate = span(swap_in.name)
            consumers = [c for c in map(span, swap_in.consumers) if c is not None]
            if gate is None:  # nothing reads the value (Grappler removed its readers): it never runs
                assert not consumers, swap_in.name
                unread += 1
                continue
            assert gate.start_ps >= trigger_done(swap_in.trigger), (swap_in.name, swap_in.trigger)
            ordered += 1
            for consumer in consumers:
                assert consumer.start_ps >= gate.end_ps, swap_in.name
    assert ordered + unread == sum(len(s.swap_ins) for s in rewritten.plan.swaps) and ordered > 10 * unread


# --- the executor's timeline, from TensorFlow's profiler ------------------------------------------
# The profiler's host tracer at level 3 records every op the executor runs (cheap ones such as
# `Identity` and `_Recv` included) as an event named `op_name:OpType` on the thread that ran it, with
# one clock for all threads: the executor's real order.

VERBOSE = 3  # the host tracer level that records inexpensive ops too


@dataclass(frozen=True)
class Span:
    start_ps: int
    end_ps: int


def executed_timeline(run_step: Callable[[], object]) -> dict[str, list[Span]]:
    """Runs `run_step` once (it must wait for the step to finish) under the profiler and returns,
    for every op the executor ran, when each of its runs started and ended."""
    space = profiled(run_step, steps=1, host_tracer_level=VERBOSE)
    spans: dict[str, list[Span]] = defaultdict(list)
    for plane in space.planes:
        for line in plane.lines:
            base_ps = line.timestamp_ns * 1000
            for event in line.events:
                name, separator, _ = plane.event_metadata[event.metadata_id].name.rpartition(":")
                if separator:
                    start = base_ps + event.offset_ps
                    spans[name].append(Span(start, start + event.duration_ps))
    return dict(spans)
