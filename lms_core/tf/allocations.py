"""TensorFlow's real allocation trace, from its profiler, and the environment of a memory-limited probe.

TensorFlow's BFC allocator reports every allocation and release to the profiler (a TraceMe instant
event, `MemoryAllocation` / `MemoryDeallocation`, recorded at host tracer level 2 and up) with the
allocator's name, the bytes requested (`requested_bytes`), the chunk given (`allocation_bytes`), its
address (`addr`), the bytes in use after it (`bytes_allocated`), and the op, tensor shape and kind
(`tf_op`, `shape`, `region_type`) it was made for. The events are taken under the allocator's lock,
so sorted by time they are the allocator's own order; `bytes_allocated` lets that be checked event by
event (`RecordedTrace.check`).

On a machine without a GPU the CPU device's allocator plays the device: with
`TF_CPU_ALLOCATOR_USE_BFC=true` it is a BFC allocator named `bfc_cpu_allocator_for_gpu`, held to
`TF_CPU_BFC_MEM_LIMIT_IN_MB`. TensorFlow reads both once, when it makes the allocator, and the limit
is a whole number of MiB (ReadInt64FromEnvVar, times 2^20): a probe's limit cannot be finer than
1 MiB. Every CPU tensor of the process goes through it: the variables as Keras makes them, the
caller's batch, the step's tensors, the kernels' temporaries.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lms_core.memory.lifetimes import AllocationTrace, TraceEvent

CPU_BFC_ALLOCATOR = "bfc_cpu_allocator_for_gpu"  # the name TensorFlow gives the CPU device's BFC allocator
TF_CPU_ALLOCATOR_USE_BFC = "TF_CPU_ALLOCATOR_USE_BFC"
TF_CPU_BFC_MEM_LIMIT_IN_MB = "TF_CPU_BFC_MEM_LIMIT_IN_MB"
MIB = 1 << 20
ALLOCATION, DEALLOCATION = "MemoryAllocation", "MemoryDeallocation"


def limit_environment(limit_bytes: int) -> dict[str, str]:
    """The variables that hold TensorFlow's CPU allocator to `limit_bytes` (a whole number of MiB,
    the finest limit TensorFlow accepts); set before TensorFlow starts."""
    if limit_bytes <= 0 or limit_bytes % MIB:
        raise ValueError(f"TensorFlow's CPU allocator limit is a whole number of MiB; got {limit_bytes} bytes")
    return {TF_CPU_ALLOCATOR_USE_BFC: "true", TF_CPU_BFC_MEM_LIMIT_IN_MB: str(limit_bytes // MIB)}


@dataclass(frozen=True)
class RecordedEvent:
    """What the profiler adds to one event of the trace."""

    address: int
    chunk_bytes: int  # allocation_bytes: the chunk the allocator gave (or took back)
    in_use_after: int  # bytes_allocated: the allocator's bytes in use after the event
    op: str  # tf_op ("(null)" when no op was running: eager Python code, the executor's own buffers)
    kind: str  # region_type: "output", "temp", "persist", ... or "(null)"
    shape: str
    time_ps: int  # from the start of the trace


@dataclass(frozen=True)
class RecordedTrace:
    """A real allocation trace: `trace` (buffer ids are allocation numbers) and, event by event, the
    profiler's details."""

    allocator: str
    trace: AllocationTrace
    details: tuple[RecordedEvent, ...]
    in_use_before: int  # bytes the allocator held before the first recorded event (allocated untraced)

    def check(self) -> list[str]:
        """Where the recorded order disagrees with the allocator's own count (bytes in use after each
        event); empty when the order is the allocator's."""
        problems, in_use = [], self.in_use_before
        for index, (event, detail) in enumerate(zip(self.trace.events, self.details)):
            in_use += detail.chunk_bytes if event.alloc else -detail.chunk_bytes
            if in_use != detail.in_use_after:
                problems.append(f"event {index}: {in_use} B in use by the trace, {detail.in_use_after} B by the allocator")
                in_use = detail.in_use_after
        return problems

    def peak_by_kind(self) -> dict[str, int]:
        """Bytes requested and live at the trace's live peak, by kind (`output`, `temp`: a kernel's
        scratch, `persist`, ... and "(null)" for buffers made outside any op)."""
        live: dict = {}
        current = peak = 0
        at_peak: dict = {}
        for event, detail in zip(self.trace.events, self.details):
            if event.alloc:
                live[event.buffer] = (event.nbytes, detail.kind)
                current += event.nbytes
                if current > peak:
                    peak, at_peak = current, dict(live)
            elif event.buffer in live:
                current -= live.pop(event.buffer)[0]
        kinds: dict[str, int] = {}
        for nbytes, kind in at_peak.values():
            kinds[kind] = kinds.get(kind, 0) + nbytes
        return kinds

    def scratch_by_op(self) -> dict[str, int]:
        """For each op, the most bytes of temporaries (kind `temp`: a kernel's scratch, released before
        it returns) it held at once, over the trace."""
        live: dict = {}
        held: dict[str, int] = {}
        most: dict[str, int] = {}
        for event, detail in zip(self.trace.events, self.details):
            if event.alloc and detail.kind == "temp":
                live[event.buffer] = (event.label, event.nbytes)
                held[event.label] = held.get(event.label, 0) + event.nbytes
                most[event.label] = max(most.get(event.label, 0), held[event.label])
            elif not event.alloc and event.buffer in live:
                label, nbytes = live.pop(event.buffer)
                held[label] -= nbytes
        return most

    def to_dict(self) -> dict:
        rows = [[e.buffer, e.nbytes, int(e.alloc), e.label, d.address, d.chunk_bytes, d.in_use_after, d.kind, d.shape,
                 d.time_ps] for e, d in zip(self.trace.events, self.details)]
        return {"allocator": self.allocator, "in_use_before": self.in_use_before, "events": rows}

    @staticmethod
    def from_dict(data: dict) -> "RecordedTrace":
        events, details = [], []
        for buffer, nbytes, alloc, label, address, chunk, in_use, kind, shape, time_ps in data["events"]:
            events.append(TraceEvent(buffer if not isinstance(buffer, list) else tuple(buffer), nbytes, bool(alloc), label))
            details.append(RecordedEvent(address, chunk, in_use, label, kind, shape, time_ps))
        return RecordedTrace(data["allocator"], AllocationTrace(tuple(events)), tuple(details), data["in_use_before"])

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @staticmethod
    def from_json(text: str) -> "RecordedTrace":
        return RecordedTrace.from_dict(json.loads(text))


_DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
                "int32": 4, "int64": 8, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
                "complex128": 16, "uint32": 4, "uint64": 8, "uint16": 2}
_OOM_TENSOR = re.compile(r"OOM when allocating tensor with shape\[([0-9,]*)\] and type (\w+)")


def failed_request_bytes(message: str) -> int | None:
    """The bytes of the tensor TensorFlow's out-of-memory error names ("OOM when allocating tensor
    with shape[8,64,16,16] and type float ..."), or None when it names none."""
    match = _OOM_TENSOR.search(message)
    if match is None or match.group(2) not in _DTYPE_BYTES:
        return None
    count = 1
    for dim in filter(None, match.group(1).split(",")):
        count *= int(dim)
    return count * _DTYPE_BYTES[match.group(2)]


_NO_ALGORITHM = "No algorithm worked"
_WORKSPACE_REFUSED = re.compile(r"Out of memory while trying to allocate (\d+) bytes")
_NODE = re.compile(r"\[\[\{\{node ([^}]+)\}\}\]\]")


def out_of_memory(error: BaseException) -> str | None:
    """One line saying how the device ran out of memory when `error` means it did, else None.

    TensorFlow says so with `ResourceExhaustedError` ("OOM when allocating tensor ..."), and also
    otherwise: where no workspace fits, cuDNN's algorithm search fails for every engine, each with
    RESOURCE_EXHAUSTED, and TensorFlow raises `NotFoundError` ("No algorithm worked!"). On an H200
    held to 16 GiB (2026-11-27, benchmarks/results/gpu-h200-shipped.txt) that is how ResNet-50's
    conv4_block1_0_conv at batch 256 failed, asking for 604 MiB of workspace."""
    import tensorflow as tf

    message = getattr(error, "message", None) or str(error)
    if isinstance(error, tf.errors.ResourceExhaustedError):
        start = message.find("OOM when allocating")
        text = message[start:] if start >= 0 else message.strip()
        return text.splitlines()[0].strip() if text else "out of memory"
    if isinstance(error, (tf.errors.NotFoundError, tf.errors.InternalError)) and _NO_ALGORITHM in message:
        refused = [int(n) for n in _WORKSPACE_REFUSED.findall(message)]
        if not refused:
            return None
        node = _NODE.search(message)
        where = f" for {node.group(1)}" if node else ""
        return (f"cuDNN found no convolution algorithm{where} whose workspace fits: out of memory while trying to "
                f"allocate up to {max(refused)} bytes")
    return None


