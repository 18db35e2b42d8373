"""lms_core.memory without TensorFlow: the BFC allocator model on traces worked out by hand, the planned
pool against an independent overlap check and known optima, and lifetimes from a simulated tiny step.

The BFC expectations follow TensorFlow 2.18's bfc_allocator.cc as its rules are written in the module's
docstring, applied here by hand: 256-byte rounding, bins by powers of two, the smallest chunk that fits,
a split when the chunk is at least twice the request, merges with free neighbours, regions that start
at 2 MiB and double.
"""
from __future__ import annotations

import itertools
import random

import pytest

from lms_core.graph import Graph, Op, TensorInfo
from lms_core.link import INFINITE, LinkRates
from lms_core.memory import (CPU_BFC, GPU_BFC, AllocationTrace, BFCAllocator, BFCOptions, Lifetime, TraceEvent,
                             overlapping_pairs, peak_live, plan_pool, replay, smallest_limit, step_memory)
from lms_core.memory.bfc import bin_for_size, rounded_bytes
from lms_core.memory.lifetimes import Adopted
from lms_core.passes.pipeline import analyze
from lms_core.plan import Plan
from lms_core.simulator import simulate
from tests.fixtures import chain_step, unit_costs

KIB, MIB = 1 << 10, 1 << 20
GPU_GROWTH_GC = BFCOptions(allow_growth=True, garbage_collection=True)


def offsets(allocator: BFCAllocator) -> list[list[tuple[int, int, bool]]]:
    return allocator.layout()


def offset_of(chunk) -> tuple[int, int, int]:
    return chunk.region.index, chunk.ptr - chunk.region.base, chunk.size


# BFC: the rules one at a time -------------------------------------------------------------------------

def test_requests_round_to_256_bytes_and_bins_double_from_256():
    assert [rounded_bytes(n) for n in (1, 256, 257, 1000, 1024)] == [256, 256, 512, 1024, 1024]
    assert [bin_for_size(n) for n in (256, 511, 512, 1023, 1024, 2048)] == [0, 0, 1, 1, 2, 3]
    assert bin_for_size(256 << 20) == 20 and bin_for_size(1 << 40) == 20  # the last bin takes everything larger


def test_a_chunk_is_split_only_when_it_is_twice_the_request():
    allocator = BFCAllocator(8 * MIB, CPU_BFC)
    a = allocator.allocate(1000)  # the first region is 2 MiB (growth); 1024 B off its front, the rest free
    assert offset_of(a) == (0, 0, 1024)
    assert offsets(allocator) == [[(0, 1024, True), (1024, 2 * MIB - 1024, False)]]
    b = allocator.allocate(3000)  # 3072 B next to it
    assert offset_of(b) == (0, 1024, 3072)
    allocator.free(a.ptr)  # [0, 1024) free; its neighbour is in use, nothing to merge
    c = allocator.allocate(512)  # 1024 >= 2 x 512: split, 512 B stay free at 512
    assert offset_of(c) == (0, 0, 512)
    d = allocator.allocate(300)  # the free 512 at offset 512 is the smallest that fits; 512 < 2 x 512: no split
    assert offset_of(d) == (0, 512, 512)
    assert allocator.in_use == 512 + 512 + 3072 and allocator.requested == 512 + 300 + 3000


def test_best_fit_takes_the_smallest_chunk_that_fits_not_the_first():
    allocator = BFCAllocator(8 * MIB, CPU_BFC)
    chunks = [allocator.allocate(n) for n in (4096, 256, 2048, 256)]  # 4096 | 256 | 2048 | 256 | rest
    allocator.free(chunks[0].ptr)
    allocator.free(chunks[2].ptr)  # free: 4096 at 0, 2048 at 4352
    e = allocator.allocate(1500)  # rounds to 1536: the 2048 chunk is smaller than the 4096 one; not split
    assert offset_of(e) == (0, 4096 + 256, 2048)


