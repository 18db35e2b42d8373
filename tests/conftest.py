"""pytest's set-up: the allocator and the split CPU devices every test process needs, and the
`recipe_file` fixture. Shared helpers and paths are in tests/fixtures.py. Tests run with the
repository's .venv (scripts/install.sh builds it)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# As in launcher.worker: CPU allocator statistics (peak memory) exist only with the BFC allocator,
# and TensorFlow reads this once, when the first test imports it.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")


def pytest_configure(config):
    # Two logical CPU devices (tests.fixtures.COMPUTE and HOST), before TensorFlow creates its devices.
    from launcher.rank.devices import split_cpu

    split_cpu()


@pytest.fixture
def recipe_file(tmp_path):
    """Writes a recipe with the given YAML text and returns its path."""

    def write(text: str, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write
