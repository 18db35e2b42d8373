"""The largest size that fits: galloping, then bisection, over the sizes a model accepts.

Sizes lie on a grid, `step` apart (every batch; the U-Net's sides in steps of 2^(levels-1)). A search
starts at a size (the recipe's), and:

1. gallops: while the size fits it doubles it, and while it does not it halves it, until one size
   fits and another does not (or the grid's bound is reached);
2. bisects between the largest size seen to fit and the smallest seen not to, down to one step.

It ends with a certificate, not a guess: `largest` fitted, and `largest + step` did not (or
`largest` is the grid's maximum, and the search says it was bounded there). Each probe is made once.

Probes, with the answer `a` and the start `s` as grid indices (size / step) and the answer above the
start: the start, u = floor(log2(a/s)) + 1 doublings (the last one fails), then bisection of a
bracket 2^(u-1) s wide, ceil(log2(2^(u-1) s)) = u - 1 + ceil(log2 s) probes; in all
2u + ceil(log2 s) <= 2 log2(a) + 3. Below the start it is the mirror image. A linear scan would take
a - s + 2. For ResNet-50 from batch 256 to an answer near 1,000 that is 12 probes, not 750.

The search assumes that a size that fits has every smaller size fitting too. Where a judge breaks
that (an auto-tuner choosing differently at two sizes), the certificate still holds for the two
sizes it names.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Probe:
    """One size judged for one configuration."""

    size: int
    fits: bool
    peak_bytes: int | None  # the judge's peak device memory at this size (None when it has none, e.g. a crash)
    seconds: float  # how long the judgement took
    detail: str = ""  # one line for the progress log: swaps made, the out-of-memory message, ...
    data: dict = field(default_factory=dict)  # what the configuration wants to keep: predictions, plans, ...


@dataclass(frozen=True)
class SizeGrid:
    """The sizes a search may try: multiples of `step` from `minimum` up to `maximum`."""

    step: int
    minimum: int
    maximum: int | None = None  # None: unbounded

    def __post_init__(self) -> None:
        if self.step < 1:
            raise ValueError(f"the step must be >= 1, got {self.step}")
        if self.minimum < self.step or self.minimum % self.step:
            raise ValueError(f"the minimum {self.minimum} must be a positive multiple of the step {self.step}")
        if self.maximum is not None and (self.maximum < self.minimum or self.maximum % self.step):
            raise ValueError(f"the maximum {self.maximum} must be a multiple of the step {self.step}, "
                             f"at least the minimum {self.minimum}")

    def snap(self, size: int) -> int:
        """The grid size at or below `size`, kept within the grid's bounds."""
        size = max(self.minimum, size - size % self.step)
        return size if self.maximum is None else min(size, self.maximum)


@dataclass
class SearchResult:
    largest: int | None  # the largest size that fitted; None when not even the minimum fits
    smallest_failing: int | None  # the smallest size that did not fit (None when none failed)
    bounded: bool  # the search stopped at the grid's maximum, which fitted: larger sizes were not tried
    probes: list[Probe]  # in the order they were made
    seconds: float = 0.0  # the whole search

    def probe_at(self, size: int | None) -> Probe | None:
        return next((p for p in self.probes if p.size == size), None)


def largest_fitting(judge: Callable[[int], Probe], grid: SizeGrid, start: int, stride: int | None = None,
                    on_probe: Callable[[Probe], None] | None = None) -> SearchResult:
    """Searches `grid` from `start` (snapped onto it) for the largest size `judge` says fits.

    By default the gallop doubles and halves the size. With `stride` (a size, rounded up to whole
    steps) it moves by that stride and doubles the stride instead (start, start + d, start + 3d, ...):
    for a start that is a good guess, where the answer is a step or two away."""
    started = time.perf_counter()
    step = grid.step
    low_index = grid.minimum // step
    high_index = None if grid.maximum is None else grid.maximum // step
    probes: dict[int, Probe] = {}

    def fits(index: int) -> bool:
        if index not in probes:
            probe = judge(index * step)
            probes[index] = probe
            if on_probe is not None:
                on_probe(probe)
        return probes[index].fits

    first = grid.snap(start) // step
    gap = None if stride is None else max(1, -(-stride // step))
    fitting, failing = (first, None) if fits(first) else (None, first)
    while fitting is not None and failing is None:  # gallop up while it fits
        if fitting == high_index:
            break
        nxt = 2 * fitting if gap is None else fitting + gap
        nxt = nxt if high_index is None else min(nxt, high_index)
        if fits(nxt):
            fitting = nxt
        else:
            failing = nxt
        gap = None if gap is None else 2 * gap
    while fitting is None:  # gallop down while it does not fit
        if failing == low_index:
            break
        nxt = max(low_index, failing // 2 if gap is None else failing - gap)
        if fits(nxt):
            fitting = nxt
        else:
            failing = nxt
        gap = None if gap is None else 2 * gap
    while fitting is not None and failing is not None and failing - fitting > 1:
        middle = (fitting + failing) // 2
        if fits(middle):
            fitting = middle
        else:
            failing = middle
    return SearchResult(
        largest=None if fitting is None else fitting * step,
        smallest_failing=None if failing is None else failing * step,
        bounded=fitting is not None and failing is None,
        probes=list(probes.values()), seconds=time.perf_counter() - started)