def test_freed_neighbours_merge_into_one_chunk():
    allocator = BFCAllocator(8 * MIB, CPU_BFC)
    a, b, c = (allocator.allocate(256 * KIB) for _ in range(3))
    allocator.free(b.ptr)  # a | free b | c | rest
    assert [size for _, size, used in offsets(allocator)[0] if not used] == [256 * KIB, 2 * MIB - 768 * KIB]
    allocator.free(a.ptr)  # merges with b (after it)
    assert offsets(allocator)[0][:2] == [(0, 512 * KIB, False), (512 * KIB, 256 * KIB, True)]
    allocator.free(c.ptr)  # merges with a+b before it and the rest after it: the whole region, one chunk
    assert offsets(allocator) == [[(0, 2 * MIB, False)]]
    assert allocator.largest_free_chunk() == 2 * MIB


def test_regions_grow_by_doubling_and_stop_at_the_limit():
    allocator = BFCAllocator(16 * MIB, CPU_BFC)
    # 3 MiB > the 2 MiB first region: doubled once, a 4 MiB region; 4 < 2 x 3 MiB and the 1 MiB left is
    # under the 128 MiB cap, so the whole region is the chunk.
    assert offset_of(allocator.allocate(3 * MIB)) == (0, 0, 4 * MIB)
    assert allocator.curr_region_bytes == 4 * MIB  # doubled for this request: not again afterwards
    # Nothing free: a second region of 4 MiB (no doubling needed: it doubles afterwards), split.
    assert offset_of(allocator.allocate(MIB + 512)) == (1, 0, MIB + 512)
    assert [r.size for r in allocator.regions] == [4 * MIB, 4 * MIB] and allocator.curr_region_bytes == 8 * MIB
    # 7 MiB fits no free chunk (3 MiB - 512 left in region 1); 8 MiB left under the limit: a region of
    # min(8, 8) MiB, not split (8 < 14).
    assert offset_of(allocator.allocate(7 * MIB)) == (2, 0, 8 * MIB) and allocator.pool == 16 * MIB
    assert allocator.allocate(3 * MIB) is None  # 3 MiB - 512 is the largest free chunk, nothing left to grow by
    assert offset_of(allocator.allocate(3 * MIB - 512)) == (1, MIB + 512, 3 * MIB - 512)


def test_the_last_region_is_what_the_limit_leaves():
    allocator = BFCAllocator(5 * MIB, CPU_BFC)
    allocator.allocate(MIB)  # region 0: 2 MiB (then the next would be 4)
    chunk = allocator.allocate(2 * MIB + 512 * KIB)  # 1 MiB free there; the next region would be 4 MiB, the limit leaves 3
    assert [r.size for r in allocator.regions] == [2 * MIB, 3 * MIB]
    assert offset_of(chunk) == (1, 0, 3 * MIB)  # 3 < 2 x 2.5 MiB: not split, the caller holds all 3 MiB


def test_without_growth_one_region_holds_the_whole_limit():
    allocator = BFCAllocator(10 * MIB, GPU_BFC)
    allocator.allocate(256)
    assert [r.size for r in allocator.regions] == [10 * MIB]


def test_a_fragmentation_failure_where_the_live_bytes_fit_but_no_chunk_does():
    # Limit 2 MiB = one region. Four 512 KiB buffers fill it; the first and third go: 1 MiB free in
    # two chunks that are not neighbours. 1 MiB live + 1 MiB asked = 2 MiB, the limit, yet no chunk
    # holds 1 MiB and the limit leaves nothing to grow by.
    trace = AllocationTrace(tuple(
        [TraceEvent(i, 512 * KIB, True) for i in range(4)]
        + [TraceEvent(0, 512 * KIB, False), TraceEvent(2, 512 * KIB, False), TraceEvent("big", MIB, True, "big op")]))
    assert trace.live_peak() == 2 * MIB
    result = replay(trace, 2 * MIB, CPU_BFC)
    assert not result.ok and result.failure.event_index == 6 and result.failure.label == "big op"
    assert result.failure.fragmented and result.failure.largest_free_chunk == 512 * KIB
    assert result.failure.in_use_bytes == MIB and result.failure.pool_bytes == 2 * MIB
    # Released in the other order (second and third: neighbours), the two merge and it fits.
    merged = AllocationTrace(trace.events[:4] + (TraceEvent(1, 512 * KIB, False), TraceEvent(2, 512 * KIB, False),
                                                 trace.events[6]))
    assert replay(merged, 2 * MIB, CPU_BFC).ok


