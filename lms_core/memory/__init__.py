"""Memory below the schedule: buffer lifetimes, a model of TensorFlow's BFC allocator, and a planned pool.

    graph = executed_graph(graph)                       # without the IdentityN barrier Grappler removes
    memory = step_memory(graph, simulate(graph, plan, costs, link, keep_events=True))
    trace = memory.trace(steps=2)                       # resident buffers, then two steps
    requirement = smallest_limit(trace, GPU_BFC)        # what the allocator needs, fragmentation included
    pool = plan_pool(trace.lifetimes())                 # offsets planned from the lifetimes, and the bound

No TensorFlow here: lms_core.tf.allocations records TensorFlow's real allocation trace.
"""
from lms_core.memory.bfc import (CPU_BFC, GPU_BFC, GPU_BFC_GROWTH, BFCAllocator, BFCOptions, Failure, ReplayResult,
                                 Requirement, Snapshot, replay, smallest_limit)
from lms_core.memory.lifetimes import (Adopted, AllocationTrace, Lifetime, StepMemory, TraceEvent, executed_graph,
                                       peak_live, step_memory)
from lms_core.memory.pool import PoolPlan, overlapping_pairs, plan_pool

__all__ = ["CPU_BFC", "GPU_BFC", "GPU_BFC_GROWTH", "BFCAllocator", "BFCOptions", "Failure", "ReplayResult", "Requirement",
           "Snapshot", "replay", "smallest_limit", "Adopted", "AllocationTrace", "Lifetime", "StepMemory", "TraceEvent",
           "executed_graph", "peak_live", "step_memory", "PoolPlan", "overlapping_pairs", "plan_pool"]
