"""Graph passes with one contract: each names the annotations it requires and those it ensures.

Analyses only annotate the IR (`categorize` writes `Op.category`, `assign_levels` writes `Op.level`);
the planner only reads annotations. `run_passes` checks the order before running anything, so a
pass can never read an annotation nobody wrote.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lms_core.graph import Graph


@dataclass(frozen=True)
class Pass:
    name: str
    requires: frozenset[str]
    ensures: frozenset[str]
    run: Callable[[Graph], None]


def run_passes(graph: Graph, passes: list[Pass], available: frozenset[str] = frozenset()) -> None:
    have = set(available)
    for p in passes:
        missing = p.requires - have
        if missing:
            raise ValueError(f"pass {p.name} requires {', '.join(sorted(missing))}, which no earlier pass ensures")
        have |= p.ensures
    for p in passes:
        p.run(graph)
        graph.analyses |= p.ensures