def test_garbage_collection_returns_empty_regions_to_make_a_larger_one():
    # Regions of 2 and 4 MiB under a 6 MiB limit, both emptied; 5 MiB fits in neither. Without garbage
    # collection that is the end; with it both go back and one region of min(8, 6) MiB is made.
    events = [TraceEvent("a", 1536 * KIB, True), TraceEvent("b", 3 * MIB, True), TraceEvent("a", 1536 * KIB, False),
              TraceEvent("b", 3 * MIB, False), TraceEvent("c", 5 * MIB, True)]
    without = replay(events, 6 * MIB, CPU_BFC)
    assert not without.ok and without.failure.fragmented and without.regions == (2 * MIB, 4 * MIB)
    with_gc = replay(events, 6 * MIB, GPU_GROWTH_GC)
    assert with_gc.ok and with_gc.regions == (6 * MIB,)


def test_a_large_chunk_is_split_past_the_fragmentation_cap_even_when_under_twice_the_request():
    allocator = BFCAllocator(2 << 30, GPU_BFC)  # one 2 GiB region
    chunk = allocator.allocate(1200 * MIB)  # the free chunk (2048 MiB) < 2 x 1200, but 848 MiB >= 128 MiB left
    assert chunk.size == 1200 * MIB
    capped = BFCAllocator(4 * MIB, BFCOptions(allow_growth=False, fragmentation_fraction=0.25))
    assert capped.allocate(3 * MIB - 256).size == 3 * MIB - 256  # 1 MiB left >= 0.25 x 4 MiB: split
    plain = BFCAllocator(4 * MIB, BFCOptions(allow_growth=False))
    assert plain.allocate(3 * MIB - 256).size == 4 * MIB  # under the 128 MiB cap: the whole chunk


def test_the_smallest_limit_of_a_hand_worked_trace():
    # 3 MiB, released, then 5 MiB. With growth (CPU): the first region, 2 MiB doubled to 4 for the 3 MiB
    # request, is min(4, L); the 5 MiB request fits in no chunk of it and needs a second region:
    # L - min(4, L) >= 5, so L >= 9, with 5 MiB ever live.
    trace = AllocationTrace((TraceEvent("a", 3 * MIB, True), TraceEvent("a", 3 * MIB, False),
                             TraceEvent("b", 5 * MIB, True)))
    cpu = smallest_limit(trace, CPU_BFC)
    assert cpu.limit_bytes == 9 * MIB and cpu.live_peak_bytes == 5 * MIB
    assert cpu.below is not None and not cpu.below.ok and cpu.below.failure.fragmented
    # With garbage collection the emptied region goes back for the 5 MiB (L >= 5); without growth, one region.
    assert smallest_limit(trace, GPU_GROWTH_GC).limit_bytes == 5 * MIB
    assert smallest_limit(trace, GPU_BFC).limit_bytes == 5 * MIB
    assert smallest_limit(trace, GPU_BFC, granularity=256).limit_bytes == 5 * MIB


def test_replay_is_a_fresh_allocator_per_limit_and_keeps_the_layout():
    trace = AllocationTrace((TraceEvent(0, 100, True), TraceEvent(1, 300, True), TraceEvent(0, 100, False),
                             TraceEvent(2, 50, True)))
    result = replay(trace, MIB, CPU_BFC, keep_layout=True)  # the first region is the whole 1 MiB limit
    assert result.layout == {0: (0, 0, 256), 1: (0, 256, 512), 3: (0, 0, 256)}  # 2 reuses 0's chunk
    assert result.peak.in_use_bytes == 768 and result.regions == (MIB,)


# The planned pool -------------------------------------------------------------------------------------

def independent_overlaps(lifetimes: list[Lifetime], plan) -> list[tuple]:
    """Every pair live at the same time whose pool ranges overlap, by brute force."""
    bad = []
    for a, b in itertools.combinations(lifetimes, 2):
        if a.start < b.end and b.start < a.end:
            a_low, b_low = plan.offsets[a.buffer], plan.offsets[b.buffer]
            if a_low < b_low + plan.sizes[b.buffer] and b_low < a_low + plan.sizes[a.buffer]:
                bad.append((a.buffer, b.buffer))
    return bad


