"""What one rank plans LMS for: its host-device link, its device's cost profile, and the device and
host memory it may use. Each line saying where a figure came from goes into the rank's log."""
from __future__ import annotations

from lms_core.config import CustomDevice, LMSConfig
from lms_core.costs import PROFILES, DeviceProfile
from lms_core.link import link_named, resolve_link
from lms_core.planning import Target
from lms_core.units import format_bytes, parse_bytes

FALLBACK_PROFILE = "v100"  # the LMS papers' 16 GB GPU: what a CPU-only rank plans for


def gpu_details(local_rank: int) -> tuple[str, int] | None:
    """(name, total memory) of this rank's GPU from NVML, or None without a GPU or NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(local_rank % pynvml.nvmlDeviceGetCount())
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            return name, int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no GPU, no NVML
        return None


def device_profile(lms: LMSConfig, gpu: tuple[str, int] | None) -> tuple[DeviceProfile, int, str]:
    """The cost profile, the device memory to plan for, and a line saying where they came from."""
    if isinstance(lms.device, CustomDevice):
        profile, why = lms.device.profile(), "lms.device: custom profile"
    elif lms.device != "auto":
        profile, why = PROFILES[lms.device], f"lms.device {lms.device}"
    elif gpu is not None:
        key = next((k for k in PROFILES if k.upper() in gpu[0].upper()), FALLBACK_PROFILE)
        profile, why = PROFILES[key], f"NVML: {gpu[0]}"
    else:
        profile, why = PROFILES[FALLBACK_PROFILE], "no GPU: planning for the papers' 16 GB V100"
    if lms.device_memory:
        memory = parse_bytes(lms.device_memory)
    elif gpu is not None:
        memory = gpu[1]
    else:
        memory = profile.memory_bytes
    return profile, memory, why


def rank_target(lms: LMSConfig, rank: int, local_rank: int, local_size: int, on_gpu: bool):
    """What this rank plans for, and the lines that say so."""
    gpu = gpu_details(local_rank) if on_gpu else None
    if lms.rank_links:
        link = link_named(lms.rank_links[rank % len(lms.rank_links)])
        link_line = f"link (lms.rank_links) {link.describe()}"
    elif lms.measure_link and on_gpu:
        from lms_core.tf.bandwidth import measure_link

        link = measure_link()
        link_line = f"link {link.describe()}"
    else:
        link, link_line = resolve_link(lms.link, lms.link_fallback, local_rank if on_gpu else None)
        if lms.measure_link:
            link_line += " (lms.measure_link needs a GPU to time copies on; this rank has none)"
    profile, memory, device_line = device_profile(lms, gpu)
    host_total, host = host_memory(lms, local_size)
    target = Target(link=link, device=profile, device_memory_bytes=memory, host_memory_bytes=host)
    return target, [link_line, f"device {profile.describe()} ({device_line}); planning for {format_bytes(memory)}",
                    f"host memory {format_bytes(host)} for this rank ({'lms.host_memory' if lms.host_memory else 'this host'}"
                    f"'s {format_bytes(host_total)} shared by {local_size} rank(s))"]


def host_memory(lms: LMSConfig, local_size: int) -> tuple[int, int]:
    """(the host's memory, this rank's share of it): `lms.host_memory`, else this machine's RAM,
    shared by the `local_size` ranks on the host."""
    import psutil

    total = parse_bytes(lms.host_memory) if lms.host_memory else psutil.virtual_memory().total
    return total, int(total / max(1, local_size))
