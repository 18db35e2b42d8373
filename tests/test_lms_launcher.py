"""What a rank does with LMS before it trains (launcher.lms.step.prepare_step), in this process:
plan, verify on the partition graphs TensorFlow executes, write and log the plan, and refuse to
train when a swap-in is not gated or the host cannot hold what the plans park there."""
from __future__ import annotations

import json

import pytest

from launcher import env as ev
from launcher.lms.host_memory import (HEADROOM_BYTES, MIB, host_problems, pinned_limit_mb, pinned_limit_problem,
                                       set_pinned_limit)
from launcher.lms.rank_plan import RankPlan
from launcher.lms.step import LMSSetupError, plan_problems, prepare_step
from launcher.rank.collectives import RankContext
from launcher.rank.training import build_training
from launcher.recipe import load_recipe
from lms_core.config import LMSConfig
from lms_core.plan import Plan
from lms_core.report import MemoryEstimate, PlanReport, Prediction
from tests.fixtures import RECIPES

GIB = 1 << 30
# Every activation swapped, each brought back one level ahead: the most swap-ins to check.
SWAP_ALL = ["lms.enabled=true", "lms.mode=manual", "lms.swapout_threshold=1", "lms.swapin_ahead=1",
            "lms.min_tensor_bytes=0", "model.input_shape=[8,8,8,2]", "model.levels=2", "model.base_filters=2",
            "train.batch_size=1"]


def prepared(tmp_path, device: str, lines: list[str]):
    recipe = load_recipe(RECIPES / "unet3d-cpu.yaml", SWAP_ALL)
    setup = build_training(recipe, ranks=1, device=device)
    ctx = RankContext(rank=0, size=1, local_rank=0, local_size=1, host="here", device=device)
    return prepare_step(setup.step, setup.specs, recipe.lms, ctx, tmp_path, log=lines.append,
                        variables=list(setup.model.variables) + list(setup.optimizer.variables))


def test_a_rank_on_split_devices_verifies_writes_and_logs_its_plan(tmp_path):
    lines: list[str] = []
    rewritten = prepared(tmp_path, "CPU:1", lines)
    swap_ins = sum(len(s.swap_ins) for s in rewritten.plan.swaps)
    assert swap_ins > 5
    plan = json.loads((tmp_path / "lms" / "plan-rank0.json").read_text())
    assert plan["verification"]["gated"] == plan["verification"]["swap_ins"] == swap_ins
    assert plan["verification"]["ungated"] == []
    assert plan["host_available_bytes"] > 0 and plan["pinned_memory_problem"] is None
    edges = len(rewritten.plan.control_edges)
    assert edges > 0 and plan["verification"]["control_edges"] == {"kept": edges, "checked": edges, "broken": []}
    assert (f"LMS rank 0: swap-ins gated: {swap_ins}/{swap_ins} (checked on the partition graphs TensorFlow "
            f"executed, on /device:CPU:1 with host /device:CPU:0); backward branches ordered: {edges}/{edges} control "
            f"edges honoured") in lines
    assert any(line.startswith("LMS rank 0: swap inputs:0") for line in lines)  # the swaps are named


def test_a_rank_whose_compute_device_is_the_host_stops_before_training(tmp_path):
    """Compute and host on one device: TensorFlow makes no copy, so no swap-in can be gated, and the
    rank refuses to train rather than pretend to swap."""
    lines: list[str] = []
    with pytest.raises(LMSSetupError) as err:
        prepared(tmp_path, "CPU:0", lines)
    plan = json.loads((tmp_path / "lms" / "plan-rank0.json").read_text())  # written, for the bug report
    first = plan["verification"]["ungated"][0]
    message = str(err.value)
    assert message.startswith(f"rank 0: swap-ins gated: 0/{plan['verification']['swap_ins']} on /device:CPU:0")
    assert f"the first that is not, {first}: the value is not received from another device" in message
    assert "lms.enabled=false" in message


