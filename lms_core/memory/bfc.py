"""A model of TensorFlow's best-fit-with-coalescing allocator (BFC), replayed on an allocation trace.

What it models is `tsl::BFCAllocator` as TensorFlow 2.18 builds it (xla/tsl/framework/bfc_allocator.cc):

- every request is rounded up to a multiple of 256 bytes (kMinAllocationSize);
- free chunks sit in 21 bins by size, bin b holding [256 << b, 256 << (b + 1)) and the last every
  chunk from 256 MiB up; within a bin they are ordered by (size, address). A request takes the first
  chunk at least its size, searching its own bin and then the larger ones: the smallest chunk that
  fits, the lowest address among equal sizes;
- the chunk taken is split in two when it is at least twice the rounded request, or when what would
  be left over is at least the internal-fragmentation cap (`fragmentation_fraction` x the limit, or
  128 MiB when that fraction is 0); the remainder goes back to a bin, otherwise the caller holds the
  whole chunk (internal fragmentation);
- a released chunk is merged with a free neighbour after it, then with one before it;
- when no chunk fits, the pool grows by one region from the sub-allocator (Extend): it fails at once
  if the request exceeds what the limit leaves (rounded down to 256 bytes); otherwise the region is
  `curr_region_allocation_bytes_`, doubled until it holds the request, or what the limit leaves if
  that is less; when it did not have to double for this request it doubles afterwards. With
  `allow_growth` the first region size is min(limit, 2 MiB); without it, the whole limit (one region);
- regions from a sub-allocator that supports coalescing (none of TensorFlow's CPU or GPU ones does)
  extend the previous region when they are adjacent; otherwise each is separate, and chunks never
  merge across regions;
- with `garbage_collection`, a request that still fails releases every region with nothing in use and
  extends again (DeallocateFreeRegions), when that can make room.

TensorFlow's configurations (read from process_state.cc and gpu_bfc_allocator.cc of 2.18):
`TF_CPU_ALLOCATOR_USE_BFC=true` gives the CPU device a BFCAllocator over BasicCPUAllocator (malloc;
no coalescing), limit `TF_CPU_BFC_MEM_LIMIT_IN_MB` (whole MiB, 64 GiB by default), allow_growth on,
garbage collection off, fragmentation fraction 0 (`CPU_BFC`). A GPU's GPUBFCAllocator takes allow_growth
from `gpu_options.allow_growth` or `TF_FORCE_GPU_ALLOW_GROWTH` (off by default: one region of the
whole memory), garbage collection from `TF_ENABLE_GPU_GARBAGE_COLLECTION` (on by default), the fraction
from `gpu_options.experimental.internal_fragmentation_fraction` (`GPU_BFC`).

What it leaves out: allocations that wait for another thread to free memory (AllocatorRetry waits up
to 10 s on a failed request, which a trace replayed in one order cannot show), and the GPU's
timestamped chunks (only with `gpu_options.experimental.timestamped_allocator`). Each new region is
placed below the previous ones (`regions_descend`), as glibc's mmap hands out large blocks top-down on
Linux; that only decides ties between equal-sized free chunks in different regions.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable

from lms_core.memory.lifetimes import AllocationTrace, TraceEvent

MIN_ALLOCATION = 256  # kMinAllocationSize
NUM_BINS = 21  # kNumBins
DEFAULT_MAX_INTERNAL_FRAGMENTATION = 128 << 20  # bytes a chunk may exceed a request by before it is split
INITIAL_GROWTH_REGION = 2 << 20  # with allow_growth, the first region (unless the limit is smaller)
MIB = 1 << 20
_REGION_SPACING = 1 << 44  # model addresses: regions far apart, never adjacent unless they coalesce


@dataclass(frozen=True)
class BFCOptions:
    """The allocator's configuration (tsl::BFCAllocator::Options and its sub-allocator)."""

    allow_growth: bool = True  # regions grow from 2 MiB by doubling; else one region of the whole limit
    garbage_collection: bool = False  # release wholly free regions to make room for a larger one
    fragmentation_fraction: float = 0.0  # split cap = fraction x limit; 0: 128 MiB
    coalesce_regions: bool = False  # the sub-allocator's SupportsCoalescing(): adjacent regions merge
    regions_descend: bool = True  # each new region lies below the earlier ones (mmap top-down)
    name: str = "bfc"


