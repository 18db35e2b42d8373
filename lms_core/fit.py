"""Does a plan fit the device? The one place that decides, for the auto-tuner and the strategy choice.

Two judges (`lms.fit_judge`; `judge_kind` resolves `auto`):
- `live`: the simulated peak of live bytes against the budget (device memory x `lms.memory_ratio`).
  The simulator counts bytes as Grappler's estimate does; whatever the allocator needs above that
  (fragmentation) must fit in the headroom the ratio leaves.
- `bfc`: the plan is simulated on the graph TensorFlow executes (lms_core.memory.executed_graph), its
  device allocations are made TensorFlow's buffers (views share, element-wise ops write in place,
  variables are held from before the step: lms_core.memory.step_memory), and the allocation trace
  (resident buffers, then `TRACE_STEPS` steps) is replayed on the model of TensorFlow's GPU allocator
  (BFC, one region of the limit: lms_core.memory.bfc.GPU_BFC) held to the budget. It fits when that
  replay runs out of memory nowhere and the simulated peak fits too. This counts fragmentation
  instead of hoping the headroom holds it. TensorFlow's buffers can also be fewer than the
  simulator's (element-wise ops write in place), so the allocator alone would accept plans whose
  simulated peak is over the budget; Grappler's estimate, which counts as the simulator does, is the
  final word on "fits" in `plan` and the bench, so those are refused. The model was checked against
  TensorFlow's real CPU allocator on real and simulated traces (benchmarks/results/bfc-model.txt);
  on a CPU the simulator's trace misses the kernels' scratch memory, hence `auto` judges CPU steps
  by `live`.

A replay is cheap (ResNet-50 at batch 256: 0.03 s, and 0.1 s to simulate the trace), so every
candidate plan is judged by it; the smallest working limit (a bisection, 0.4 s) and the planned pool
are worked out once, for the chosen plan's report (`memory`).
"""
from __future__ import annotations

from dataclasses import dataclass

from lms_core.config import LMSConfig
from lms_core.graph import Graph
from lms_core.link import LinkRates
from lms_core.memory import (GPU_BFC, AllocationTrace, BFCOptions, Requirement, executed_graph, plan_pool, replay,
                             smallest_limit, step_memory)
from lms_core.memory.bfc import MIN_ALLOCATION
from lms_core.plan import Plan
from lms_core.report import DeviceMemory
from lms_core.simulator import SimulationResult, simulate

TRACE_STEPS = 2  # the second step starts from what the first left: variables moved into adopted buffers


def judge_kind(config: LMSConfig, compute_device: str) -> str:
    """`lms.fit_judge`, with `auto` resolved: `live` for a step computed on a CPU, else `bfc`
    (a step computed on a GPU, or planned for one without a device named)."""
    if config.fit_judge != "auto":
        return config.fit_judge
    return "live" if "CPU" in compute_device.upper() else "bfc"


@dataclass
class FitJudge:
    """Judges plans of one step against one device budget and one host budget."""

    kind: str  # "bfc" or "live"
    device_budget_bytes: int
    host_budget_bytes: int
    graph: Graph | None = None  # the analysed step the plans are made on (bfc, and for `memory`)
    costs: dict[str, float] | None = None
    link: LinkRates | None = None
    allocator: BFCOptions = GPU_BFC
    _executed: Graph | None = None
    _last: tuple | None = None  # (plan, its trace): the chosen plan's trace is asked for again by `memory`

    @staticmethod
    def live(device_budget_bytes: int, host_budget_bytes: int) -> "FitJudge":
        return FitJudge("live", device_budget_bytes, host_budget_bytes)

    def fits(self, plan: Plan, simulation: SimulationResult) -> bool:
        """Host memory by the simulated peak; device memory by this judge."""
        return simulation.peak_host_bytes <= self.host_budget_bytes and self.device_fits(plan, simulation)

    def device_fits(self, plan: Plan, simulation: SimulationResult) -> bool:
        if simulation.peak_device_bytes > self.device_budget_bytes:
            return False
        return self.kind == "live" or self.allocator_runs(self.trace(plan))

    def allocator_runs(self, trace: AllocationTrace) -> bool:
        """The trace replays on the allocator model under the budget. Nothing under the rounded live
        peak can work, so that is checked first (a linear pass, no replay)."""
        if trace.live_peak(MIN_ALLOCATION) > self.device_budget_bytes:
            return False
        return replay(trace, self.device_budget_bytes, self.allocator).ok

    def device_needed(self, plan: Plan, simulation: SimulationResult) -> tuple[int, str]:
        """What the plan needs of the device by this judge, and what that figure is (for messages)."""
        if self.kind == "live":
            return simulation.peak_device_bytes, "peak"
        return self.requirement(plan).limit_bytes, "BFC requirement"

    def requirement(self, plan: Plan) -> Requirement:
        """The smallest limit (whole MiB) under which the plan's trace runs on the allocator model."""
        return smallest_limit(self.trace(plan), self.allocator, check_below=0)

    def trace(self, plan: Plan) -> AllocationTrace:
        """The device allocation trace TensorFlow's runtime makes for `plan`, by the simulator."""
        if self.graph is None or self.costs is None or self.link is None:
            raise ValueError("this judge has no step to simulate (made with FitJudge.live)")
        if self._last is not None and self._last[0] is plan:
            return self._last[1]
        if self._executed is None:
            self._executed = executed_graph(self.graph)
        result = simulate(self._executed, plan, self.costs, self.link, keep_events=True)
        trace = step_memory(self._executed, result).trace(TRACE_STEPS)
        self._last = (plan, trace)
        return trace

    def memory(self, plan: Plan) -> DeviceMemory:
        """The chosen plan's device memory below the schedule, for its report."""
        trace = self.trace(plan)
        requirement = self.requirement(plan)
        pool = plan_pool(trace.lifetimes())
        return DeviceMemory(judge=self.kind, budget_bytes=self.device_budget_bytes, steps=TRACE_STEPS,
                            live_peak_bytes=requirement.live_peak_bytes, bfc_bytes=requirement.limit_bytes,
                            allocator=self.allocator.name, fragmentation=requirement.at_limit.peak.fragmentation,
                            pool_bytes=pool.pool_bytes, lower_bound_bytes=pool.lower_bound_bytes,
                            bfc_fits=self.allocator_runs(trace))


def make_judge(config: LMSConfig, compute_device: str, graph: Graph, costs: dict[str, float], link: LinkRates,
               device_budget_bytes: int, host_budget_bytes: int) -> FitJudge:
    """The judge `lms.fit_judge` asks for. Both kinds keep the step, so the report can show the
    allocator's figures whichever judged."""
    return FitJudge(judge_kind(config, compute_device), device_budget_bytes, host_budget_bytes, graph, costs, link)