_RAN_OUT = re.compile(r"ran out of memory trying to allocate [^(]*\(rounded to (\d+)\)\s*requested by op (\S*)")
_STAT = re.compile(r"^(InUse|NumAllocs|Limit):\s+(\d+)", re.MULTILINE)


@dataclass(frozen=True)
class OutOfMemory:
    """Where a run ran out of memory, from TensorFlow's log (its allocator dumps its state at the
    failure at log level INFO: run with TF_CPP_MIN_LOG_LEVEL=0)."""

    rounded_bytes: int  # the request that failed, rounded by the allocator
    op: str
    allocations_before: int  # NumAllocs: successful allocations up to the failure
    in_use_bytes: int  # InUse at the failure
    limit_bytes: int


def parse_out_of_memory(output: str) -> OutOfMemory | None:
    """The fatal out-of-memory of a run's output: the last allocator failure followed by its stats."""
    failures = list(_RAN_OUT.finditer(output))
    if not failures:
        return None
    last = failures[-1]
    stats = {key: int(value) for key, value in _STAT.findall(output[last.end():])}
    if not {"InUse", "NumAllocs", "Limit"} <= stats.keys():
        return None
    return OutOfMemory(int(last.group(1)), last.group(2), stats["NumAllocs"], stats["InUse"], stats["Limit"])


def until_failure(recorded: RecordedTrace, failure: OutOfMemory) -> AllocationTrace:
    """The events of a failed run up to its failed request, which ends the trace: the first
    `allocations_before` allocations, and the releases after the last of them while the bytes in use
    were still above what the allocator held at the failure. Raises ValueError when the trace cannot
    reach that state (it is not this run's, or was cut short)."""
    events, allocations = [], 0
    for event, detail in zip(recorded.trace.events, recorded.details):
        if event.alloc:
            if allocations == failure.allocations_before:
                break
            allocations += 1
        elif allocations == failure.allocations_before and detail.in_use_after < failure.in_use_bytes:
            break
        events.append(event)
    in_use = recorded.details[len(events) - 1].in_use_after if events else recorded.in_use_before
    if allocations != failure.allocations_before or in_use != failure.in_use_bytes:
        raise ValueError(f"the trace does not reach the failure ({allocations} allocation(s) and {in_use} B in use "
                         f"recorded; the allocator had made {failure.allocations_before} and held "
                         f"{failure.in_use_bytes} B)")
    events.append(TraceEvent("failed request", failure.rounded_bytes, True, failure.op))
    return AllocationTrace(tuple(events))


class Recorder:
    """The profiler running with host tracer level 2 (which records the allocator's events):
    `start()` as early as possible (before the first tensor), `stop()` for the trace."""

    def __init__(self, allocator: str = CPU_BFC_ALLOCATOR):
        self.allocator = allocator
        self.logdir: str | None = None

    def start(self) -> None:
        import tensorflow as tf

        self.logdir = tempfile.mkdtemp(prefix="lms-allocations-")
        tf.profiler.experimental.start(self.logdir, options=tf.profiler.experimental.ProfilerOptions(host_tracer_level=2))

    def stop(self) -> RecordedTrace:
        import tensorflow as tf

        try:
            tf.profiler.experimental.stop()
            files = glob.glob(os.path.join(self.logdir, "**", "*.xplane.pb"), recursive=True)
            if not files:
                raise RuntimeError(f"the TensorFlow profiler wrote no trace under {self.logdir}")
            from tensorflow.tsl.profiler.protobuf import xplane_pb2

            space = xplane_pb2.XSpace()
            space.ParseFromString(Path(files[0]).read_bytes())
        finally:
            shutil.rmtree(self.logdir, ignore_errors=True)
        return trace_from_xspace(space, self.allocator)


