"""The host-device link of one rank: how fast activations move out (D2H) and back (H2D).

Named links carry effective rates (what pinned `cudaMemcpyAsync` reaches, not the signalling rate):

| name | H2D GB/s | D2H GB/s | source |
| --- | --- | --- | --- |
| pcie3 | 12 | 12 | PCIe gen3 x16: 15.75 GB/s raw; ~12 GB/s in pinned-copy bandwidth tests |
| pcie4 | 24 | 24 | PCIe gen4 x16: 31.5 GB/s raw; ~24-26 GB/s measured |
| pcie5 | 48 | 48 | PCIe gen5 x16: 63 GB/s raw; ~48-55 GB/s measured |
| nvlink2 | 68 | 68 | POWER9 + V100 over NVLink 2.0 (3 bricks, 75 GB/s raw), ~68 GB/s measured (the LMS papers' AC922) |
| c2c | 375 | 297 | Grace Hopper NVLink-C2C (450 GB/s per direction raw), measured H2D 375 / D2H 297 |

A number (GB/s) sets both directions. `auto` asks NVML on a GPU (lms_core.nvml); without one it
falls back to the recipe's `lms.link_fallback` and says so (launcher.lms.target chooses).
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class LinkRates:
    name: str
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    source: str

    def describe(self) -> str:
        return (f"{self.name}: H2D {self.h2d_bytes_per_s / GB:.0f} GB/s, D2H {self.d2h_bytes_per_s / GB:.0f} GB/s "
                f"({self.source})")


NAMED_LINKS = {
    "pcie3": LinkRates("pcie3", 12 * GB, 12 * GB, "table: PCIe gen3 x16 effective"),
    "pcie4": LinkRates("pcie4", 24 * GB, 24 * GB, "table: PCIe gen4 x16 effective"),
    "pcie5": LinkRates("pcie5", 48 * GB, 48 * GB, "table: PCIe gen5 x16 effective"),
    "nvlink2": LinkRates("nvlink2", 68 * GB, 68 * GB, "table: POWER9-V100 NVLink 2.0 measured"),
    "c2c": LinkRates("c2c", 375 * GB, 297 * GB, "table: Grace Hopper NVLink-C2C measured"),
}
INFINITE = LinkRates("infinite", float("inf"), float("inf"), "no transfer time (Grappler's assumption)")
_PCIE_BY_GENERATION = {3: "pcie3", 4: "pcie4", 5: "pcie5"}


def link_named(spec: str | float) -> LinkRates:
    """`pcie4`, or a number of GB/s (also as text: `25` or `25GB/s`, as its name reads) -> rates.
    Raises ValueError naming the valid choices."""
    if isinstance(spec, str):
        try:  # "25" from a flag, or "25GB/s" as a stated rate's name reads
            spec = float(spec.removesuffix("GB/s"))
        except ValueError:
            pass
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        if spec <= 0:
            raise ValueError(f"a link rate must be > 0 GB/s; got {spec}")
        return LinkRates(f"{spec:g}GB/s", spec * GB, spec * GB, "recipe: stated rate")
    try:
        return NAMED_LINKS[str(spec)]
    except KeyError:
        raise ValueError(f"unknown link {spec!r}; use auto, {', '.join(NAMED_LINKS)} or a rate in GB/s") from None


def pcie_link(generation: int, width: int) -> LinkRates:
    """What NVML reports for a PCIe-attached GPU -> rates (scaled from x16 by the lane count)."""
    base = NAMED_LINKS.get(_PCIE_BY_GENERATION.get(generation, ""), None)
    if base is None:
        base = NAMED_LINKS["pcie5"] if generation > 5 else NAMED_LINKS["pcie3"]
    scale = min(width, 16) / 16
    return LinkRates(f"pcie{generation}x{width}", base.h2d_bytes_per_s * scale, base.d2h_bytes_per_s * scale,
                     f"NVML: PCIe gen{generation} x{width}")