def test_disjoint_lifetimes_share_one_place_and_reach_the_bound():
    lifetimes = [Lifetime(i, (i + 1) * KIB, 2 * i, 2 * i + 1) for i in range(6)]
    plan = plan_pool(lifetimes)
    assert plan.lower_bound_bytes == 6 * KIB and plan.pool_bytes == 6 * KIB and plan.gap == 0
    assert set(plan.offsets.values()) == {0}


def test_nested_lifetimes_stack_and_reach_the_bound():
    lifetimes = [Lifetime(i, 1024 * (5 - i), i, 10 - i) for i in range(5)]  # each inside the one before
    plan = plan_pool(lifetimes)
    assert plan.lower_bound_bytes == sum(1024 * (5 - i) for i in range(5)) == plan.pool_bytes
    assert not independent_overlaps(lifetimes, plan)


def test_a_released_buffer_s_place_is_reused_by_a_later_one():
    # A lives throughout; B then C, one after the other, of the same size: C goes where B was.
    lifetimes = [Lifetime("A", 8 * KIB, 0, 10), Lifetime("B", 4 * KIB, 0, 5), Lifetime("C", 4 * KIB, 5, 10)]
    plan = plan_pool(lifetimes)
    assert plan.pool_bytes == 12 * KIB == plan.lower_bound_bytes
    assert plan.offsets["B"] == plan.offsets["C"]


@pytest.mark.parametrize("seed", range(5))
def test_random_lifetimes_never_overlap_in_memory(seed):
    rng = random.Random(seed)
    lifetimes = []
    for i in range(150):
        start = rng.randrange(0, 300)
        lifetimes.append(Lifetime(i, rng.choice([100, 256, 3000, 64 * KIB, 300 * KIB]), start,
                                  start + rng.randrange(1, 60)))
    plan = plan_pool(lifetimes)
    assert not independent_overlaps(lifetimes, plan)
    assert not overlapping_pairs(lifetimes, plan)
    assert plan.pool_bytes >= plan.lower_bound_bytes == peak_live(lifetimes, 256)
    assert all(offset % 256 == 0 for offset in plan.offsets.values())


def test_the_lower_bound_is_the_most_bytes_live_at_once():
    lifetimes = [Lifetime("a", 1000, 0, 4), Lifetime("b", 2000, 2, 6), Lifetime("c", 512, 4, 8)]
    # at [2, 4): a + b; at [4, 6): b + c (a released as c is allocated: half-open)
    assert peak_live(lifetimes) == 3000 and peak_live(lifetimes, 256) == 1024 + 2048


def test_trace_lifetimes_are_positions_of_allocation_and_release():
    trace = AllocationTrace((TraceEvent("a", 10, True), TraceEvent("b", 20, True), TraceEvent("a", 10, False),
                             TraceEvent("c", 30, True)))
    assert [(lt.buffer, lt.start, lt.end) for lt in trace.lifetimes()] == [("a", 0, 2), ("b", 1, 4), ("c", 3, 4)]
    assert AllocationTrace.from_lifetimes(trace.lifetimes()).live_peak() == trace.live_peak() == 50


# Lifetimes from a simulated tiny step --------------------------------------------------------------------

def info(kib: int) -> TensorInfo:
    return TensorInfo((kib * 256,), "float32", kib * KIB)


def tiny_training_step() -> Graph:
    """x (input) and w (a variable read) feed a; r views a (Reshape); b reads r; loss reads b. The
    update reads w and the loss and assigns the result to the variable."""
    ops = [Op("x", "Placeholder", outputs=[info(64)]),
           Op("w_handle", "Placeholder", outputs=[TensorInfo((), "resource", None)]),
           Op("w", "ReadVariableOp", inputs=["w_handle:0"], outputs=[info(16)]),
           Op("a", "MatMul", inputs=["x:0", "w:0"], outputs=[info(256)]),
           Op("r", "Reshape", inputs=["a:0"], outputs=[info(256)]),
           Op("b", "Relu", inputs=["r:0"], outputs=[info(128)]),
           Op("loss", "Sum", inputs=["b:0"], outputs=[TensorInfo((), "float32", 4)]),
           Op("sgd/new", "Sub", inputs=["w:0", "loss:0"], outputs=[info(16)]),
           Op("sgd/assign", "AssignVariableOp", inputs=["w_handle:0", "sgd/new:0"])]
    return analyze(Graph(ops, outputs=["loss:0"]))


