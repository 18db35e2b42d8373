"""Shared fixtures. Tests run with the repository's .venv (scripts/install.sh builds it)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# As in launcher.rank.worker: CPU allocator statistics (peak memory) exist only with the BFC allocator,
# and TensorFlow reads this once, when the first test imports it.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

REPO = Path(__file__).resolve().parent.parent
# Two logical CPU devices, as a CPU rank with LMS on has them: the LMS tests run the rewritten step
# with compute on /device:CPU:1 and host /device:CPU:0, so TensorFlow partitions it across devices
# with _Send/_Recv pairs as it would for a GPU. It must be set before TensorFlow creates its devices.
COMPUTE, HOST = "/device:CPU:1", "/device:CPU:0"


def pytest_configure(config):
    from launcher.rank.devices import split_cpu

    split_cpu()
RECIPES = REPO / "recipes"


@pytest.fixture
def recipe_file(tmp_path):
    """Writes a recipe with the given YAML text and returns its path."""

    def write(text: str, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


def lms_launch_argv(*args: str) -> list[str]:
    """`lms-launch ...` as a subprocess, through the same interpreter the tests run in."""
    return [sys.executable, "-m", "launcher.cli", *args]
