"""The papers' memory claims, judged by TensorFlow's Grappler estimator on a virtual GPU through
`lms-launch plan` (these are estimates, not GPU measurements).

ResNet-50 at batch 256, 224x224 (Le et al. ISMM 2019: vanilla TensorFlow fits about batch 64 on
16 GB) must not fit 16 GiB without LMS and must fit with it; the 3D U-Net at the recipe's size, on a
device its step overflows, must fit once the auto-tuner has planned for that device.
"""
from __future__ import annotations

import json

import pytest

from launcher.lms import plan_command
from tests.fixtures import RECIPES

GIB = 2**30


def plan_of(recipe: str, tmp_path, *args: str) -> dict:
    assert plan_command.main([str(RECIPES / recipe), "--out", str(tmp_path), *args]) == 0
    return json.loads((tmp_path / "plan.json").read_text())


def test_resnet50_batch_256_fits_16gib_only_with_lms(tmp_path):
    # The recipe's manual settings (it ships in mode auto): TFLMS's threshold swaps every far-read activation.
    plan = plan_of("resnet50.yaml", tmp_path, "--device-memory", "16GiB", "--set", "lms.mode=manual")
    assert plan["fits"] == {"baseline": False, "lms": True}
    assert plan["swap_count"] == len(plan["swaps"]) > 50
    # Every forward activation swapped out is on the host at once when the forward pass ends: nothing
    # comes back before the backward pass (backward tensors swapped later come and go: those under
    # `gradient_tape/`, and the sums TensorFlow adds where a tensor's gradients meet, `AddN_*`).
    forward = sum(swap["nbytes"] for swap in plan["swaps"] if swap["tensor"].startswith("resnet50"))
    assert plan["estimated_host_bytes"] >= forward
    assert plan["device_memory_bytes"] == 16 * GIB


def test_unet3d_at_the_recipe_size_fits_a_device_it_overflows_once_tuned_for_it(tmp_path):
    plan = plan_of("unet3d.yaml", tmp_path, "--set", "lms.mode=auto", "--device-memory", "8GiB")
    assert plan["fits"] == {"baseline": False, "lms": True}


@pytest.mark.parametrize("args, message", [
    (["--device-memory", "lots"], "lms.device_memory: 'lots' is not a size"),
    (["--set", "lms.swapout_threshold=0"], "lms.swapout_threshold: must be >= 1"),
    (["--set", "lms.sync_mode=9"], "lms.sync_mode: must be one of 0, 1, 2, 3"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_plan_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, args, message):
    assert plan_command.main([str(RECIPES / "resnet50-cpu.yaml"), "--out", str(tmp_path / "out"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_recipe_with_nothing_to_swap_says_so(tmp_path, capsys):
    plan = plan_of("unet3d-cpu.yaml", tmp_path, "--set", "lms.mode=manual", "--set", "lms.swapout_threshold=100000")
    assert plan["swap_count"] == 0 and plan["swaps"] == []
    assert "nothing to swap" in capsys.readouterr().out
