"""What stands behind a plan, as one immutable result: the plan, what it was made for, the
simulator's prediction, Grappler's estimate and the check on what TensorFlow executed.

Each stage adds its part and gets a new report back, nothing is filled in place:

    report = planning.report                       # plan, target, prediction (lms_core.planning)
    report = report.with_estimate(estimate)        # Grappler's peaks (lms_core.tf.estimate_rewrite)
    report = report.with_verification(check)       # swap-ins gated (lms_core.tf.gating)
    print(report.verification.describe())          # "swap-ins gated: 74/74 (...)"
    json.dumps(report.to_dict())                   # plan.json, plan-rank<N>.json

The printers live here, so every command says the same thing the same way.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lms_core.costs import DeviceProfile
from lms_core.link import LinkRates
from lms_core.loops import UnseenBytes
from lms_core.plan import Plan
from lms_core.units import format_bytes


@dataclass(frozen=True)
class PlannedFor:
    """The target a plan was made for, and where the op times came from."""

    link: LinkRates
    device: DeviceProfile
    cost_model: str  # "costs: roofline model of v100", or the profiler's calibration

    def describe(self) -> str:
        return f"{self.link.name} / {self.device.name}"


@dataclass(frozen=True)
class Prediction:
    """The simulator's figures for a plan on its target (lms_core.simulator), beside the step
    unswapped, as if memory were unlimited."""

    peak_device_bytes: int
    peak_host_bytes: int
    step_time_s: float
    unlimited_step_time_s: float
    stall_time_s: float
    transfer_time_s: float
    hidden_share: float  # of the transfer time, the share overlapped with compute
    bound_s: float = 0.0  # no plan for this budget and link can make the step faster (lms_core.access_order)
    traffic_bytes: int = 0  # moved over the link per step: every swap out, and every copy back

    @property
    def overhead(self) -> float | None:
        """Predicted step time over the unswapped one, minus one."""
        if not self.step_time_s or not self.unlimited_step_time_s:
            return None
        return self.step_time_s / self.unlimited_step_time_s - 1

    def describe(self, planned_for: PlannedFor) -> str:
        overhead = f" ({self.overhead:+.0%})" if self.overhead is not None else ""
        bound = (f", bound {self.bound_s * 1000:.0f} ms ({self.step_time_s / self.bound_s:.2f}x it)"
                 if self.bound_s else "")
        return (f"simulated on {planned_for.describe()}: step {self.step_time_s * 1000:.0f} ms{overhead} vs "
                f"{self.unlimited_step_time_s * 1000:.0f} ms unswapped{bound}, traffic "
                f"{format_bytes(self.traffic_bytes)}/step, stalls {self.stall_time_s * 1000:.0f} ms, "
                f"{self.hidden_share:.0%} of transfer hidden, peak {format_bytes(self.peak_device_bytes)}")


@dataclass(frozen=True)
class DeviceMemory:
    """The plan's device memory below the schedule (lms_core.memory, lms_core.fit): the simulated
    allocation trace as TensorFlow's runtime holds its buffers (resident buffers, then `steps` steps),
    what TensorFlow's GPU allocator (BFC) needs for it, and what a pool planned from the buffers'
    lifetimes would need. Which of the two figures the plan was judged by is `judge`."""

    judge: str  # "bfc": the BFC requirement had to fit the budget; "live": the simulated peak did
    budget_bytes: int  # device memory x lms.memory_ratio
    steps: int
    live_peak_bytes: int  # the most bytes TensorFlow's buffers hold at once
    bfc_bytes: int  # the smallest limit (whole MiB) under which the allocator model runs the trace
    allocator: str  # which allocator configuration was modelled
    fragmentation: float  # TensorFlow's GetFragmentation at the peak, at that limit
    pool_bytes: int  # a pool with every buffer's offset planned (lms_core.memory.pool)
    lower_bound_bytes: int  # the most 256-byte-aligned bytes live at once: no placement is smaller
    bfc_fits: bool  # the trace replays under the budget on the allocator model

    def describe(self) -> str:
        judged = (f"fits judged by the BFC requirement: {'fits' if self.bfc_fits else 'does NOT fit'} "
                  f"{format_bytes(self.budget_bytes)}" if self.judge == "bfc" else
                  "fits judged by the simulated peak (lms.fit_judge live)")
        return (f"device memory as TensorFlow holds it ({self.steps} steps): live peak "
                f"{format_bytes(self.live_peak_bytes)}, BFC requirement {format_bytes(self.bfc_bytes)} "
                f"(+{self.bfc_bytes / max(1, self.live_peak_bytes) - 1:.1%}), planned pool "
                f"{format_bytes(self.pool_bytes)}, lower bound {format_bytes(self.lower_bound_bytes)}; {judged}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class MemoryEstimate:
    """Grappler's peak-memory estimate of the step without and with the plan on a virtual GPU of
    `device_memory_bytes` (lms_core.tf.estimate): an estimate of a schedule, not a measurement."""

    baseline_bytes: int
    lms_bytes: int
    host_bytes: int  # what the swap-outs park in host memory at the peak
    device_memory_bytes: int
    # Loop accumulators Grappler sizes as nothing (lms_core.loops): when the step has any, the three
    # figures above include them, and this says how much of each they are.
    loop_accumulators: UnseenBytes | None = None

    @property
    def baseline_fits(self) -> bool:
        return self.baseline_bytes <= self.device_memory_bytes

    @property
    def lms_fits(self) -> bool:
        return self.lms_bytes <= self.device_memory_bytes

    @property
    def source(self) -> str:
        """What the peaks are: Grappler's, or Grappler's plus the loop accumulators it cannot size."""
        return "Grappler" if self.loop_accumulators is None else "Grappler + loop accumulators"

    def lines(self) -> list[str]:
        lines = []
        for label, peak, fits in (("without LMS", self.baseline_bytes, self.baseline_fits),
                                  ("with LMS", self.lms_bytes, self.lms_fits)):
            lines.append(f"{label:<12} {self.source} GPU peak {format_bytes(peak):>10}: "
                         f"{'fits' if fits else 'does NOT fit'} in {format_bytes(self.device_memory_bytes)}")
        if self.loop_accumulators is not None:
            lines.append(self.loop_accumulators.describe())
        if self.baseline_bytes:
            lines.append(f"GPU peak with LMS is {self.lms_bytes / self.baseline_bytes:.0%} of the baseline; "
                         f"host memory used {format_bytes(self.host_bytes)}")
        return lines


@dataclass(frozen=True)
class Verification:
    """Whether every swap-in waits for its trigger in the partition graphs TensorFlow executed for
    one step, and whether the plan's control edges were honoured there (lms_core.tf.gating)."""

    gated: int
    swap_ins: int
    ungated: tuple[str, ...]  # the swap-ins that are not gated, in plan order
    reasons: dict[str, str]  # why each of them is not
    edges_kept: int
    edges_checked: int
    edges_broken: tuple[str, ...]
    compute_device: str
    host_device: str
    lists_unset: int = 0  # the plan's unset zero lists that ran as TensorListReserve
    lists_checked: int = 0  # those the executed graph has under their own names
    lists_changed: tuple[str, ...] = ()
    zeros_deferred: int = 0  # the plan's deferred gradient-loop zeros that wait for their trigger
    zeros_checked: int = 0
    zeros_early: tuple[str, ...] = ()
    clones_gated: int = 0  # the recomputes' clones that were executed after their trigger
    clones: int = 0
    clones_early: tuple[str, ...] = ()  # those that were not, and why
    traced_at: tuple[list[int], int] | None = None  # (input shape, batch) of the twin it ran on, if not the step

    @property
    def all_gated(self) -> bool:
        """Every swap-in waits for its trigger, and so does every recompute's clone."""
        return not self.ungated and not self.clones_early

    def describe(self) -> str:
        """The "swap-ins gated: N/M" line every command prints."""
        where = ("the partition graphs TensorFlow executed" if self.traced_at is None else
                 f"the partition graphs TensorFlow executed for this step at {self.traced_at[0]}, "
                 f"batch {self.traced_at[1]}")
        text = (f"swap-ins gated: {self.gated}/{self.swap_ins} (checked on {where}, on {self.compute_device} "
                f"with host {self.host_device})")
        if self.edges_checked:
            text += f"; backward branches ordered: {self.edges_kept}/{self.edges_checked} control edges honoured"
        if self.zeros_checked:
            text += f"; gradient loop zeros made just before their loop: {self.zeros_deferred}/{self.zeros_checked}"
        if self.lists_checked:
            text += f"; zero lists left unset until filled: {self.lists_unset}/{self.lists_checked}"
        if self.clones:
            text += f"; recomputed ops after their trigger: {self.clones_gated}/{self.clones}"
        return text

    def first_failure(self) -> str:
        """The first swap-in that is not gated, and why, else the first recompute clone that is not
        (for error messages)."""
        if not self.ungated:
            return self.clones_early[0]
        first = self.ungated[0]
        return f"{first}: {self.reasons[first]}"

    def to_dict(self) -> dict[str, Any]:
        data = {"gated": self.gated, "swap_ins": self.swap_ins, "ungated": list(self.ungated),
                "reasons": dict(self.reasons),
                "control_edges": {"kept": self.edges_kept, "checked": self.edges_checked,
                                  "broken": list(self.edges_broken)},
                "unset_zero_lists": {"unset": self.lists_unset, "checked": self.lists_checked,
                                     "changed": list(self.lists_changed)},
                "deferred_zeros": {"deferred": self.zeros_deferred, "checked": self.zeros_checked,
                                   "early": list(self.zeros_early)},
                "recompute_clones": {"gated": self.clones_gated, "clones": self.clones,
                                     "early": list(self.clones_early)},
                "devices": {"compute": self.compute_device, "host": self.host_device},
                "checked_on": "the partition graphs of one executed step"}
        if self.traced_at is not None:
            data["traced_at"] = {"input_shape": list(self.traced_at[0]), "batch_size": self.traced_at[1]}
        return data


