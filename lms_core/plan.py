"""A swap plan: plain data, deterministic for the same graph and settings, JSON-serializable."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SwapIn:
    """One copy of a swapped tensor back to the compute device, made when `trigger` has run.

    `name` is an op on the host that waits for the trigger; the consumers read it, so the copy to the
    device (TensorFlow's `_Send`/`_Recv` pair from host to device) cannot start before the trigger is
    done. With sync modes 2 and 3, `waiters` must also wait until the value is on the device, which
    a control edge from a host op does not ensure: they wait for `arrival`, an op on the compute
    device that reads the value."""

    name: str  # the gated swap-in op on the host device; the consumers read it
    trigger: str  # the op whose completion lets the copy back start
    trigger_level: int
    consumers: list[str]  # backward ops rerouted to read the swap-in
    consumer_levels: list[int]
    waiters: list[str] = field(default_factory=list)  # sync_mode 2/3: ops held until the value has arrived
    arrival: str | None = None  # with waiters: the op on the compute device they wait for


@dataclass
class Swap:
    tensor: str  # "op:index"
    producer_type: str
    shape: list[int]
    dtype: str
    nbytes: int
    producer_level: int
    swap_out: str  # the swap-out op added on the host device
    swap_ins: list[SwapIn]
    waiters: list[str] = field(default_factory=list)  # sync_mode 1/3: forward ops held until the swap-out is done
    # A loop accumulator (lms_core.loops): a variant whose `nbytes` is what its elements hold, with
    # their shape, dtype and count (element_shape, element_dtype, length). None for a plain tensor.
    tensor_list: dict[str, Any] | None = None


@dataclass
class AddChain:
    """An AddN of n >= 3 inputs computed as n - 1 two-input adds (`AddV2`), each adding the next input
    in the order the inputs are produced (lms_core.add_chains). AddN needs all n inputs and its output
    on the device at once; each add of the chain needs three tensors, and frees the input it has added.
    The same sum, associated differently: float32 results differ by rounding only."""

    op: str  # the AddN; the chain's last add takes its name, so its readers are unchanged
    inputs: list[str]  # the AddN's inputs, "op:index", in the order the chain adds them
    adds: list[str]  # the n - 2 adds before the last one, in chain order
    dtype: str
    nbytes: int  # bytes of the AddN's output (every input has its shape)
    working_set_bytes: int  # the AddN's distinct inputs and output
    chain_working_set_bytes: int  # the largest of the chain's adds


@dataclass(frozen=True)
class ReservedList:
    """A gradient loop's zero list made as a list of unset elements (lms_core.reserved_lists): the
    `ZerosLike` of a list its forward loop read becomes a `TensorListReserve` of the same element
    shape and length, which holds no element buffer until the gradient loop sets each one. The loop
    only adds to the list, and an unset element adds as zero, so the sum is the same bit for bit."""

    op: str  # the ZerosLike; the TensorListReserve takes its name, so the gradient loop still reads it
    source: str  # the list whose element shape and length it copies, "op:index"
    element_dtype: str
    nbytes: int  # what the zero list's elements would hold (length x element)
    gradient_loop: str  # the backward While that fills it
    loop_index: int  # its place among that loop's inputs, and so among its outputs: the filled list


@dataclass(frozen=True)
class Recompute:
    """A forward tensor freed after its forward readers and made again in the backward pass for its
    backward readers (lms_core.recompute): its segment's ops are cloned there, each clone waiting for
    `trigger`, reading the segment's other clones and the anchors (tensors live then anyway)."""

    tensor: str  # "op:index"
    nbytes: int
    ops: list[str]  # the ops cloned, in graph order; the tensor's producer is among them
    clones: list[str]  # their clones' names, in the same order
    anchors: list[str]  # the tensors the clones read from outside the segment
    consumers: list[str]  # the backward ops rerouted to read the clone of `tensor`
    trigger: str  # the backward op every clone waits for
    seconds: float  # the clones' time by the cost model the plan was made with (those it makes)
    # clones among `clones` another entry makes, triggered no later: this entry reads them, makes none
    shared: list[str] = field(default_factory=list)

    def made(self) -> list[tuple[str, str]]:
        """(op, clone) for the clones this entry makes itself, waiting for its trigger."""
        return [(op, clone) for op, clone in zip(self.ops, self.clones) if clone not in self.shared]


@dataclass(frozen=True)
class ControlEdge:
    """`after` waits for `before` (lms_core.serialize: the backward branches run one at a time)."""

    before: str
    after: str


@dataclass
class Skip:
    tensor: str
    nbytes: int | None
    reason: str


@dataclass(frozen=True)
class Plan:
    """What the planner decided, and nothing else: which tensors are swapped and when each comes
    back, which were left and why, and the order imposed on the backward pass. Made whole by the
    planner (lms_core.planner, lms_core.planning) and never filled in later; what is found out
    about it (prediction, estimate, verification) is lms_core.report's."""

    settings: dict[str, Any]  # the LMS settings the plan was made with (LMSConfig.settings())
    swaps: list[Swap] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)  # tensors that would qualify but cannot be swapped
    skipped_small: int = 0  # distant tensors under lms.min_tensor_bytes (counted, not listed)
    control_edges: list[ControlEdge] = field(default_factory=list)  # lms.serialize_branches: the order imposed
    ops: int = 0
    levels: int = 0
    add_chains: list[AddChain] = field(default_factory=list)  # lms.chain_add_n: AddNs computed as chains of adds
    # lms.reserve_gradient_lists: gradient loops' zero lists made as lists of unset elements
    reserved_lists: list[ReservedList] = field(default_factory=list)
    # lms.defer_gradient_zeros: gradient loops' zero initial values made just before their loop
    deferred_zeros: list[ControlEdge] = field(default_factory=list)
    # lms.actions with recompute: forward tensors made again in the backward pass instead of kept or swapped
    recomputes: list[Recompute] = field(default_factory=list)

    @property
    def swapped_bytes(self) -> int:
        return sum(s.nbytes for s in self.swaps)

    @property
    def recomputed_bytes(self) -> int:
        return sum(r.nbytes for r in self.recomputes)

    @property
    def swap_in_count(self) -> int:
        return sum(len(s.swap_ins) for s in self.swaps)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["swapped_bytes"] = self.swapped_bytes
        data["swap_count"] = len(self.swaps)
        return data

    def summary(self) -> str:
        ordered = f"; {len(self.control_edges)} control edge(s) serialize the backward branches" if self.control_edges else ""
        if self.add_chains:
            ordered += f"; {len(self.add_chains)} AddN(s) computed as chains of adds"
        if self.deferred_zeros:
            ordered += f"; {len(self.deferred_zeros)} gradient loop zero(s) made just before their loop"
        if self.reserved_lists:
            ordered += (f"; {len(self.reserved_lists)} gradient loop zero list(s) of "
                        f"{sum(r.nbytes for r in self.reserved_lists) / 2**20:.1f} MiB left unset until filled")
        if self.recomputes:
            ordered += (f"; {len(self.recomputes)} tensor(s) of {self.recomputed_bytes / 2**20:.1f} MiB recomputed in "
                        f"the backward pass ({sum(len(r.made()) for r in self.recomputes)} op(s) cloned)")
        if not self.swaps:
            return (f"LMS plan: nothing to swap ({len(self.skipped)} candidate tensor(s) skipped; "
                    f"see 'skipped' for the reasons){ordered}")
        return (f"LMS plan: {len(self.swaps)} tensor(s) swapped, {self.swapped_bytes / 2**20:.1f} MiB, "
                f"{self.swap_in_count} swap-in(s); {len(self.skipped)} skipped{ordered}")
