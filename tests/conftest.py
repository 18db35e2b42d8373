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


def pytest_collection_modifyitems(config, items):
    # Tests that start ranks (horovodrun, mpirun, hosts made of network namespaces) share ports,
    # namespaces and the machine's cores: under pytest-xdist they all go to one worker, one at a
    # time, while the other worker runs the in-process tests. (A second group for the namespace
    # hosts measured 8:31 against 8:45 for the whole suite on 2 cores: not worth the overlap.)
    for item in items:
        if item.get_closest_marker("e2e") is not None:
            item.add_marker(pytest.mark.xdist_group("ranks"))
