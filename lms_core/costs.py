"""How long each op takes on a device: FLOPs and bytes against the device's peaks (a roofline).

Device profiles are datasheet peaks for float32 without tensor cores (the recipes train in float32):

| profile | FP32 TFLOP/s | memory GB/s | memory | source |
| --- | --- | --- | --- | --- |
| v100 | 15.7 | 900 | 16 GiB | V100 SXM2 16 GB (the LMS papers' GPU) |
| a100 | 19.5 | 1555 | 40 GiB | A100 SXM4 40 GB |
| h100 | 67 | 3350 | 80 GB | H100 SXM5 |
| h200 | 67 | 4800 | 141 GB | H200 SXM |

An op takes max(FLOPs / (peak x efficiency), bytes read and written / bandwidth) plus a launch
overhead: compute-bound convolutions and matrix products by their FLOPs, everything elementwise by
its memory traffic. `lms.device` may also be a custom profile (peak TFLOP/s, memory bandwidth, memory
size). Where a GPU is at hand, `calibrated_costs` replaces the model's times by per-op times measured
with the TensorFlow profiler (lms_core/tf/op_profile.py).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from lms_core.graph import Graph, Op, split_tensor

GIB = 1 << 30


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    flops_per_s: float
    memory_bytes_per_s: float
    memory_bytes: int
    compute_efficiency: float = 0.6  # share of peak FLOP/s dense kernels reach in practice
    launch_overhead_s: float = 5e-6

    def describe(self) -> str:
        return (f"{self.name}: {self.flops_per_s / 1e12:.1f} TFLOP/s, {self.memory_bytes_per_s / 1e9:.0f} GB/s, "
                f"{self.memory_bytes / GIB:.0f} GiB")


PROFILES = {
    "v100": DeviceProfile("v100", 15.7e12, 900e9, 16 * GIB),
    "a100": DeviceProfile("a100", 19.5e12, 1555e9, 40 * GIB),
    "h100": DeviceProfile("h100", 67e12, 3350e9, 80 * 10**9),
    "h200": DeviceProfile("h200", 67e12, 4800e9, 141 * 10**9),
}

_CONV_FORWARD = {"Conv2D", "Conv3D", "DepthwiseConv2dNative"}
_CONV_BACKWARD = {"Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3DBackpropInputV2",
                  "Conv3DBackpropFilterV2", "DepthwiseConv2dNativeBackpropInput",
                  "DepthwiseConv2dNativeBackpropFilter"}
_MATMUL = {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"}
_FREE = {"Const", "Placeholder", "Identity", "NoOp", "Shape", "ShapeN", "Reshape", "Squeeze", "ExpandDims",
         "ReadVariableOp", "VarHandleOp", "StopGradient", "Size", "Rank"}


def _elements(shape) -> int | None:
    if shape is None or any(d is None for d in shape):
        return None
    return math.prod(shape)


def op_flops(graph: Graph, op: Op) -> float:
    """Floating-point operations of one op, from its shapes (0 when they are unknown)."""
    out = op.outputs[0] if op.outputs else None
    out_elements = _elements(out.shape) if out else None
    if op.type in _CONV_FORWARD or op.type in _CONV_BACKWARD:
        # 2 x (output or input elements) x (filter volume x input channels): the same count for the
        # forward convolution and each of its two backward ones.
        filter_shape = _filter_shape(graph, op)
        big = _largest_activation(graph, op)
        if filter_shape is None or big is None:
            return 0.0
        window = math.prod(filter_shape[:-1])  # kh x kw (x kd) x in_channels
        out_channels = filter_shape[-1]
        return 2.0 * big / max(1, _channels(graph, op, big)) * window * out_channels
    if op.type in _MATMUL and len(op.inputs) >= 2:
        a = graph.tensor(op.inputs[0]).shape
        if out_elements is None or a is None or a[-1] is None:
            return 0.0
        return 2.0 * out_elements * a[-1]  # transposes are not in the IR; untransposed is the common case
    if op.type in _FREE:
        return 0.0
    return float(out_elements or 0)


def _filter_shape(graph: Graph, op: Op):
    for name in op.inputs:
        shape = graph.tensor(name).shape
        producer = graph[split_tensor(name)[0]]
        if shape is not None and len(shape) in (4, 5) and producer.type in ("ReadVariableOp", "Identity", "Cast"):
            return shape
    if op.type.endswith("BackpropFilter") or op.type.endswith("BackpropFilterV2"):
        out = op.outputs[0].shape
        return out if out is not None and None not in out else None
    return None


def _largest_activation(graph: Graph, op: Op) -> int | None:
    sizes = [_elements(graph.tensor(name).shape) for name in op.inputs]
    sizes += [_elements(o.shape) for o in op.outputs]
    sizes = [s for s in sizes if s]
    return max(sizes) if sizes else None


def _channels(graph: Graph, op: Op, elements: int) -> int:
    for info in [graph.tensor(n) for n in op.inputs] + op.outputs:
        if info.shape is not None and _elements(info.shape) == elements:
            return info.shape[-1] or 1
    return 1


def op_bytes(graph: Graph, op: Op) -> int:
    total = sum(graph.tensor(name).nbytes or 0 for name in op.inputs)
    return total + sum(o.nbytes or 0 for o in op.outputs)


def op_seconds(graph: Graph, op: Op, device: DeviceProfile) -> float:
    if op.type in _FREE:
        return 0.0
    compute = op_flops(graph, op) / (device.flops_per_s * device.compute_efficiency)
    memory = op_bytes(graph, op) / device.memory_bytes_per_s
    return max(compute, memory) + device.launch_overhead_s


def step_costs(graph: Graph, device: DeviceProfile) -> dict[str, float]:
    """Seconds per op for the whole graph."""
    return {name: op_seconds(graph, graph[name], device) for name in graph.order}


@dataclass
class Calibration:
    """How measured op times were merged into the model: the ops that had a measurement, and the
    factor by which the model's times were scaled for the rest (median of measured / modelled)."""

    measured_ops: int
    modelled_ops: int
    scale: float

    def describe(self) -> str:
        return (f"costs: {self.measured_ops} op(s) measured, {self.modelled_ops} from the roofline model "
                f"scaled x{self.scale:.2f} (the median measured/modelled ratio)")


def calibrated_costs(graph: Graph, device: DeviceProfile, measured: dict[str, float]) -> tuple[dict[str, float], Calibration]:
    """Seconds per op: the measured time where the profiler saw the op, else the roofline time scaled
    by the median ratio of measured to modelled over the ops that have both. Scaling keeps the ops
    the profiler missed (fused by Grappler, or too small to record) in proportion to the real ones."""
    modelled = step_costs(graph, device)
    ratios = [measured[name] / modelled[name] for name in graph.order
              if name in measured and modelled[name] > 0 and measured[name] > 0]
    scale = statistics.median(ratios) if ratios else 1.0
    costs = {name: measured[name] if name in measured else modelled[name] * scale for name in graph.order}
    taken = sum(1 for name in graph.order if name in measured)
    return costs, Calibration(measured_ops=taken, modelled_ops=len(graph.order) - taken, scale=scale)
