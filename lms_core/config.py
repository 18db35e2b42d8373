"""Typed LMS settings: the `lms:` section of a recipe.

The names follow IBM TFLMS v2 (`swapout_threshold`, `swapin_ahead`, `swapin_groupby`, `sync_mode`),
because that is the vocabulary users of LMS already know. Distances are in *levels* of the
categorized topological order (Le et al., ISMM 2019), not in ops.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lms_core.costs import PROFILES, DeviceProfile
from lms_core.link import LinkRates, link_named
from lms_core.units import parse_bytes


class SettingError(ValueError):
    """A setting has a bad value. `key` is the field name inside its section (the recipe loader
    prefixes the section path, e.g. `lms.swapout_threshold`); `rule` says what a valid value is."""

    def __init__(self, key: str, rule: str):
        super().__init__(f"{key}: {rule}")
        self.key = key
        self.rule = rule


STRATEGIES = ("auto", "distance", "access-order")
FIT_JUDGES = ("auto", "bfc", "live")
ACTIONS = ("swap", "recompute")

SYNC_MODES = {
    0: "asynchronous: nothing waits for a copy except the consumer of a swap-in",
    1: "synchronous swap-out: forward ops after the source wait until its swap-out has finished",
    2: "synchronous swap-in: the trigger's successors wait until the swap-in has arrived",
    3: "both synchronous swap-out and synchronous swap-in",
}


@dataclass
class CustomDevice:
    """A device profile given by its peaks, for GPUs without a named profile:
    `lms.device: {tflops: 30, memory_gb_per_s: 1000, memory: 24GiB}`."""

    tflops: float | None = None
    """Peak dense FP32 TFLOP/s (datasheet; the cost model assumes kernels reach 60% of it)."""

    memory_gb_per_s: float | None = None
    """Device memory bandwidth in GB/s."""

    memory: int | str | None = None
    """Device memory size, e.g. `24GiB`; also what is planned for unless `lms.device_memory` is set."""

    name: str = "custom"
    """What logs and plans call the profile."""

    memory_bytes: int = field(init=False, repr=False)
    """`memory` in bytes, parsed once."""

    def __post_init__(self) -> None:
        missing = [key for key in ("tflops", "memory_gb_per_s", "memory") if getattr(self, key) is None]
        if missing:
            raise SettingError(missing[0], f"a custom device needs tflops, memory_gb_per_s and memory; "
                                           f"missing {', '.join(missing)}")
        for key in ("tflops", "memory_gb_per_s"):
            if getattr(self, key) <= 0:
                raise SettingError(key, f"must be > 0, got {getattr(self, key)}")
        self.memory_bytes = _bytes("memory", self.memory)

    def profile(self) -> DeviceProfile:
        return DeviceProfile(self.name, self.tflops * 1e12, self.memory_gb_per_s * 1e9, self.memory_bytes)


@dataclass
class LMSConfig:
    """Large Model Support: which activations are parked in host memory and when they come back."""

    enabled: bool = False
    """Rewrite each rank's training step so long-lived activations are swapped to host memory."""

    mode: str = "auto"
    """`auto`: each rank plans for its own link and device by simulation (see `strategy`); `manual`:
    the values below are used as given."""

    strategy: str = "auto"
    """How tensors are chosen. `distance`: TFLMS's rules (the four knobs below; tuned in mode auto).
    `access-order`: from each tensor's reads on the simulated schedule, just enough of them to meet
    the device budget, each brought back as late as the link allows (lms_core/access_order.py; needs
    a target, so mode auto). `auto`: in mode auto both are planned and the faster plan that fits is
    kept, per rank; in mode manual, `distance`."""

    actions: list[str] = field(default_factory=lambda: ["swap", "recompute"])
    """What may be done with a tensor the backward pass reads late, besides keeping it: `swap` (park
    it in host memory and bring it back) and `recompute` (free it after its forward readers and make
    it again just before its first backward reader, from tensors live then: deterministic, stateless,
    memory-bound ops only; lms_core/recompute.py). With both, each rank plans with and without
    recompute (mode auto) and keeps the faster plan that fits. Recompute needs mode auto."""

    swapout_threshold: int = 8
    """Swap a forward tensor out only for backward consumers at least this many levels after its
    producer. Smaller swaps more tensors (more memory saved, more traffic). Must be >= 1."""

    swapin_ahead: int = 2
    """The swap-in of a tensor starts when the op this many levels before its consumer has run, so
    the copy overlaps with compute. 0 starts it as late as possible. Must be >= 0."""

    swapin_groupby: int = 0
    """Backward consumers of one tensor whose levels lie within this distance share one swap-in
    (fewer copies, longer residency). 0 gives every consumer level its own swap-in. Must be >= 0."""

    sync_mode: int = 0
    """0 asynchronous, 1 synchronous swap-out, 2 synchronous swap-in, 3 both (TFLMS v2 semantics)."""

    min_tensor_bytes: int = 1 << 20
    """Tensors smaller than this many bytes are never swapped: their copy costs more than it saves."""

    refine_on_replay: bool = True
    """Plans, on their replay: trigger copies back earlier where the host-to-device queue would idle
    and the device has room (lms_core/prefetch.py; the access-order plan, and the tuner's chosen
    distance plan), then, for access-order plans, drop the swaps of backward-made tensors the
    replay does not need (lms_core/pruning.py); never a higher peak, always a faster
    step. Grappler's estimate, whose copies take no time, can put such a plan higher (the 3D U-Net
    at 368^3 on nvlink2 with copies moved: 17.89 GiB, 15.57 before), so where the estimate judges
    "fits" (`plan`, the bench, each rank) a refined plan it puts over the device memory is tried as
    it was before this."""

    serialize_branches: bool = True
    """Where the backward pass's branches join (a ResNet block's main path and shortcut, the terms of a
    batch-norm gradient), run them one after another, the heavier first, so their temporaries are not
    resident together (lms_core/serialize.py; TFLMS v2's `serialization`, placed by structure)."""

    chain_add_n: bool = False
    """Compute each AddN that sets the floor (its n inputs and its output, live at once, are the
    step's largest working set) as a chain of two-input adds, in the order its inputs are produced:
    three tensors live per add (lms_core/add_chains.py). The same sum up to float rounding; it lets a
    plan pass the floor of the traced step (ResNet-50: batch 1321 on 16 GiB). Off by default: below
    the floor it saves nothing a swap cannot, and costs the partial sum's extra reads and writes."""

    reserve_gradient_lists: bool = True
    """Leave the zero lists that gradient loops fill (the gradient of a recurrent layer's unstacked
    input) unset until each loop fills its own: a `TensorListReserve` in place of the `ZerosLike` that
    holds the whole list from the forward pass on (lms_core/reserved_lists.py). The same sums bit for
    bit; nothing to turn off but for comparison."""

    defer_gradient_zeros: bool = True
    """Make the zeros a gradient loop starts from (a weight gradient's running sum, the gradient of
    a loop output nothing read) just before that loop, not when the step starts: a control edge from
    the loop's trigger (lms_core/deferred_zeros.py). The same values; nothing to turn off but for
    comparison."""

    swap_backward: bool = True
    """Also swap backward-pass tensors read again `swapout_threshold` levels later or more (a gradient
    term summed at the end of a batch-norm gradient, a gradient kept for a fork's other branch), not
    only forward activations."""

    include_scopes: list[str] = field(default_factory=list)
    """Only tensors whose producer's name starts with one of these scopes are swapped (empty: all)."""

    exclude_scopes: list[str] = field(default_factory=list)
    """Tensors whose producer's name starts with one of these scopes are never swapped."""

    include_types: list[str] = field(default_factory=list)
    """Only tensors produced by these op types (e.g. `Relu`, `Conv2D`) are swapped (empty: all)."""

    exclude_types: list[str] = field(default_factory=list)
    """Tensors produced by these op types are never swapped."""

    link: float | str = "auto"
    """Host-device link: `auto` (NVML on a GPU), `pcie3`, `pcie4`, `pcie5`, `nvlink2`, `c2c`, or a rate in
    GB/s. The rates behind each name, with sources, are in lms_core/link.py."""

    link_fallback: float | str = "pcie3"
    """The link `auto` assumes when it cannot tell (no GPU, no NVML); the log says when it did."""

    rank_links: list[str] = field(default_factory=list)
    """Links by rank (rank 0 first), overriding `link`: for clusters whose ranks sit on different links."""

    measure_link: bool | str = "auto"
    """On a GPU, time host-device copies of a few sizes at start-up (inside a `tf.function`, as the
    swaps make them) and plan with the measured rates: `auto` (the default) where `lms.link` is
    `auto`; `true` over a named link too; `false` never (NVML's table then). On an H200 the measured
    rates were NVML's within 2% (2026-11-27, benchmarks/results/gpu-h200-link.txt)."""

    device: str | CustomDevice = "auto"
    """Device profile for the cost model: `auto` (from NVML's GPU name; v100 without a GPU), `v100`,
    `a100`, `h100`, `h200`, or a custom one: `{tflops: 30, memory_gb_per_s: 1000, memory: 24GiB}`."""

    measure_ops: bool = False
    """On a GPU, time every op with the TensorFlow profiler over `profile_steps` steps of the first
    calibrated plan, and make the plans after it with those times instead of the cost model's (the
    first plan too, once more, where it fitted). Needs `calibrate`."""

    profile_steps: int = 3
    """How many steps `measure_ops` profiles (after one unprofiled warm-up step). Must be >= 1."""

    calibrate: bool = True
    """On a GPU, measure each plan's real peak over its first steps before training and plan again
    until it fits (lms_core/driver.py; docs/lms.md, "Calibration on the GPU"). In mode manual the
    plan is only measured and the log says how far the models were off. CPU ranks never calibrate:
    their two logical devices share one allocator, so no plan moves their peak."""

    calibrate_steps: int = 3
    """How many steps of each plan calibration runs (the first is not counted: it pays for tracing
    and cuDNN's algorithm search). Weights and optimizer state are restored afterwards. Must be >= 1."""

    calibration_cache: str | None = None
    """Where calibrated budgets are kept between runs (default: $XDG_CACHE_HOME/lms-launch/calibration,
    else ~/.cache/lms-launch/calibration); `none` keeps nothing."""

    calibrate_rounds: int = 4
    """The most plans calibration measures (each costs a plan and `calibrate_steps` steps). Must be >= 1."""

    device_memory: int | str | None = None
    """Device memory to plan for, e.g. `16GiB` (default: the GPU's, or the profile's without one)."""

    host_memory: int | str | None = None
    """Host memory to plan for, e.g. `512GiB`, shared by the ranks of a host (default: this machine's
    RAM; set it when planning for another machine with `lms-launch plan`)."""

    memory_ratio: float = 0.9
    """The device budget is device memory x this: room for what no plan models. TensorFlow's GPU
    device keeps 1050 MiB (compute capability 7) to 1536 MiB (8) of the free memory back for the
    system (MinSystemMemory in gpu_device.cc) and kernels' workspaces (cuDNN) are in no graph; with
    `fit_judge: live` the ratio must also hold the allocator's fragmentation."""

    fit_judge: str = "live"
    """What must fit the device budget. `live` (the default): the simulated peak of live bytes (the
    headroom is then all there is for fragmentation). `bfc`: that, and the memory TensorFlow's GPU
    allocator (BFC: best fit with coalescing) needs for the plan's simulated allocation trace,
    fragmentation included (lms_core/memory). `auto`: `bfc` for a step computed on a GPU, or planned
    for one; `live` for a step computed on a CPU, whose simulated trace misses the CPU kernels'
    scratch memory (Eigen's convolution gradients: up to 60% of the real requirement, docs/lms.md).
    `bfc` is not the default yet: the allocator model and Grappler's estimate, which judges "fits" in
    `plan` and the bench, disagree on which plans fit (3D U-Net 192^3 at batch 4: the model needs
    20.13 GiB for the access-order plan of 14.69 GiB live, so `bfc` keeps a distance plan Grappler
    puts at 16.15 GiB, over 16). The first GPU run sides with the model: the U-Net at 256^3 on an
    H100 held to 16 GiB (2026-11-27), an access-order plan of 14.40 GiB simulated that the model said
    needs 17.85 GiB ran out of memory. One case; making `bfc` the GPU rank's default waits for the
    bench re-run with it (docs/benchmarks.md, "An H100")."""

    host_memory_ratio: float = 0.8
    """The auto-tuner keeps swapped bytes under host memory x this, shared by the ranks of a host."""

    # Parsed once from the settings above when the config is made; nothing downstream parses them again.
    link_rates: LinkRates | None = field(init=False, repr=False)
    """`link` as rates; None for `auto` (NVML decides on a GPU, launcher.lms.target)."""

    link_fallback_rates: LinkRates = field(init=False, repr=False)
    """`link_fallback` as rates."""

    rank_link_rates: tuple[LinkRates, ...] = field(init=False, repr=False)
    """`rank_links` as rates, rank 0 first."""

    device_memory_bytes: int | None = field(init=False, repr=False)
    """`device_memory` in bytes; None: the GPU's own, or the device profile's."""

    host_memory_bytes: int | None = field(init=False, repr=False)
    """`host_memory` in bytes; None: this machine's RAM."""

    def __post_init__(self) -> None:
        if self.swapout_threshold < 1:
            raise SettingError("swapout_threshold", f"must be >= 1 level, got {self.swapout_threshold}")
        if self.swapin_ahead < 0:
            raise SettingError("swapin_ahead", f"must be >= 0 levels, got {self.swapin_ahead}")
        if self.swapin_groupby < 0:
            raise SettingError("swapin_groupby", f"must be >= 0 levels, got {self.swapin_groupby}")
        if self.sync_mode not in SYNC_MODES:
            raise SettingError("sync_mode", f"must be one of 0, 1, 2, 3, got {self.sync_mode}")
        if self.min_tensor_bytes < 0:
            raise SettingError("min_tensor_bytes", f"must be >= 0, got {self.min_tensor_bytes}")
        if self.mode not in ("auto", "manual"):
            raise SettingError("mode", f"must be auto or manual, got {self.mode!r}")
        if self.strategy not in STRATEGIES:
            raise SettingError("strategy", f"must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        unknown = [action for action in self.actions if action not in ACTIONS]
        if not self.actions or unknown:
            raise SettingError("actions", f"must list one or both of {', '.join(ACTIONS)}; got {self.actions!r}")
        if self.fit_judge not in FIT_JUDGES:
            raise SettingError("fit_judge", f"must be one of {', '.join(FIT_JUDGES)}, got {self.fit_judge!r}")
        if self.measure_link not in (True, False, "auto"):
            raise SettingError("measure_link", f"must be auto, true or false, got {self.measure_link!r}")
        self.link_rates = None if self.link == "auto" else _rates("link", self.link)
        self.link_fallback_rates = _rates("link_fallback", self.link_fallback)
        self.rank_link_rates = tuple(_rates(f"rank_links[{i}]", v) for i, v in enumerate(self.rank_links))
        if isinstance(self.device, str) and self.device != "auto" and self.device not in PROFILES:
            raise SettingError("device", f"must be auto, one of {', '.join(PROFILES)}, or a custom profile "
                                         f"{{tflops, memory_gb_per_s, memory}}; got {self.device!r}")
        if self.calibrate_steps < 1:
            raise SettingError("calibrate_steps", f"must be >= 1 (lms.calibrate=false turns calibration off), got "
                                                  f"{self.calibrate_steps}")
        if self.calibrate_rounds < 1:
            raise SettingError("calibrate_rounds", f"must be >= 1, got {self.calibrate_rounds}")
        if self.measure_ops and not self.calibrate:
            raise SettingError("measure_ops", "op times are measured in calibration's steps: set lms.calibrate=true, "
                                              "or lms.measure_ops=false")
        if self.profile_steps < 1:
            raise SettingError("profile_steps", f"must be >= 1, got {self.profile_steps}")
        self.device_memory_bytes = _bytes("device_memory", self.device_memory)
        self.host_memory_bytes = _bytes("host_memory", self.host_memory)
        for key in ("memory_ratio", "host_memory_ratio"):
            if not 0 < getattr(self, key) <= 1:
                raise SettingError(key, f"must be in (0, 1], got {getattr(self, key)}")

    def settings(self) -> dict[str, Any]:
        """The settings as given (what a recipe says), without what was parsed from them: a plan's
        `settings` and the resolved recipe.yaml."""
        return settings_of(self)


def settings_of(config) -> dict[str, Any]:
    """A config dataclass's settings as given, nested configs likewise: its init fields only, so the
    values parsed from them stay out (the dict loads back into the same config)."""
    def plain(value):
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return settings_of(value)
        if isinstance(value, (list, tuple)):
            return [plain(item) for item in value]
        return value

    return {f.name: plain(getattr(config, f.name)) for f in dataclasses.fields(config) if f.init}


def _rates(key: str, spec: str | float) -> LinkRates:
    try:
        return link_named(spec)
    except ValueError as err:
        raise SettingError(key, str(err)) from None


def _bytes(key: str, size: int | str | None) -> int | None:
    if size is None:
        return None
    try:
        return parse_bytes(size)
    except ValueError as err:
        raise SettingError(key, str(err)) from None