def record_allocations(run: Callable[[], object], allocator: str = CPU_BFC_ALLOCATOR) -> RecordedTrace:
    """The allocations `allocator` makes while `run()` runs."""
    recorder = Recorder(allocator)
    recorder.start()
    try:
        run()
    finally:
        trace = recorder.stop()
    return trace


def trace_from_xspace(space, allocator: str = CPU_BFC_ALLOCATOR) -> RecordedTrace:
    """The allocation trace of `allocator` in a profiler XSpace, in the allocator's order."""
    raw = []
    for plane in space.planes:
        names = {key: meta.name for key, meta in plane.stat_metadata.items()}
        kinds = {key: meta.name for key, meta in plane.event_metadata.items() if meta.name in (ALLOCATION, DEALLOCATION)}
        if not kinds:
            continue
        for line in plane.lines:
            base_ps = line.timestamp_ns * 1000
            for sequence, event in enumerate(line.events):
                kind = kinds.get(event.metadata_id)
                if kind is None:
                    continue
                stats = {}
                for stat in event.stats:
                    key = names.get(stat.metadata_id, "")
                    which = stat.WhichOneof("value")
                    stats[key] = names.get(stat.ref_value, "") if which == "ref_value" else getattr(stat, which) \
                        if which else None
                if stats.get("allocator_name") != allocator:
                    continue
                raw.append((base_ps + event.offset_ps, line.id, sequence, kind == ALLOCATION, stats))
    raw.sort(key=lambda item: item[:3])
    raw = _allocator_order(raw)
    start_ps = raw[0][0] if raw else 0
    events, details, live = [], [], {}
    for number, (time_ps, _, _, alloc, stats) in enumerate(raw):
        address, requested = int(stats.get("addr") or 0), int(stats.get("requested_bytes") or 0)
        op = str(stats.get("tf_op") or "")
        if alloc:
            live[address] = number
            buffer = number
        else:
            buffer = live.pop(address, ("untraced", address))
        events.append(TraceEvent(buffer, requested, alloc, op))
        details.append(RecordedEvent(address, int(stats.get("allocation_bytes") or 0), int(stats.get("bytes_allocated") or 0),
                                     op, str(stats.get("region_type") or ""), str(stats.get("shape") or ""),
                                     time_ps - start_ps))
    in_use_before = 0
    if details:
        first = details[0]
        in_use_before = first.in_use_after - (first.chunk_bytes if events[0].alloc else -first.chunk_bytes)
    return RecordedTrace(allocator, AllocationTrace(tuple(events)), tuple(details), in_use_before)


def _allocator_order(raw: list) -> list:
    """Events with the same timestamp (nanosecond clock) from different threads may be listed in
    either order; each one's `bytes_allocated` says which came first. Reorders such ties to agree."""
    result, index = [], 0
    in_use = None
    while index < len(raw):
        end = index + 1
        while end < len(raw) and raw[end][0] == raw[index][0]:
            end += 1
        group = raw[index:end]
        if 1 < len(group) <= 6 and in_use is not None:
            group = _chain(group, in_use) or group
        for _, _, _, alloc, stats in group:
            in_use = int(stats.get("bytes_allocated") or 0)
        result.extend(group)
        index = end
    return result


def _chain(group: list, in_use: int) -> list | None:
    """An order of `group` in which each event's bytes in use follows from the one before."""
    if not group:
        return []
    for position, item in enumerate(group):
        stats, alloc = item[4], item[3]
        change = int(stats.get("allocation_bytes") or 0) * (1 if alloc else -1)
        if in_use + change == int(stats.get("bytes_allocated") or 0):
            rest = _chain(group[:position] + group[position + 1:], in_use + change)
            if rest is not None:
                return [item] + rest
    return None
