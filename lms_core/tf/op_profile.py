"""Per-op times of a training step, measured with the TensorFlow profiler (`lms.measure_ops: true`).

The profiler writes an XSpace (`*.xplane.pb`): one plane per device. On a GPU the device plane's
kernel events carry the TensorFlow op that launched them as a `name:Type` annotation, so an op's
time is the sum of its kernels; on the host, the executor's events are named `name:Type` directly.
Device times are preferred where both exist (a GPU op's host event only measures its launch).

The step is usually the LMS-rewritten one, re-imported under a name scope (`lms_step/...`): events are
matched to the graph's ops by that suffix. Ops the profiler never saw (fused away by Grappler, or
too cheap to record) are left out; `lms_core.costs.calibrated_costs` fills them in from the roofline
model, scaled by how far the measured ops are from it.
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import tensorflow as tf

PICOSECONDS = 1e-12


@dataclass
class OpTimes:
    """Mean seconds per step for each op the profiler saw, and where the figures came from."""

    seconds: dict[str, float]
    steps: int
    source: str  # "device" (GPU kernels), "host" (executor events) or "device+host"

    def describe(self) -> str:
        return (f"{len(self.seconds)} op(s) timed over {self.steps} profiled step(s) from {self.source} events, "
                f"{sum(self.seconds.values()) * 1000:.1f} ms of op time per step")


def profile_step(run_step: Callable[[], object], op_names: Iterable[str], steps: int = 3, warmup: int = 1,
                 restore: Sequence = ()) -> OpTimes:
    """Runs `run_step` `warmup` times unprofiled (kernel selection, allocator growth), then `steps`
    times under the profiler, and returns the mean time per step of every op in `op_names`.
    `run_step` must block until the step is done (e.g. read the loss back to the host). The
    variables in `restore` (weights, optimizer state) get their values back afterwards, so the
    profiled steps leave no trace in training."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    saved = [tf.identity(tf.convert_to_tensor(v)) for v in restore]
    try:
        for _ in range(warmup):
            run_step()
        space = profiled(run_step, steps)
    finally:
        for variable, value in zip(restore, saved):
            variable.assign(value)
    return op_times_from_xspace(space, op_names, steps)


def sample_inputs(specs: Sequence[tf.TensorSpec], device: str) -> list[tf.Tensor]:
    """A batch to profile with, made on `device`: uniform floats, and zeros for integer labels (class
    0 is valid for every task). Kernel times do not depend on the values of a dense step's inputs."""
    with tf.device(device):
        return [tf.random.uniform(spec.shape, dtype=spec.dtype) if spec.dtype.is_floating
                else tf.zeros(spec.shape, spec.dtype) for spec in specs]


def profiled(run_step: Callable[[], object], steps: int, host_tracer_level: int = 2):
    """The XSpace of `steps` runs of `run_step` under the TensorFlow profiler. Level 2 records the
    executor's expensive ops; level 3 every op, `Identity` and `_Recv` included."""
    logdir = tempfile.mkdtemp(prefix="lms-profile-")
    try:
        options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=host_tracer_level)
        tf.profiler.experimental.start(logdir, options=options)
        try:
            for _ in range(steps):
                run_step()
        finally:
            tf.profiler.experimental.stop()
        files = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        if not files:
            raise RuntimeError(f"the TensorFlow profiler wrote no trace under {logdir}")
        from tensorflow.tsl.profiler.protobuf import xplane_pb2

        space = xplane_pb2.XSpace()
        with open(files[0], "rb") as trace:
            space.ParseFromString(trace.read())
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    return space


def op_times_from_xspace(space, op_names: Iterable[str], steps: int) -> OpTimes:
    """Sums event durations per graph op over every plane of `space`, divided by `steps`."""
    names = set(op_names)
    device_ps: dict[str, int] = defaultdict(int)
    host_ps: dict[str, int] = defaultdict(int)
    for plane in space.planes:
        on_device = "/device:GPU:" in plane.name
        totals = device_ps if on_device else host_ps
        string_stats = {key: meta.name for key, meta in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                op = _event_op(plane, event, string_stats, names)
                if op is not None:
                    totals[op] += event.duration_ps
    seconds = {op: ps * PICOSECONDS / steps for op, ps in host_ps.items()}
    seconds.update({op: ps * PICOSECONDS / steps for op, ps in device_ps.items()})
    source = "+".join(kind for kind, found in (("device", device_ps), ("host", host_ps)) if found) or "no"
    return OpTimes(seconds=seconds, steps=steps, source=source)


def _event_op(plane, event, string_stats: dict[int, str], names: set[str]) -> str | None:
    """The graph op an event belongs to: its own name (host executor events), or a `name:Type`
    annotation among its string stats (GPU kernels), or None."""
    candidates = [plane.event_metadata[event.metadata_id].name]
    for stat in event.stats:
        if stat.str_value:
            candidates.append(stat.str_value)
        elif stat.ref_value:
            candidates.append(string_stats.get(stat.ref_value, ""))
    for text in candidates:
        op = _graph_op(text, names)
        if op is not None:
            return op
    return None


def _graph_op(text: str, names: set[str]) -> str | None:
    """`lms_step/conv/Conv2D:Conv2D#id=3#` -> `conv/Conv2D` when that is an op of the graph. An
    annotation stack (`outer::inner`) names the innermost op last."""
    text = text.split("::")[-1].split("#")[0]
    name, sep, _ = text.rpartition(":")
    if not sep:
        return None
    if name in names:
        return name
    _, _, unscoped = name.partition("/")  # without one leading scope: the re-import's `lms_step/`
    return unscoped if unscoped in names else None
