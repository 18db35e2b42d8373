"""What one rank plans LMS for: its host-device link, its device's cost profile, and the device and
host memory it may use. Each choice comes with a line saying where it came from, for the rank's log.

The link is chosen here and nowhere else, in this order: `lms.rank_links` (the rank's own entry),
then on a GPU the rates timed at start-up (`lms.measure_link`: by default where `lms.link` is
`auto`), then `lms.link` when it names a link, then (for `auto`) what NVML reports for the rank's
GPU, and last `lms.link_fallback`.
"""
from __future__ import annotations

from typing import Callable

from lms_core.config import CustomDevice, LMSConfig
from lms_core.costs import PROFILES, DeviceProfile
from lms_core.link import LinkRates
from lms_core.nvml import GpuInfo, probe_gpu
from lms_core.planning import Target
from lms_core.units import format_bytes

FALLBACK_PROFILE = "v100"  # the LMS papers' 16 GB GPU: what a CPU-only rank plans for


def choose_link(lms: LMSConfig, rank: int, gpu: GpuInfo | None,
                measure: Callable[[], LinkRates] | None = None) -> tuple[LinkRates, str]:
    """The rank's link and the line that says why. `gpu` is what NVML says of the rank's GPU (None
    on a CPU rank); `measure` times copies on it (lms.measure_link), when there is a GPU to time."""
    if lms.rank_link_rates:
        link = lms.rank_link_rates[rank % len(lms.rank_link_rates)]
        return link, f"link (lms.rank_links) {link.describe()}"
    measuring = lms.measure_link is True or (lms.measure_link == "auto" and lms.link_rates is None)
    if measuring and measure is not None:
        link = measure()
        return link, f"link {link.describe()}"
    note = " (lms.measure_link needs a GPU to time copies on; this rank has none)" if lms.measure_link is True else ""
    if lms.link_rates is not None:
        return lms.link_rates, f"link {lms.link_rates.describe()}{note}"
    if gpu is not None and gpu.link is not None:
        return gpu.link, f"link (detected) {gpu.link.describe()}{note}"
    why = "no GPU" if gpu is None else "NVML could not tell"
    fallback = lms.link_fallback_rates
    return fallback, f"link auto: {why}, so the recipe's lms.link_fallback: {fallback.describe()}{note}"


def device_profile(lms: LMSConfig, gpu: GpuInfo | None) -> tuple[DeviceProfile, int, str]:
    """The cost profile, the device memory to plan for, and a line saying where they came from."""
    if isinstance(lms.device, CustomDevice):
        profile, why = lms.device.profile(), "lms.device: custom profile"
    elif lms.device != "auto":
        profile, why = PROFILES[lms.device], f"lms.device {lms.device}"
    elif gpu is not None:
        key = next((k for k in PROFILES if k.upper() in gpu.name.upper()), FALLBACK_PROFILE)
        profile, why = PROFILES[key], f"NVML: {gpu.name}"
    else:
        profile, why = PROFILES[FALLBACK_PROFILE], "no GPU: planning for the papers' 16 GB V100"
    if lms.device_memory_bytes is not None:
        memory = lms.device_memory_bytes
    elif gpu is not None:
        memory = gpu.memory_bytes
    else:
        memory = profile.memory_bytes
    return profile, memory, why


def host_memory(lms: LMSConfig, local_size: int) -> tuple[int, int]:
    """(the host's memory, this rank's share of it): `lms.host_memory`, else this machine's RAM,
    shared by the `local_size` ranks on the host."""
    import psutil

    total = lms.host_memory_bytes if lms.host_memory_bytes is not None else psutil.virtual_memory().total
    return total, int(total / max(1, local_size))


def rank_target(lms: LMSConfig, rank: int, local_rank: int, local_size: int, on_gpu: bool) -> tuple[Target, list[str]]:
    """What this rank plans for, and the lines that say so."""
    gpu = probe_gpu(local_rank) if on_gpu else None
    measure = None
    if on_gpu:
        from lms_core.tf.bandwidth import measure_link

        measure = measure_link
    link, link_line = choose_link(lms, rank, gpu, measure)
    profile, memory, device_line = device_profile(lms, gpu)
    host_total, host = host_memory(lms, local_size)
    target = Target(link=link, device=profile, device_memory_bytes=memory, host_memory_bytes=host)
    source = "lms.host_memory" if lms.host_memory_bytes is not None else "this host"
    return target, [link_line, f"device {profile.describe()} ({device_line}); planning for {format_bytes(memory)}",
                    f"host memory {format_bytes(host)} for this rank ({source}'s {format_bytes(host_total)} shared by "
                    f"{local_size} rank(s))"]
