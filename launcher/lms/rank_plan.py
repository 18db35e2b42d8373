"""One rank's LMS plan and where it runs: what every rank sends rank 0 before training."""
from __future__ import annotations

from dataclasses import dataclass

from lms_core.report import PlanReport
from lms_core.units import format_bytes


@dataclass(frozen=True)
class RankPlan:
    rank: int
    host: str
    device: str
    report: PlanReport
    log: tuple[str, ...]  # where the rank's target came from (lms_target), said before the plan
    host_available_bytes: int  # what the host had free when the rank planned, after building its model
    seconds: float  # how long planning, estimating and checking took on this rank
    pinned_memory_problem: str | None = None  # a GPU rank's plan that its pinned-memory cap cannot hold
    calibration: tuple[dict, ...] = ()  # the rounds measured on the rank's GPU (launcher.lms.calibrate)

    def same_plan_as(self, other: "RankPlan") -> bool:
        """The same target, settings and swaps (ranks of one recipe on like hardware plan alike)."""
        mine, theirs = self.report, other.report
        return (mine.planned_for == theirs.planned_for and mine.plan.settings == theirs.plan.settings
                and mine.plan.swaps == theirs.plan.swaps
                and (mine.estimate and mine.estimate.device_memory_bytes)
                == (theirs.estimate and theirs.estimate.device_memory_bytes))

    def describe(self) -> str:
        """The rank's one-line summary: what is swapped, with which settings, the peaks and the time."""
        report, plan = self.report, self.report.plan
        settings = plan.settings
        text = (f"LMS rank {self.rank}: {len(plan.swaps)} tensor(s) swapped, {format_bytes(plan.swapped_bytes)}/step "
                f"to host; {settings['mode']}: threshold {settings['swapout_threshold']}, ahead "
                f"{settings['swapin_ahead']}, groupby {settings['swapin_groupby']}, sync {settings['sync_mode']}")
        if report.estimate is not None:
            estimate = report.estimate
            text += (f"; {estimate.source} peak {format_bytes(estimate.baseline_bytes)} -> {format_bytes(estimate.lms_bytes)} "
                     f"of {format_bytes(estimate.device_memory_bytes)} (host {format_bytes(estimate.host_bytes)})")
        if report.prediction is not None:  # the simulator's peak counts copies out as the executor sees them end
            text += (f"; predicted peak {format_bytes(report.prediction.peak_device_bytes)}, step "
                     f"{report.prediction.step_time_s * 1000:.0f} ms vs "
                     f"{report.prediction.unlimited_step_time_s * 1000:.0f} ms unswapped")
        return text + f"; rewrite {self.seconds:.1f} s"

    def to_dict(self) -> dict:
        """RUN_DIR/lms/plan-rank<N>.json."""
        return dict(self.report.to_dict(), rank=self.rank, host=self.host, device=self.device, log=list(self.log),
                    host_available_bytes=self.host_available_bytes, seconds=round(self.seconds, 2),
                    pinned_memory_problem=self.pinned_memory_problem, calibration=list(self.calibration))
