"""From an analysed step graph and a rank's hardware to a plan: the framework-neutral half of a rewrite.

    planning = plan_graph(graph, config, compute_device, data_inputs, target)
    planning.plan          # what is swapped (lms_core.plan), with the prediction when there is a target
    planning.simulation    # the simulator's replay of that plan on the target's link and device

`lms_core.tf` traces and applies; this module decides. `lms.mode` is decided here and nowhere else
(`tunes`): `auto` tunes the four TFLMS knobs for the target by simulation, and without a target
(nothing to tune for) the config's own settings are used, as in `manual`.
"""
from __future__ import annotations

from dataclasses import dataclass

from lms_core.config import LMSConfig
from lms_core.costs import DeviceProfile, calibrated_costs, step_costs
from lms_core.graph import Graph
from lms_core.link import LinkRates
from lms_core.plan import ControlEdge, Plan
from lms_core.planner import plan_swaps
from lms_core.serialize import order_edges, with_control_edges
from lms_core.simulator import SimulationResult, simulate
from lms_core.tuner import TuningResult, tune


@dataclass
class Target:
    """What one rank plans for: its host-device link, its device's cost profile, and the memory it
    may use on the device and on the host."""

    link: LinkRates
    device: DeviceProfile
    device_memory_bytes: int
    host_memory_bytes: int
    measured_op_seconds: dict[str, float] | None = None  # from the profiler (lms.measure_ops), by op name


@dataclass
class Planning:
    """A plan and what stands behind it."""

    graph: Graph  # the analysed IR the plan was made on (with the backward order, if one was imposed)
    plan: Plan
    tuning: TuningResult | None = None  # when the tuner chose the settings
    simulation: SimulationResult | None = None  # the prediction for the plan, when planned for a target
    costs: dict[str, float] | None = None  # seconds per op the simulation used, when planned for a target
    traced: Graph | None = None  # the step's IR as traced, without the order: what runs without LMS


def tunes(config: LMSConfig, target: Target | None) -> bool:
    """Whether the auto-tuner picks the settings: `lms.mode: auto` with a target to tune for."""
    return config.mode == "auto" and target is not None


def plan_graph(graph: Graph, config: LMSConfig, compute_device: str = "", data_inputs: frozenset[str] = frozenset(),
               target: Target | None = None) -> Planning:
    """Plans `graph` (analysed: categories, levels, regions) for `target`. `data_inputs` names the
    step's batch placeholders, which are swap candidates like forward activations. With
    `lms.serialize_branches` the backward branches are ordered first (lms_core.serialize) and the
    swaps are planned, and simulated, on the ordered graph, which `Planning.graph` then is."""
    traced, edges = graph, []
    if config.serialize_branches:
        edges = order_edges(graph, max(1, config.min_tensor_bytes))
        graph = with_control_edges(graph, edges)
    planning = _plan(graph, config, compute_device, data_inputs, target)
    planning.plan.control_edges, planning.traced = edges, traced
    return planning


def _plan(graph: Graph, config: LMSConfig, compute_device: str, data_inputs: frozenset[str],
          target: Target | None) -> Planning:
    if target is None:
        return Planning(graph, plan_swaps(graph, config, compute_device, data_inputs))
    costs, cost_model = op_costs(graph, target)
    if tunes(config, target):
        tuning = tune(graph, costs, target.link, int(target.device_memory_bytes * config.memory_ratio),
                      int(target.host_memory_bytes * config.host_memory_ratio), config, compute_device, data_inputs)
        plan, simulation, unlimited = tuning.plan, tuning.simulation, tuning.unlimited
        plan.tuning, plan.warnings = tuning.describe(), list(tuning.warnings)
    else:
        tuning = None
        plan = plan_swaps(graph, config, compute_device, data_inputs)
        simulation = simulate(graph, plan, costs, target.link)
        unlimited = simulate(graph, Plan(settings=plan.settings), costs, target.link)
    plan.link, plan.device_profile, plan.cost_model = target.link.describe(), target.device.describe(), cost_model
    plan.prediction = prediction(simulation, unlimited)
    return Planning(graph, plan, tuning, simulation, costs)


def op_costs(graph: Graph, target: Target) -> tuple[dict[str, float], str]:
    """Seconds per op, and where they came from: the profiler's measurements when the target has
    them (the model fills the ops it did not see), else the roofline model of the target's device."""
    if target.measured_op_seconds:
        costs, calibration = calibrated_costs(graph, target.device, target.measured_op_seconds)
        return costs, calibration.describe()
    return step_costs(graph, target.device), f"costs: roofline model of {target.device.name}"


def prediction(simulation: SimulationResult, unlimited: SimulationResult) -> dict[str, float | int]:
    """The plan's `prediction` field: the simulator's figures for the plan, and the unswapped step time."""
    return {
        "peak_device_bytes": simulation.peak_device_bytes, "peak_host_bytes": simulation.peak_host_bytes,
        "step_time_s": simulation.step_time_s, "unlimited_step_time_s": unlimited.step_time_s,
        "stall_time_s": simulation.stall_time_s, "transfer_time_s": simulation.transfer_time_s,
        "hidden_share": simulation.hidden_share,
    }