def test_memory_events_name_the_op_that_recorded_them_and_change_nothing_else():
    g = tiny_training_step()
    plain = simulate(g, Plan(settings={}), unit_costs(g), INFINITE)
    kept = simulate(g, Plan(settings={}), unit_costs(g), INFINITE, keep_events=True)
    assert kept.peak_device_bytes == plain.peak_device_bytes and plain.memory_events is None
    order = [name for name, _, _ in kept.executed]
    for event in kept.memory_events:
        op = order[event.op_index]
        if event.nbytes > 0:  # allocated by its producer
            assert op == event.buffer.rpartition(":")[0]
        else:  # released by its last reader, as it ends
            readers = [c for c, _ in g.consumers(event.buffer)]
            assert op == max(readers, key=order.index) if readers else op == event.buffer.rpartition(":")[0]
            assert event.time == kept.executed[event.op_index][2]


def test_simulator_buffers_without_the_runtime_view():
    g = tiny_training_step()
    result = simulate(g, Plan(settings={}), unit_costs(g), INFINITE, keep_events=True)
    memory = step_memory(g, result, as_runtime=False)
    order = list(memory.executed)
    spans = {lt.buffer: lt for lt in memory.lifetimes}
    assert set(spans) == {"x:0", "w:0", "a:0", "r:0", "b:0", "loss:0", "sgd/new:0"}
    assert (order[spans["a:0"].alloc_op], order[spans["a:0"].free_op]) == ("a", "r")  # the Reshape is a's last reader
    assert (order[spans["r:0"].alloc_op], order[spans["r:0"].free_op]) == ("r", "b")
    assert memory.resident == ()


def test_runtime_view_variables_views_and_an_adopted_assignment():
    g = tiny_training_step()
    result = simulate(g, Plan(settings={}), unit_costs(g), INFINITE, keep_events=True)
    memory = step_memory(g, result)
    order = list(memory.executed)
    # The variable (16 KiB, read by w) and the input x are held from before the step.
    assert memory.resident == (("x:0", 64 * KIB, "x"), ("variable w_handle:0", 16 * KIB, "w_handle:0"))
    spans = {lt.buffer: lt for lt in memory.lifetimes}
    # r shares a's buffer, which lives until r's reader b ends; w:0 is the variable itself.
    assert set(spans) == {"a:0", "b:0", "loss:0", "sgd/new:0"}
    assert order[spans["a:0"].free_op] == "b" and spans["a:0"].nbytes == 256 * KIB
    # The assignment adopts sgd/new's buffer: it outlives the step, and the variable's old one is released.
    adopted = [e for e in memory.step.events if isinstance(e.buffer, Adopted)]
    assert [(e.buffer.variable, e.buffer.value, e.nbytes) for e in adopted] == [
        ("variable w_handle:0", "sgd/new:0", 16 * KIB)]
    assert spans["sgd/new:0"].end == len(memory.step.events) and spans["sgd/new:0"].free_op is None
    two = memory.trace(steps=2)
    releases = [e.buffer for e in two.events if not e.alloc and e.nbytes == 16 * KIB]
    assert releases == [("resident", "variable w_handle:0"), (0, "sgd/new:0")]  # each step frees the one before
    # By hand: x + variable = 80 KiB resident; a (256 KiB) lives until b ends, and the loss (4 B) is
    # allocated as b ends (the simulator counts an op's outputs with its predecessor's frees): 464 KiB + 4 B.
    assert two.live_peak() == (64 + 16 + 256 + 128) * KIB + 4


