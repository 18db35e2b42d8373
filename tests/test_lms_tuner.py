"""The auto-tuner: fastest settings within the budget, for each rank's own link; deterministic."""
from __future__ import annotations

import json

import pytest

from lms_core.config import LMSConfig
from lms_core.link import NAMED_LINKS, LinkRates
from lms_core.tuner import tune
from tests.test_lms_planner import MIB
from tests.test_lms_simulator import chain_step, unit_costs

BASE = LMSConfig(enabled=True, min_tensor_bytes=MIB)
SLOW = LinkRates("slow", 2 * MIB, 2 * MIB, "test")  # 2 s per 4 MiB activation
FAST = LinkRates("fast", 400 * MIB, 400 * MIB, "test")


def test_a_step_that_fits_is_left_alone():
    g = chain_step()
    result = tune(g, unit_costs(g), FAST, device_budget_bytes=1 << 30, host_budget_bytes=1 << 30, base=BASE)
    assert result.plan.swaps == [] and result.fits and result.overhead == 0
    assert result.simulations == 1


def test_a_tight_budget_is_met_by_swapping():
    g = chain_step()
    budget = 5 * 4 * MIB + 1024  # the step needs 6 x 4 MiB unswapped (plus a few scalars)
    result = tune(g, unit_costs(g), FAST, device_budget_bytes=budget, host_budget_bytes=1 << 30, base=BASE)
    assert result.fits and result.plan.swaps
    assert result.simulation.peak_device_bytes <= budget < result.unlimited.peak_device_bytes
    assert "auto-tuned: threshold" in result.describe()


def test_an_impossible_budget_is_reported_with_what_to_change():
    g = chain_step()
    result = tune(g, unit_costs(g), FAST, device_budget_bytes=MIB, host_budget_bytes=1 << 30, base=BASE)
    assert not result.fits
    assert any("lower train.batch_size" in w for w in result.warnings)


def test_too_much_traffic_for_the_link_during_the_forward_pass_is_warned_about():
    g = chain_step()
    crawl = LinkRates("crawl", MIB, MIB, "test")  # 4 MiB in the 4 s forward pass; a and b are 8 MiB
    result = tune(g, unit_costs(g), crawl, device_budget_bytes=5 * 4 * MIB + 1024, host_budget_bytes=1 << 30, base=BASE)
    assert any("copies will stall the step; use a smaller batch or a faster link" in w for w in result.warnings)


def test_tuning_is_deterministic():
    g = chain_step()
    runs = [tune(g, unit_costs(g), SLOW, 5 * 4 * MIB + 1024, 1 << 30, BASE) for _ in range(2)]
    assert runs[0].config == runs[1].config
    assert runs[0].plan.to_json() == runs[1].plan.to_json()


def test_the_host_budget_is_respected():
    g = chain_step()
    result = tune(g, unit_costs(g), FAST, device_budget_bytes=5 * 4 * MIB + 1024, host_budget_bytes=MIB, base=BASE)
    assert not result.fits  # anything swapped needs 4 MiB of host memory
    assert result.simulation.peak_host_bytes > MIB or result.simulation.peak_device_bytes > 5 * 4 * MIB


def test_plan_command_tunes_for_the_link_and_plots(tmp_path, capsys):
    from launcher import plan_command
    from tests.conftest import RECIPES

    args = [str(RECIPES / "unet3d-cpu.yaml"), "--set", "lms.mode=auto", "--set", "lms.min_tensor_bytes=0",
            "--device-memory", "24MiB", "--link", "pcie3", "--device", "a100", "--plot"]
    assert plan_command.main(args + ["--out", str(tmp_path)]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["link"].startswith("pcie3") and plan["device_profile"].startswith("a100")
    assert plan["settings"]["mode"] == "auto" and plan["tuning"].startswith("auto-tuned")
    assert plan["device_memory_bytes"] == 24 * MIB
    assert set(plan["prediction"]) >= {"peak_device_bytes", "step_time_s", "stall_time_s", "hidden_share"}
    png = (tmp_path / "plan.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert "simulated on pcie3 / a100" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--link", "pcie9"], "lms.link: unknown link 'pcie9'"),
    (["--device", "tpu"], "lms.device: must be auto or one of v100"),
    (["--device-memory", "lots"], "lms.device_memory: 'lots' is not a size"),
    (["--set", "lms.mode=fast"], "lms.mode: must be auto or manual"),
    (["--set", "lms.memory_ratio=2"], "lms.memory_ratio: must be in (0, 1]"),
])
def test_bad_targets_exit_2_naming_the_key(tmp_path, capsys, args, message):
    from launcher import plan_command
    from tests.conftest import RECIPES

    assert plan_command.main([str(RECIPES / "unet3d-cpu.yaml"), "--out", str(tmp_path / "out"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_named_links_are_distinct_enough_to_matter():
    assert NAMED_LINKS["nvlink2"].d2h_bytes_per_s / NAMED_LINKS["pcie3"].d2h_bytes_per_s > 5
