"""When each op of an executed step started and ended, from TensorFlow's own profiler.

The profiler's host tracer at level 3 records every op the executor runs (cheap ones such as
`Identity` and `_Recv` included) as an event named `op_name:OpType` on the thread that ran it, with
one clock for all threads. That is the executor's real order, which a gated swap-in must respect:
its host op starts after its trigger has ended, and its consumers start after the value arrived.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from lms_core.tf.op_profile import profiled

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
