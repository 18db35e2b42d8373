"""A planned memory pool: every buffer of a known trace gets an offset before the step runs.

Training makes the same allocations in the same order every step, so each buffer's lifetime is known
in advance and a pool can place buffers so that two whose lifetimes overlap never overlap in memory
(Zhang et al., arXiv 1903.06631). The pool's size is the highest offset + size used; no placement
can be smaller than the most bytes live at once (`lower_bound`), and the gap to it is what the
heuristic loses.

The heuristic is offline best fit (the "greedy by size" of TFLite's arena planner and of Pisarchyk and
Lee, arXiv 2001.03288): buffers in order of size, largest first, each at the lowest offset of the
smallest gap between the buffers already placed whose lifetimes overlap its own, or above them all when
no gap holds it. It is also run in allocation order (what an allocator that knew every release could
do online), and the smaller pool is kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from lms_core.memory.lifetimes import Lifetime, peak_live

DEFAULT_ALIGNMENT = 256  # the allocator's granule (BFC's kMinAllocationSize; cudaMalloc aligns to 256 bytes)


@dataclass(frozen=True)
class PoolPlan:
    """Offsets for a set of lifetimes, in one pool."""

    offsets: dict[Hashable, int]  # buffer -> offset in the pool
    sizes: dict[Hashable, int]  # buffer -> bytes it occupies (rounded up to the alignment)
    pool_bytes: int  # highest offset + size
    lower_bound_bytes: int  # the most (aligned) bytes live at once: no placement is smaller
    alignment: int
    order: str  # "size" or "allocation": which ordering gave this plan

    @property
    def gap(self) -> float:
        """How far above the lower bound the pool is (0.02 = 2%)."""
        return self.pool_bytes / self.lower_bound_bytes - 1 if self.lower_bound_bytes else 0.0

    def describe(self) -> str:
        return (f"planned pool {self.pool_bytes / 2**20:.2f} MiB, lower bound {self.lower_bound_bytes / 2**20:.2f} MiB "
                f"(+{self.gap:.2%}; {len(self.offsets)} buffers, best fit by {self.order})")


def plan_pool(lifetimes: Sequence[Lifetime], alignment: int = DEFAULT_ALIGNMENT,
              orders: Sequence[str] = ("size", "allocation")) -> PoolPlan:
    """The smallest of the best-fit placements in each of `orders` ("size": largest first;
    "allocation": in allocation order)."""
    items = [lt for lt in lifetimes if lt.nbytes > 0 and lt.end > lt.start]
    bound = peak_live(items, alignment)
    best = None
    for order in orders:
        plan = _best_fit(items, alignment, order, bound)
        if best is None or plan.pool_bytes < best.pool_bytes:
            best = plan
    return best


def _best_fit(items: Sequence[Lifetime], alignment: int, order: str, bound: int) -> PoolPlan:
    if order == "size":
        ranked = sorted(range(len(items)), key=lambda i: (-items[i].nbytes, items[i].start, i))
    elif order == "allocation":
        ranked = sorted(range(len(items)), key=lambda i: (items[i].start, i))
    else:
        raise ValueError(f"unknown order {order!r}: use 'size' or 'allocation'")
    count = len(items)
    starts = np.empty(count, np.int64)
    ends = np.empty(count, np.int64)
    offsets = np.empty(count, np.int64)
    sizes = np.empty(count, np.int64)
    placed = 0
    result_offsets: dict[Hashable, int] = {}
    result_sizes: dict[Hashable, int] = {}
    top = 0
    for index in ranked:
        item = items[index]
        size = -(-item.nbytes // alignment) * alignment
        live = (starts[:placed] < item.end) & (ends[:placed] > item.start)
        offset = _gap(offsets[:placed][live], sizes[:placed][live], size)
        starts[placed], ends[placed], offsets[placed], sizes[placed] = item.start, item.end, offset, size
        placed += 1
        result_offsets[item.buffer], result_sizes[item.buffer] = offset, size
        top = max(top, offset + size)
    return PoolPlan(result_offsets, result_sizes, top, bound, alignment, order)


def _gap(offsets: np.ndarray, sizes: np.ndarray, size: int) -> int:
    """The lowest offset of the smallest free gap of at least `size` between these occupied ranges,
    or the end of the highest one."""
    if offsets.size == 0:
        return 0
    order = np.argsort(offsets, kind="stable")
    lows, highs = offsets[order], offsets[order] + sizes[order]
    reach = np.maximum.accumulate(highs)  # end of everything at or below each range
    gap_starts = np.concatenate(([0], reach[:-1]))
    gaps = lows - gap_starts
    fits = np.nonzero(gaps >= size)[0]
    if fits.size == 0:
        return int(reach[-1])
    best = fits[np.argmin(gaps[fits])]  # smallest gap; argmin takes the first (lowest) on ties
    return int(gap_starts[best])


def overlapping_pairs(lifetimes: Sequence[Lifetime], plan: PoolPlan, limit: int = 10) -> list[tuple[Hashable, Hashable]]:
    """Pairs of buffers live at the same time whose ranges in the pool overlap (none, for a valid
    plan): a sweep over the lifetimes, independent of how the plan was made."""
    events = []
    for lifetime in lifetimes:
        if lifetime.buffer in plan.offsets:
            events.append((lifetime.start, 1, lifetime.buffer))
            events.append((lifetime.end, 0, lifetime.buffer))
    events.sort(key=lambda e: (e[0], e[1]))
    live: set[Hashable] = set()
    found = []
    for _, kind, buffer in events:
        if kind == 0:
            live.discard(buffer)
            continue
        low, high = plan.offsets[buffer], plan.offsets[buffer] + plan.sizes[buffer]
        for other in live:
            if plan.offsets[other] < high and low < plan.offsets[other] + plan.sizes[other]:
                found.append((other, buffer))
                if len(found) >= limit:
                    return found
        live.add(buffer)
    return found
