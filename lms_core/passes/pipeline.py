"""The analyses every plan needs, in an order `run_passes` has checked: categories, levels, regions."""
from __future__ import annotations

from lms_core.graph import Graph
from lms_core.passes import run_passes
from lms_core.passes.categorize import CATEGORIZE
from lms_core.passes.levels import ASSIGN_LEVELS
from lms_core.passes.regions import MARK_CONTROL_FLOW

ANALYSES = [CATEGORIZE, ASSIGN_LEVELS, MARK_CONTROL_FLOW]
PLANNER_REQUIRES = frozenset({"category", "level", "region"})


def analyze(graph: Graph) -> Graph:
    """Writes `category`, `level` and `region` on every op, in place."""
    run_passes(graph, ANALYSES)
    return graph