@pytest.mark.parametrize("sync_mode", [0, 1])
def test_a_swapped_tensor_is_released_when_the_executor_sees_its_copy_end_and_the_copy_back_starts_at_its_trigger(
        sync_mode):
    from lms_core.config import LMSConfig
    from lms_core.planner import plan_swaps

    g = chain_step()
    plan = plan_swaps(g, LMSConfig(swapout_threshold=4, swapin_ahead=1, min_tensor_bytes=MIB, sync_mode=sync_mode))
    assert [s.tensor for s in plan.swaps] == ["a:0", "b:0"]
    slow = LinkRates("slow", MIB, MIB, "test")  # 4 s per 4 MiB copy
    result = simulate(g, plan, unit_costs(g), slow, keep_events=True)
    memory = step_memory(g, result, as_runtime=False)
    spans = {lt.buffer: lt for lt in memory.lifetimes}
    starts = {name: start for name, start, _ in result.executed}
    ends = {name: end for name, _, end in result.executed}
    # a's copy to the host starts as a ends and takes 4 s; b (its device reader) ends before that.
    if sync_mode == 1:  # b waits for that copy (done at 7) and then reads a, which is released as b ends
        assert plan.swaps[0].waiters == ["b"]
        assert spans["a:0"].free_time == ends["b"] == ends["a"] + 4.0 + 1.0
    else:  # nothing waits for it: TensorFlow's executor, running ahead of the GPU, sees it only at its
        # next wait for the GPU. The first is grad_b's, for b's copy back: b's copy out runs 7-11 (behind
        # a's, 3-7), its copy back 11-15, so grad_b starts at 15.
        assert not plan.swaps[0].waiters and ends["a"] == 3.0
        assert spans["a:0"].free_time == starts["gradient_tape/grad_b"] == 15.0
    swap_in = plan.swaps[0].swap_ins[0]
    copy_back = spans[swap_in.name]
    assert memory.executed[copy_back.alloc_op] == swap_in.trigger  # allocated as its trigger's copy starts
    assert copy_back.alloc_time >= ends[swap_in.trigger]
    assert memory.executed[copy_back.free_op] == "gradient_tape/grad_a"


def forwarding_step(relu_input_read_later: bool) -> Graph:
    """a = MatMul(x, w); b = Relu(a), same size; loss = Sum(b) (+ a read again by `late` if asked)."""
    ops = [Op("x", "Placeholder", outputs=[info(64)]),
           Op("w_handle", "Placeholder", outputs=[TensorInfo((), "resource", None)]),
           Op("w", "ReadVariableOp", inputs=["w_handle:0"], outputs=[info(16)]),
           Op("a", "MatMul", inputs=["x:0", "w:0"], outputs=[info(256)]),
           Op("b", "Relu", inputs=["a:0"], outputs=[info(256)]),
           Op("loss", "Sum", inputs=["b:0"], outputs=[TensorInfo((), "float32", 4)])]
    if relu_input_read_later:
        ops.append(Op("late", "Sum", inputs=["a:0", "loss:0"], outputs=[TensorInfo((), "float32", 4)]))
    return analyze(Graph(ops, outputs=["late:0" if relu_input_read_later else "loss:0"]))


def test_an_element_wise_op_writes_into_the_input_it_reads_last():
    g = forwarding_step(relu_input_read_later=False)
    memory = step_memory(g, simulate(g, Plan(settings={}), unit_costs(g), INFINITE, keep_events=True))
    spans = {lt.buffer: lt for lt in memory.lifetimes}
    assert "b:0" not in spans and memory.executed[spans["a:0"].free_op] == "loss"  # b lives in a's buffer
    assert memory.step.live_peak() == 256 * KIB + 4  # never a and b apart
    # Negative control: a is read again after the Relu, so b needs a buffer of its own.
    g = forwarding_step(relu_input_read_later=True)
    memory = step_memory(g, simulate(g, Plan(settings={}), unit_costs(g), INFINITE, keep_events=True))
    spans = {lt.buffer: lt for lt in memory.lifetimes}
    assert {"a:0", "b:0"} <= set(spans) and memory.step.live_peak() >= 512 * KIB


def test_measured_scratch_is_held_while_its_op_runs():
    g = forwarding_step(relu_input_read_later=False)
    result = simulate(g, Plan(settings={}), unit_costs(g), INFINITE, keep_events=True)
    memory = step_memory(g, result, scratch={"a": MIB})
    events = [(e.buffer, e.alloc) for e in memory.step.events]
    at = events.index(("a:0", True))  # the MatMul's output, then its scratch, allocated and released
    assert events[at + 1:at + 3] == [("scratch of a", True), ("scratch of a", False)]
    assert memory.step.live_peak() == 256 * KIB + MIB