def test_the_pinned_memory_cap_covers_the_plan_with_headroom():
    # 10 GiB parked: x 1.25 + 1 GiB = 13.5 GiB = 13824 MiB.
    assert pinned_limit_mb(10 * GIB) == 13824
    assert pinned_limit_mb(0) == HEADROOM_BYTES // MIB
    environ: dict[str, str] = {}
    line = set_pinned_limit(environ, LMSConfig(enabled=True, host_memory_ratio=0.5), host_share_bytes=20 * GIB)
    assert environ[ev.TF_GPU_HOST_MEM_LIMIT_IN_MB] == "13824"  # 20 GiB x 0.5 = 10 GiB planned at most
    assert "the plan's host budget 10.00 GiB" in line
    mine = {ev.TF_GPU_HOST_MEM_LIMIT_IN_MB: "4096"}
    assert "(yours)" in set_pinned_limit(mine, LMSConfig(enabled=True), 20 * GIB)
    assert mine[ev.TF_GPU_HOST_MEM_LIMIT_IN_MB] == "4096"  # the user's cap is never changed


def test_a_gpu_memory_hold_is_read_in_mib_and_a_bad_one_is_named():
    from launcher.rank.devices import gpu_memory_limit_mb

    assert gpu_memory_limit_mb({}) is None and gpu_memory_limit_mb({ev.LMS_LAUNCH_GPU_MEMORY_LIMIT_MB: " "}) is None
    assert gpu_memory_limit_mb({ev.LMS_LAUNCH_GPU_MEMORY_LIMIT_MB: "16384"}) == 16384
    for bad in ("16GiB", "0", "-5"):
        with pytest.raises(ValueError, match=f"LMS_LAUNCH_GPU_MEMORY_LIMIT_MB='{bad}': give a positive whole number"):
            gpu_memory_limit_mb({ev.LMS_LAUNCH_GPU_MEMORY_LIMIT_MB: bad})


def parked(host_bytes: int, by: str = "estimate") -> PlanReport:
    """A report whose plan parks `host_bytes` on the host, by Grappler's estimate or, where there is
    none, by the simulator's prediction."""
    plan = Plan(settings={})
    if by == "estimate":
        return PlanReport(plan, estimate=MemoryEstimate(1, 1, host_bytes, 1 << 40))
    return PlanReport(plan, prediction=Prediction(1, host_bytes, 1.0, 1.0, 0.0, 0.0, 1.0))


def rank_plan(rank: int, host: str, report: PlanReport, available: int) -> RankPlan:
    return RankPlan(rank=rank, host=host, device="GPU:0", report=report, log=(), host_available_bytes=available,
                    seconds=0.0)


def test_a_plan_over_the_pinned_cap_is_refused_with_the_value_to_set():
    report = parked(10 * GIB)
    problem = pinned_limit_problem(report, 3, {ev.TF_GPU_HOST_MEM_LIMIT_IN_MB: "4096"})
    assert problem.startswith("rank 3's LMS plan parks 10.00 GiB in pinned host memory")
    assert "set TF_GPU_HOST_MEM_LIMIT_IN_MB=13824 or more" in problem
    assert pinned_limit_problem(report, 3, {ev.TF_GPU_HOST_MEM_LIMIT_IN_MB: "13824"}) is None
    assert pinned_limit_problem(report, 3, {}) is None  # no cap set: TensorFlow's default, checked by no one here


def test_a_host_whose_ranks_park_more_than_it_has_is_named():
    plans = [rank_plan(0, "a", parked(6 * GIB), 16 * GIB), rank_plan(1, "a", parked(6 * GIB), 15 * GIB),  # 12 of 15
             rank_plan(2, "b", parked(9 * GIB), 20 * GIB), rank_plan(3, "b", parked(12 * GIB), 20 * GIB)]  # 21 of 20
    problems = host_problems(plans)
    assert len(problems) == 1
    assert problems[0].startswith("host b: the LMS plans of rank(s) 2, 3 park 21.00 GiB in host memory, but b has "
                                  "20.00 GiB available")
    assert plan_problems(plans) == problems
    # Without Grappler's estimate, the simulator's prediction is what the plan parks.
    assert host_problems([rank_plan(0, "c", parked(3 * GIB, by="prediction"), 2 * GIB)])