@dataclass(frozen=True)
class PlanReport:
    """A plan and everything found out about it."""

    plan: Plan
    planned_for: PlannedFor | None = None  # None: planned with the config's own settings, no target
    prediction: Prediction | None = None
    tuning: str | None = None  # how the plan was chosen (the tuner, the access-order planner), when it was
    warnings: tuple[str, ...] = ()
    memory: DeviceMemory | None = None  # the allocator's and a planned pool's needs, when planned for a target
    estimate: MemoryEstimate | None = None
    verification: Verification | None = None

    def with_estimate(self, estimate: MemoryEstimate) -> "PlanReport":
        return dataclasses.replace(self, estimate=estimate)

    def with_verification(self, verification: Verification) -> "PlanReport":
        return dataclasses.replace(self, verification=verification)

    def with_plan(self, plan: Plan) -> "PlanReport":
        return dataclasses.replace(self, plan=plan)

    def lines(self) -> list[str]:
        """What a command prints under the plan's heading: where times came from, the tuning and its
        warnings, the prediction, the estimate and the gating check (each when there is one)."""
        lines = []
        if self.planned_for is not None:
            lines.append(self.planned_for.cost_model)
        if self.tuning:
            lines.append(self.tuning)
        lines += [f"warning: {warning}" for warning in self.warnings]
        if self.prediction is not None and self.planned_for is not None:
            lines.append(self.prediction.describe(self.planned_for))
        if self.memory is not None:
            lines.append(self.memory.describe())
        if self.estimate is not None:
            lines += self.estimate.lines()
        if self.verification is not None:
            lines.append(self.verification.describe())
        return lines

    def to_dict(self) -> dict[str, Any]:
        """plan.json and plan-rank<N>.json: the plan's fields, then what stands behind it."""
        data = self.plan.to_dict()
        estimate = self.estimate
        data.update({
            "estimated_peak_bytes": ({"baseline": estimate.baseline_bytes, "lms": estimate.lms_bytes}
                                     if estimate else {}),
            "estimated_host_bytes": estimate.host_bytes if estimate else None,
            **({"estimated_loop_accumulator_bytes": dataclasses.asdict(estimate.loop_accumulators)}
               if estimate and estimate.loop_accumulators else {}),
            "device_memory_bytes": estimate.device_memory_bytes if estimate else None,
            "fits": {"baseline": estimate.baseline_fits, "lms": estimate.lms_fits} if estimate else {},
            "link": self.planned_for.link.describe() if self.planned_for else None,
            "device_profile": self.planned_for.device.describe() if self.planned_for else None,
            "cost_model": self.planned_for.cost_model if self.planned_for else None,
            "prediction": dataclasses.asdict(self.prediction) if self.prediction else {},
            "device_memory": self.memory.to_dict() if self.memory else {},
            "tuning": self.tuning, "warnings": list(self.warnings),
            "verification": self.verification.to_dict() if self.verification else {},
        })
        return data

