"""What NVML says about one rank's GPU: its name, memory and host link, read in one place.

A rank picks its GPU by local rank (launcher.rank.devices: local rank modulo the GPUs it sees), so
the probe indexes NVML the same way. Everything degrades to None without a driver, a GPU or the
`pynvml` module: callers then fall back to the recipe and say so.
"""
from __future__ import annotations

from dataclasses import dataclass

from lms_core.link import NAMED_LINKS, LinkRates, pcie_link


@dataclass(frozen=True)
class GpuInfo:
    index: int  # NVML's index of the GPU (the local rank modulo the GPU count)
    name: str
    memory_bytes: int
    link: LinkRates | None  # the host link NVML reports, None when it cannot tell


def probe_gpu(local_rank: int) -> GpuInfo | None:
    """The GPU local rank `local_rank` computes on, or None without a GPU, driver or NVML."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return None
        index = local_rank % count
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        return GpuInfo(index, name, memory, _host_link(pynvml, handle, name))
    except Exception:
        return None
    finally:
        pynvml.nvmlShutdown()


def _host_link(pynvml, handle, name: str) -> LinkRates | None:
    """NVLink to the CPU when a link's remote end is the CPU (POWER9) or the chip is a Grace
    superchip, else PCIe generation and width; None when NVML cannot tell."""
    if "GH200" in name or "GB200" in name:
        return NAMED_LINKS["c2c"]
    cpu_links = 0
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            remote = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
        except Exception:
            continue
        if remote == getattr(pynvml, "NVML_NVLINK_DEVICE_TYPE_IBMNPU", 1):
            cpu_links += 1
    if cpu_links:
        return NAMED_LINKS["nvlink2"]
    try:
        generation = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)
        width = pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)
    except Exception:
        return None
    return pcie_link(int(generation), int(width))