CPU_BFC = BFCOptions(allow_growth=True, garbage_collection=False, name="TensorFlow CPU BFC (TF_CPU_ALLOCATOR_USE_BFC)")
GPU_BFC = BFCOptions(allow_growth=False, garbage_collection=True, name="TensorFlow GPU BFC (default options)")
GPU_BFC_GROWTH = BFCOptions(allow_growth=True, garbage_collection=True,
                            name="TensorFlow GPU BFC (allow_growth / TF_FORCE_GPU_ALLOW_GROWTH)")


def rounded_bytes(nbytes: int) -> int:
    """RoundedBytes: up to a multiple of 256 (a 1-byte request takes 256)."""
    return MIN_ALLOCATION * ((nbytes + MIN_ALLOCATION - 1) // MIN_ALLOCATION)


def bin_for_size(nbytes: int) -> int:
    """BinNumForSize: floor(log2(max(bytes, 256) / 256)), at most 20."""
    return min(NUM_BINS - 1, (max(nbytes, MIN_ALLOCATION) >> 8).bit_length() - 1)


class Chunk:
    __slots__ = ("ptr", "size", "requested", "in_use", "prev", "next", "region", "binned", "buffer")

    def __init__(self, ptr: int, size: int, region: "Region"):
        self.ptr, self.size, self.region = ptr, size, region
        self.requested = 0
        self.in_use = False
        self.binned = False
        self.prev: Chunk | None = None
        self.next: Chunk | None = None
        self.buffer = None  # the trace's buffer id while in use


@dataclass
class Region:
    index: int  # in the order the sub-allocator handed regions out
    base: int
    size: int
    first: Chunk | None = None


@dataclass(frozen=True)
class Failure:
    """The request that ran out of memory, and the allocator's state then."""

    event_index: int  # position in the trace
    label: str
    requested_bytes: int
    rounded_bytes: int
    in_use_bytes: int
    pool_bytes: int
    largest_free_chunk: int
    limit_bytes: int

    @property
    def free_bytes(self) -> int:
        """Free in the pool plus what the limit still allows the pool to grow by."""
        return self.pool_bytes - self.in_use_bytes + (self.limit_bytes - self.pool_bytes) // MIN_ALLOCATION * MIN_ALLOCATION

    @property
    def fragmented(self) -> bool:
        """The bytes were there, but in no single chunk or region: a fragmentation failure."""
        return self.free_bytes >= self.rounded_bytes

    def describe(self) -> str:
        why = "fragmentation: enough bytes free, no chunk or region large enough" if self.fragmented else \
            "not enough bytes left under the limit"
        return (f"out of memory at event {self.event_index} ({self.label or 'unnamed'}): {self.requested_bytes} B "
                f"(rounded {self.rounded_bytes}); in use {self.in_use_bytes}, pool {self.pool_bytes}, largest free "
                f"chunk {self.largest_free_chunk}, limit {self.limit_bytes}; {why}")


@dataclass(frozen=True)
class Snapshot:
    """The allocator at one instant (TensorFlow's AllocatorStats and GetFragmentation)."""

    event_index: int
    in_use_bytes: int  # chunk bytes held by callers (bytes_in_use)
    requested_bytes: int  # what the callers asked for
    pool_bytes: int  # taken from the sub-allocator
    largest_free_chunk: int

    @property
    def fragmentation(self) -> float:
        """TensorFlow's GetFragmentation: 1 - largest free chunk / free bytes in the pool."""
        free = self.pool_bytes - self.in_use_bytes
        return 0.0 if free <= 0 else (free - self.largest_free_chunk) / free


@dataclass(frozen=True)
class ReplayResult:
    """One replay of a trace under one limit."""

    limit_bytes: int
    options: BFCOptions
    ok: bool
    failure: Failure | None
    peak: Snapshot  # at the highest bytes_in_use
    peak_pool_bytes: int
    regions: tuple[int, ...]  # region sizes, in the order taken (after garbage collection: those left)
    # With keep_layout: for each allocation event (by trace position), (region index, offset, chunk bytes).
    layout: dict[int, tuple[int, int, int]] | None = None


class BFCAllocator:
    """The allocator's state; `allocate` and `free` follow BFCAllocator's AllocateRawInternal and
    DeallocateRawInternal step by step (see the module docstring)."""

    def __init__(self, limit_bytes: int, options: BFCOptions = CPU_BFC):
        self.limit, self.options = limit_bytes, options
        self.curr_region_bytes = rounded_bytes(min(limit_bytes, INITIAL_GROWTH_REGION) if options.allow_growth
                                               else limit_bytes)
        self.max_internal_fragmentation = (int(options.fragmentation_fraction * limit_bytes)
                                           if options.fragmentation_fraction > 0 else DEFAULT_MAX_INTERNAL_FRAGMENTATION)
        self.bins: list[list[tuple[int, int]]] = [[] for _ in range(NUM_BINS)]  # (size, ptr), sorted
        self.free_chunks: dict[int, Chunk] = {}  # ptr -> binned chunk
        self.chunks: dict[int, Chunk] = {}  # ptr -> in-use chunk
        self.regions: list[Region] = []
        self.regions_taken = 0
        self.pool = self.peak_pool = self.in_use = self.requested = 0
        self.next_low = self.next_high = 0  # where the next region goes, below or above the others

    # Bins -------------------------------------------------------------------------------------------
    def _insert_free(self, chunk: Chunk) -> None:
        bisect.insort(self.bins[bin_for_size(chunk.size)], (chunk.size, chunk.ptr))
        self.free_chunks[chunk.ptr] = chunk
        chunk.binned = True

    def _remove_free(self, chunk: Chunk) -> None:
        entries = self.bins[bin_for_size(chunk.size)]
        del entries[bisect.bisect_left(entries, (chunk.size, chunk.ptr))]
        del self.free_chunks[chunk.ptr]
        chunk.binned = False

    def largest_free_chunk(self) -> int:
        for entries in reversed(self.bins):
            if entries:
                return entries[-1][0]
        return 0

    # Allocation -------------------------------------------------------------------------------------
    def _find_chunk(self, rounded: int, requested: int) -> Chunk | None:
        """FindChunkPtr: the first chunk >= rounded in (size, address) order, from the request's bin up."""
        for bin_index in range(bin_for_size(rounded), NUM_BINS):
            entries = self.bins[bin_index]
            position = bisect.bisect_left(entries, (rounded,))  # before every (rounded, address)
            if position == len(entries):
                continue
            chunk = self.free_chunks[entries[position][1]]
            self._remove_free(chunk)
            if chunk.size >= rounded * 2 or chunk.size - rounded >= self.max_internal_fragmentation:
                self._split(chunk, rounded)
            chunk.in_use, chunk.requested = True, requested
            self.chunks[chunk.ptr] = chunk
            self.in_use += chunk.size
            self.requested += requested
            return chunk
        return None

    def _split(self, chunk: Chunk, size: int) -> None:
        rest = Chunk(chunk.ptr + size, chunk.size - size, chunk.region)
        chunk.size = size
        rest.prev, rest.next = chunk, chunk.next
        if chunk.next is not None:
            chunk.next.prev = rest
        chunk.next = rest
        self._insert_free(rest)

    def _extend(self, rounded: int) -> bool:
        """Extend: one more region from the sub-allocator (which never refuses here)."""
        available = (self.limit - self.pool) // MIN_ALLOCATION * MIN_ALLOCATION
        if rounded > available:
            return False
        increased = False
        while rounded > self.curr_region_bytes:
            self.curr_region_bytes *= 2
            increased = True
        size = min(self.curr_region_bytes, available)
        if not increased:
            self.curr_region_bytes *= 2
        self.pool += size
        self.peak_pool = max(self.peak_pool, self.pool)
        self._add_region(size)
        return True

    def _add_region(self, size: int) -> None:
        options = self.options
        if options.coalesce_regions and self.regions:
            region = max(self.regions, key=lambda r: r.base)  # regions come contiguous, upwards
            base = region.base + region.size
            region.size += size
        else:
            if options.regions_descend and not options.coalesce_regions:
                self.next_low -= size + _REGION_SPACING
                base = self.next_low
            else:
                base = self.next_high
                self.next_high += size + (0 if options.coalesce_regions else _REGION_SPACING)
            region = Region(self.regions_taken, base, size)
            self.regions.append(region)
        self.regions_taken += 1
        chunk = Chunk(base, size, region)
        if region.first is None:
            region.first = chunk
        else:  # the region was extended: link after its last chunk and merge with it if free
            last = region.first
            while last.next is not None:
                last = last.next
            last.next, chunk.prev = chunk, last
        self._insert_free(self._coalesce(chunk))

    def _free_empty_regions(self, rounded: int) -> bool:
        """DeallocateFreeRegions (garbage collection): drop the regions with nothing in use, if that
        leaves room for the request."""
        if not self.options.garbage_collection:
            return False
        empty = [r for r in self.regions if not _region_in_use(r)]
        freed = sum(r.size for r in empty)
        if freed == 0 or rounded > self.limit - self.pool + freed:
            return False
        for region in empty:
            chunk = region.first
            while chunk is not None:
                if chunk.binned:
                    self._remove_free(chunk)
                chunk = chunk.next
            self.pool -= region.size
            self.regions.remove(region)
        return True

    def allocate(self, nbytes: int, buffer=None) -> Chunk | None:
        """AllocateRawInternal: the chunk given to a request of `nbytes` (> 0), or None when out of memory."""
        rounded = rounded_bytes(nbytes)
        chunk = self._find_chunk(rounded, nbytes)
        if chunk is None and self._extend(rounded):
            chunk = self._find_chunk(rounded, nbytes)
        if chunk is None and self._free_empty_regions(rounded) and self._extend(rounded):
            chunk = self._find_chunk(rounded, nbytes)
        if chunk is not None:
            chunk.buffer = buffer
        return chunk

    # Release ----------------------------------------------------------------------------------------
    def free(self, ptr: int) -> None:
        """DeallocateRawInternal: mark free, merge with free neighbours (next first, then previous)."""
        chunk = self.chunks.pop(ptr)
        chunk.in_use, chunk.buffer = False, None
        self.in_use -= chunk.size
        self.requested -= chunk.requested
        self._insert_free(self._coalesce(chunk))

    def _coalesce(self, chunk: Chunk) -> Chunk:
        """TryToCoalesce: merge a free chunk (not in a bin) with free neighbours; returns the result."""
        after = chunk.next
        if after is not None and not after.in_use:
            self._remove_free(after)
            _merge(chunk, after)
        before = chunk.prev
        if before is not None and not before.in_use:
            self._remove_free(before)
            _merge(before, chunk)
            chunk = before
        return chunk

    def snapshot(self, event_index: int) -> Snapshot:
        return Snapshot(event_index, self.in_use, self.requested, self.pool, self.largest_free_chunk())

    def layout(self) -> list[list[tuple[int, int, bool]]]:
        """Every region's chunks in address order: (offset, size, in use)."""
        result = []
        for region in sorted(self.regions, key=lambda r: r.index):
            chunks, chunk = [], region.first
            while chunk is not None:
                chunks.append((chunk.ptr - region.base, chunk.size, chunk.in_use))
                chunk = chunk.next
            result.append(chunks)
        return result


def _merge(first: Chunk, second: Chunk) -> None:
    first.size += second.size
    first.next = second.next
    if second.next is not None:
        second.next.prev = first


def _region_in_use(region: Region) -> bool:
    chunk = region.first
    while chunk is not None:
        if chunk.in_use:
            return True
        chunk = chunk.next
    return False


def replay(trace: AllocationTrace | Iterable[TraceEvent], limit_bytes: int, options: BFCOptions = CPU_BFC,
           keep_layout: bool = False) -> ReplayResult:
    """Replays `trace` in order on a fresh allocator held to `limit_bytes`; stops at the first
    allocation that runs out of memory. Releases of buffers the trace never allocated are ignored."""
    events = trace.events if isinstance(trace, AllocationTrace) else tuple(trace)
    allocator = BFCAllocator(limit_bytes, options)
    where: dict[object, int] = {}  # live buffer -> chunk address
    layout: dict[int, tuple[int, int, int]] | None = {} if keep_layout else None
    peak = allocator.snapshot(-1)
    failure = None
    for index, event in enumerate(events):
        if event.alloc:
            chunk = allocator.allocate(event.nbytes, event.buffer)
            if chunk is None:
                failure = Failure(index, event.label, event.nbytes, rounded_bytes(event.nbytes), allocator.in_use,
                                  allocator.pool, allocator.largest_free_chunk(), limit_bytes)
                break
            where[event.buffer] = chunk.ptr
            if allocator.in_use > peak.in_use_bytes:
                peak = allocator.snapshot(index)
            if layout is not None:
                layout[index] = (chunk.region.index, chunk.ptr - chunk.region.base, chunk.size)
        else:
            ptr = where.pop(event.buffer, None)
            if ptr is not None:
                allocator.free(ptr)
    regions = tuple(r.size for r in sorted(allocator.regions, key=lambda r: r.index))
    return ReplayResult(limit_bytes, options, failure is None, failure, peak, allocator.peak_pool, regions, layout)


@dataclass(frozen=True)
class Requirement:
    """The smallest limit under which a trace runs, by the model, and what the allocator looks like there."""

    limit_bytes: int  # smallest working limit, a multiple of `granularity`
    granularity: int
    live_peak_bytes: int  # the most bytes requested and live at once (what a schedule's peak counts)
    rounded_live_peak_bytes: int  # the same with every request rounded to 256 bytes: no limit below it works
    at_limit: ReplayResult  # the replay at `limit_bytes`
    below: ReplayResult | None  # the replay one granule lower (its failure), None when that is the lower bound
    replays: int
    working_below: tuple[int, ...] = field(default=())  # limits under `limit_bytes` found to work too (not monotone)

    @property
    def overhead(self) -> float:
        """How much more than the live peak the allocator needs (0.1 = 10%)."""
        return self.limit_bytes / self.live_peak_bytes - 1 if self.live_peak_bytes else 0.0

    def describe(self) -> str:
        peak = self.at_limit.peak
        return (f"BFC requirement {self.limit_bytes / MIB:.2f} MiB ({self.at_limit.options.name}), live peak "
                f"{self.live_peak_bytes / MIB:.2f} MiB (+{self.overhead:.1%}); at the peak {peak.in_use_bytes / MIB:.2f} "
                f"MiB in chunks, pool {peak.pool_bytes / MIB:.2f} MiB, fragmentation {peak.fragmentation:.2f}; "
                f"{len(self.at_limit.regions)} region(s)")


def smallest_limit(trace: AllocationTrace, options: BFCOptions = CPU_BFC, granularity: int = MIB,
                   check_below: int = 8) -> Requirement:
    """The smallest multiple of `granularity` under which `trace` replays without running out of
    memory. Bisection between the rounded live peak (nothing less can work) and, with growth, the pool
    an unlimited replay takes (which works: every extension gets the same region); then the `check_below`
    granules under the answer are replayed too, and any that work are reported (growth by regions
    need not make "fits" monotone in the limit)."""
    if granularity % MIN_ALLOCATION:
        raise ValueError(f"granularity must be a multiple of {MIN_ALLOCATION} bytes, got {granularity}")
    live, rounded_live = trace.live_peak(), trace.live_peak(MIN_ALLOCATION)
    low = _round_up(rounded_live, granularity)  # candidate; everything below it fails
    if options.allow_growth:
        high, replays = max(low, _round_up(replay(trace, 1 << 62, options).peak_pool_bytes, granularity)), 1
    else:  # one region of the whole limit: start a quarter above the live peak and double
        high, replays = _round_up(rounded_live + rounded_live // 4, granularity), 0
    results: dict[int, ReplayResult] = {}

    def runs(limit: int) -> bool:
        nonlocal replays
        if limit not in results:
            results[limit] = replay(trace, limit, options)
            replays += 1
        return results[limit].ok

    while not runs(high):  # only without growth: widen
        low, high = high + granularity, _round_up(high * 2, granularity)
    while low < high:
        middle = _round_up((low + high) // 2, granularity)
        if middle >= high:
            middle = high - granularity
        if middle < low:
            break
        if runs(middle):
            high = middle
        else:
            low = middle + granularity
    working_below = tuple(limit for limit in range(high - granularity, max(0, high - (check_below + 1) * granularity),
                                                   -granularity) if limit >= rounded_live and runs(limit))
    below_limit = high - granularity
    below = results.get(below_limit) if below_limit >= rounded_live else None
    if below is None and below_limit >= rounded_live:
        below = replay(trace, below_limit, options)
        replays += 1
    return Requirement(high, granularity, live, rounded_live, results[high], below, replays, working_below)


def _round_up(value: int, granularity: int) -> int:
    return -(-value // granularity) * granularity
