"""A swap plan: plain data, deterministic for the same graph and settings, JSON-serializable."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SwapIn:
    """One copy of a swapped tensor back to the compute device, made when `trigger` has run.

    `name` is an op on the host that waits for the trigger; the consumers read it, so the copy to the
    device (TensorFlow's `_Send`/`_Recv` pair from host to device) cannot start before the trigger is
    done. With sync modes 2 and 3, `waiters` must also wait until the value is on the device, which
    a control edge from a host op does not ensure: they wait for `arrival`, an op on the compute
    device that reads the value."""

    name: str  # the gated swap-in op on the host device; the consumers read it
    trigger: str  # the op whose completion lets the copy back start
    trigger_level: int
    consumers: list[str]  # backward ops rerouted to read the swap-in
    consumer_levels: list[int]
    waiters: list[str] = field(default_factory=list)  # sync_mode 2/3: ops held until the value has arrived
    arrival: str | None = None  # with waiters: the op on the compute device they wait for


@dataclass
class Swap:
    tensor: str  # "op:index"
    producer_type: str
    shape: list[int]
    dtype: str
    nbytes: int
    producer_level: int
    swap_out: str  # the swap-out op added on the host device
    swap_ins: list[SwapIn]
    waiters: list[str] = field(default_factory=list)  # sync_mode 1/3: forward ops held until the swap-out is done


@dataclass(frozen=True)
class ControlEdge:
    """`after` waits for `before` (lms_core.serialize: the backward branches run one at a time)."""

    before: str
    after: str


@dataclass
class Skip:
    tensor: str
    nbytes: int | None
    reason: str


@dataclass
class Plan:
    settings: dict[str, Any]
    swaps: list[Swap] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)  # tensors that would qualify but cannot be swapped
    skipped_small: int = 0  # distant tensors under lms.min_tensor_bytes (counted, not listed)
    control_edges: list[ControlEdge] = field(default_factory=list)  # lms.serialize_branches: the order imposed
    ops: int = 0
    levels: int = 0
    # Filled by the TensorFlow layer when it estimates memory (lms_core.tf.estimate):
    estimated_peak_bytes: dict[str, int | None] = field(default_factory=dict)  # "baseline", "lms"
    estimated_host_bytes: int | None = None
    device_memory_bytes: int | None = None
    # Filled when the plan is made for a target (link, device): the simulator's prediction.
    link: str | None = None
    device_profile: str | None = None
    cost_model: str | None = None  # where the op times came from: the roofline model or profiler measurements
    prediction: dict[str, Any] = field(default_factory=dict)
    tuning: str | None = None  # the auto-tuner's summary when lms.mode is auto
    warnings: list[str] = field(default_factory=list)
    # Filled by the TensorFlow layer's gating check (lms_core.tf.gating): how many swap-ins wait for
    # their trigger in the partition graphs TensorFlow executed, which did not, and on which devices.
    verification: dict[str, Any] = field(default_factory=dict)

    @property
    def swapped_bytes(self) -> int:
        return sum(s.nbytes for s in self.swaps)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["swapped_bytes"] = self.swapped_bytes
        data["swap_count"] = len(self.swaps)
        return data

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def summary(self) -> str:
        ordered = f"; {len(self.control_edges)} control edge(s) serialize the backward branches" if self.control_edges else ""
        if not self.swaps:
            return (f"LMS plan: nothing to swap ({len(self.skipped)} candidate tensor(s) skipped; "
                    f"see 'skipped' for the reasons){ordered}")
        swap_ins = sum(len(s.swap_ins) for s in self.swaps)
        return (f"LMS plan: {len(self.swaps)} tensor(s) swapped, {self.swapped_bytes / 2**20:.1f} MiB, "
                f"{swap_ins} swap-in(s); {len(self.skipped)} skipped{ordered}")
